package attack

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
)

// The unix sockets of an Env. The programs send them a greeting holding the
// run's nonce; a Run registers its nonce before the program starts and
// takes, after the run, the list of sockets its greeting reached. Only
// registered nonces are kept, so a program that floods the sockets costs
// the harness nothing.

// greeting matches what the programs send (programs/common.py, greeting);
// sentinel what the harness sends itself to flush a socket.
var (
	greeting = regexp.MustCompile(`MOAT-HELLO:([0-9a-f]{32}) ([a-z_]{1,32})`)
	sentinel = regexp.MustCompile(`MOAT-FLUSH:([0-9a-f]{32})`)
)

// Bounds of the sockets' readers.
const (
	maxGreeting   = 64 << 10        // bytes read from one datagram or connection
	streamTimeout = 2 * time.Second // how long a connection is read
	flushTimeout  = 3 * time.Second // how long flush waits at most
)

// An inbox records where the greetings of the runs in progress arrived.
type inbox struct {
	mu      sync.Mutex
	want    map[string]map[string][]string // registered nonce -> socket -> the ways its greeting reached it
	flushes map[string]chan struct{}       // a sentinel sent -> closed on its arrival
}

// expect registers a run's nonce.
func (b *inbox) expect(nonce string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.want == nil {
		b.want = make(map[string]map[string][]string)
	}
	b.want[nonce] = make(map[string][]string)
}

// take unregisters nonce and returns the sockets its greeting reached, in
// order, each with the ways the program took, e.g. "datagram socket
// /tmp/x/dgram by pair_sendto, pair_reconnect".
func (b *inbox) take(nonce string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for where, ways := range b.want[nonce] {
		out = append(out, where+" by "+strings.Join(ways, ", "))
	}
	delete(b.want, nonce)
	slices.Sort(out)
	return out
}

// awaitSentinel returns a new sentinel, the text to send, and a channel
// closed when it arrives.
func (b *inbox) awaitSentinel() (id, text string, arrived <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.flushes == nil {
		b.flushes = make(map[string]chan struct{})
	}
	s := randomText(32)
	ch := make(chan struct{})
	b.flushes[s] = ch
	return s, "MOAT-FLUSH:" + s + "\n", ch
}

// forget drops the sentinels ids, arrived or not.
func (b *inbox) forget(ids []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, id := range ids {
		delete(b.flushes, id)
	}
}

// deliver records what arrived at the socket where.
func (b *inbox) deliver(where string, data []byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range greeting.FindAllSubmatch(data, -1) {
		sockets, ok := b.want[string(m[1])]
		if way := string(m[2]); ok && !slices.Contains(sockets[where], way) {
			sockets[where] = append(sockets[where], way)
		}
	}
	for _, m := range sentinel.FindAllSubmatch(data, -1) {
		if ch, ok := b.flushes[string(m[1])]; ok {
			close(ch)
			delete(b.flushes, string(m[1]))
		}
	}
}

// startSockets listens on the unix sockets: by path, in a new directory of
// mode 0777 under os.TempDir, and by abstract name.
func (e *Env) startSockets() error {
	dir, err := os.MkdirTemp("", "moat-attack-sock-")
	if err != nil {
		return fmt.Errorf("attack: plant sockets: %w", err)
	}
	e.sockDir = dir
	if err := os.Chmod(dir, 0o777); err != nil {
		return fmt.Errorf("attack: plant sockets: %w", err)
	}
	e.StreamSocket = filepath.Join(dir, "stream")
	e.DgramSocket = filepath.Join(dir, "dgram")
	e.AbstractName = "moat-attack-" + randomText(16)
	abstract := "@" + e.AbstractName
	for _, s := range []struct {
		addr, where string
		stream      bool
	}{
		{e.StreamSocket, "stream socket " + e.StreamSocket, true},
		{e.DgramSocket, "datagram socket " + e.DgramSocket, false},
		{abstract, "abstract stream socket " + abstract, true},
		{abstract, "abstract datagram socket " + abstract, false},
	} {
		if s.stream {
			l, err := net.ListenUnix("unix", &net.UnixAddr{Name: s.addr, Net: "unix"})
			if err != nil {
				return fmt.Errorf("attack: plant sockets: %w", err)
			}
			e.unixL = append(e.unixL, l)
			e.wg.Add(1)
			go e.serveStream(l, s.where)
		} else {
			c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: s.addr, Net: "unixgram"})
			if err != nil {
				return fmt.Errorf("attack: plant sockets: %w", err)
			}
			e.unixG = append(e.unixG, c)
			e.wg.Add(1)
			go e.serveDgram(c, s.where)
		}
		if s.addr != abstract {
			if err := os.Chmod(s.addr, 0o777); err != nil {
				return fmt.Errorf("attack: plant sockets: %w", err)
			}
		}
	}
	return nil
}

// serveStream reads every connection to l, up to maxGreeting bytes or
// streamTimeout, into the inbox.
func (e *Env) serveStream(l *net.UnixListener, where string) {
	defer e.wg.Done()
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // e.g. out of file descriptors
			continue
		}
		e.inflight.Add(1)
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			defer e.inflight.Add(-1)
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(streamTimeout))
			buf, _ := io.ReadAll(io.LimitReader(c, maxGreeting))
			e.inbox.deliver(where, buf)
		}()
	}
}

// serveDgram reads every datagram sent to c into the inbox.
func (e *Env) serveDgram(c *net.UnixConn, where string) {
	defer e.wg.Done()
	buf := make([]byte, maxGreeting)
	for {
		n, _, err := c.ReadFromUnix(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		e.inbox.deliver(where, buf[:n])
	}
}

// flush returns once the sockets have delivered everything sent to them
// before it was called: a sentinel the harness sends to each socket, behind
// what came before, has arrived, and no stream connection is still being
// read. It gives up after flushTimeout, so that a concurrent run holding a
// connection open delays it only so long.
func (e *Env) flush() {
	deadline := time.Now().Add(flushTimeout)
	var arrived []<-chan struct{}
	var ids []string
	defer func() { e.inbox.forget(ids) }()
	send := func(network string, addr net.Addr) {
		id, text, ch := e.inbox.awaitSentinel()
		ids = append(ids, id)
		c, err := net.DialTimeout(network, addr.String(), time.Until(deadline))
		if err != nil {
			return
		}
		defer c.Close()
		c.SetWriteDeadline(deadline)
		if _, err := c.Write([]byte(text)); err == nil {
			arrived = append(arrived, ch)
		}
	}
	for _, l := range e.unixL {
		send("unix", l.Addr())
	}
	for _, c := range e.unixG {
		send("unixgram", c.LocalAddr())
	}
	for _, ch := range arrived {
		select {
		case <-ch:
		case <-time.After(time.Until(deadline)):
			return
		}
	}
	for e.inflight.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}
