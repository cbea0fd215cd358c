package microvm

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"

	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// A VM with a network (Config.Egress) has one virtio-net device on QEMU's
// user network (libslirp) with restrict=on, which drops every packet the
// guest sends out of the VM but those of a connection to the one guestfwd
// address, proxyAddr:egress.Port. For each such connection QEMU runs the
// pipe (the agent's binary, in its host mode) with the connection as its
// standard input and output; the pipe connects to a unix socket moat
// listens on for this VM alone (mode 0600, owned by the VM's uid), and moat
// serves what it accepts with the VM's egress.Run. The agent gives the
// guest's device 10.0.2.15/24 and no default route, and the code the
// run's environment (the proxy's URL, the CA bundle's path, the secrets'
// placeholders) and the CA bundle at caFile.
//
// What restrict=on leaves, checked here with QEMU 7.2 and libslirp 4.7
// (TestNetwork*): slirp still answers, from inside QEMU, ARP, DHCP
// (BOOTP) and TFTP (an error: no tftp root) on its own address, and ICMP
// echo to its own two addresses, which the code cannot send (no raw or ping
// sockets for its uid); DNS to 10.0.2.3 and every other UDP, TCP to any
// other address or port (the host's 10.0.2.2 included) are dropped. IPv6
// is off.
const (
	proxyAddr = "10.0.2.100"
	caFile    = "/etc/moat/ca.pem"
	netDesc   = "QEMU user networking, restrict=on, one guestfwd to moat's egress proxy"
	// socketDir holds the VMs' unix sockets; it is traversable by the VMs'
	// uids, each of which may connect to its own socket only.
	socketDir = "/run/moat/microvm-egress"
	// maxConns bounds one VM's connections to the proxy at once; the
	// guest's others are closed as they come. (QEMU's uid has its number
	// of processes, and so of pipes, bounded too: see qemuNproc.)
	maxConns = 64
)

// proxyURL is the proxy's address as the code sees it.
var proxyURL = "http://" + proxyAddr + ":" + fmt.Sprint(egress.Port)

// NetSpec is a VM's network: the guestfwd's pipe connects to Socket.
type NetSpec struct {
	// Socket is moat's unix socket of this VM; the VMM makes it the VM
	// uid's. Empty for a template's boot, whose guest connects nowhere.
	Socket string
	// Pipe is the program QEMU runs per connection, as
	// `Pipe egress-pipe Socket`: the guest agent's binary.
	Pipe string
}

// vmNet is one VM's (or one session's) way out: the listener behind its
// guestfwd and the egress run that serves what it accepts.
type vmNet struct {
	run   *egress.Run
	l     net.Listener
	spec  *NetSpec
	serve func(net.Conn) // run.ServeConn, or a test's

	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	once  sync.Once
}

// proxyHooks are how a VM uses its proxy run; this package's tests replace
// them with a handler of their own (the proxy's behaviour is the proxy's
// tests').
var proxyHooks = struct {
	serve  func(r *egress.Run, c net.Conn)
	env    func(r *egress.Run, proxyURL, caFile string) []string
	bundle func(p *egress.Proxy) []byte
	notes  func(r *egress.Run) []string
}{
	serve:  (*egress.Run).ServeConn,
	env:    (*egress.Run).Env,
	bundle: (*egress.Proxy).CABundle,
	notes:  (*egress.Run).Notes,
}

// newNet makes a VM's listener and run. The caller closes it.
func (b *backend) newNet() (*vmNet, error) {
	if err := os.MkdirAll(socketDir, 0o711); err != nil {
		return nil, fmt.Errorf("microvm: egress: %w", err)
	}
	if err := os.Chmod(socketDir, 0o711); err != nil {
		return nil, fmt.Errorf("microvm: egress: %w", err)
	}
	// OWNER-RANDOM.sock: the reaper of a later moat removes those of a
	// moat that died.
	me, err := owner.Self(ownersDir)
	if err != nil {
		return nil, fmt.Errorf("microvm: egress: %w", err)
	}
	var id [12]byte
	rand.Read(id[:])
	path := filepath.Join(socketDir, me+"-"+hex.EncodeToString(id[:])+".sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("microvm: egress: %w", err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("microvm: egress: %w", err)
	}
	r := b.cfg.Egress.NewRun()
	n := &vmNet{run: r, l: l, spec: &NetSpec{Socket: path, Pipe: b.agent}, conns: map[net.Conn]struct{}{}}
	n.serve = func(c net.Conn) { proxyHooks.serve(r, c) }
	n.wg.Add(1)
	go n.accept()
	return n, nil
}

func (n *vmNet) accept() {
	defer n.wg.Done()
	for {
		c, err := n.l.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			return
		}
		n.mu.Lock()
		if n.conns == nil || len(n.conns) >= maxConns {
			n.mu.Unlock()
			c.Close()
			continue
		}
		n.conns[c] = struct{}{}
		n.mu.Unlock()
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			n.serve(c)
			c.Close()
			n.mu.Lock()
			delete(n.conns, c)
			n.mu.Unlock()
		}()
	}
}

// notes returns the proxy's decisions since the last call.
func (n *vmNet) notes() []string {
	if n == nil {
		return nil
	}
	return proxyHooks.notes(n.run)
}

// close ends the listener (removing its socket), the run and every
// connection, and waits for them. It may be called more than once, and on
// nil.
func (n *vmNet) close() {
	if n == nil {
		return
	}
	n.once.Do(func() {
		n.l.Close()
		n.run.Close()
		n.mu.Lock()
		for c := range n.conns {
			c.Close()
		}
		n.conns = nil
		n.mu.Unlock()
		n.wg.Wait()
	})
}

// egressFrame is what the agent gets for the code: the run's environment
// and the CA bundle.
func (b *backend) egressFrame(n *vmNet) *wire.Egress {
	if n == nil {
		return nil
	}
	return &wire.Egress{Env: proxyHooks.env(n.run, proxyURL, caFile), CABundle: string(proxyHooks.bundle(b.cfg.Egress))}
}

// egressReserve is the room a Run frame keeps for the egress part, taken
// from the code it may carry.
func (b *backend) egressReserve() int {
	if b.cfg.Egress == nil {
		return 0
	}
	// JSON escapes a PEM's newlines: at most one more byte in 32.
	return len(proxyHooks.bundle(b.cfg.Egress))*33/32 + 64<<10
}

var errNoNet = errors.New("microvm: the guest reported no network device")
