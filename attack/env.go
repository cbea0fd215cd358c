package attack

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Env holds what the harness plants on the host for the attacks that look
// for something of the host's: a fake credentials file under the invoking
// user's home, a fake internal service on the loopback interface, unix
// sockets at paths any uid may write to, as a host daemon's are, and an
// abstract unix name in the host's network namespace. The file and the
// service hold random tokens that appear nowhere in the programs, so that
// seeing a token in a program's output proves the program reached the file
// or the service; the sockets record which runs' greetings they received,
// so that a run's reaching them is proved on the host side.
//
// Plant creates an Env; Close removes the files and stops the listeners. An
// Env is safe for concurrent use by several Runs; Runs of the network
// attack on one Env take turns, so that the connections the service sees
// belong to one run.
type Env struct {
	// CredentialsPath is the planted file, e.g.
	// /root/.moat-attack-1f2e3d4c/.aws/credentials, mode 0600.
	CredentialsPath string
	// ServicePort is the service's TCP port, on 127.0.0.1 and, when the
	// host has IPv6, on ::1.
	ServicePort int
	// StreamSocket and DgramSocket are the unix stream and datagram sockets
	// the harness listens on, e.g. /tmp/moat-attack-sock-1f2e3d4c/stream,
	// mode 0777 in a directory of mode 0777: like /dev/log or a daemon's
	// socket, any uid may write to them.
	StreamSocket, DgramSocket string
	// AbstractName is the abstract unix name (without the leading NUL) the
	// harness listens on, stream and datagram, in its own network
	// namespace: the host's, when the harness runs on the host.
	AbstractName string

	dir          string // the planted directory, removed by Close
	sockDir      string // the sockets' directory, removed by Close
	credToken    string // the secret key written in the file
	serviceToken string // what the service answers

	listeners []net.Listener
	conns     atomic.Int64   // connections the service accepted
	wg        sync.WaitGroup // the service's and the sockets' goroutines
	netTurn   sync.Mutex     // held by a Run of the network attack

	inbox    inbox
	unixL    []*net.UnixListener // the stream sockets, path and abstract
	unixG    []*net.UnixConn     // the datagram sockets, path and abstract
	inflight atomic.Int64        // stream connections still being read

	egress    *egressEnv // the servers of the egress probes
	egressDir string     // their CA's directory, removed by Close

	closeOnce sync.Once
	closeErr  error
}

// Plant writes the fake credentials file under the home directory of the
// invoking user (os.UserHomeDir), starts the fake service and listens on
// the unix sockets, by path under os.TempDir and by abstract name. The
// caller must Close the Env.
func Plant(ctx context.Context) (_ *Env, err error) {
	e := &Env{}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	if err := e.plantCredentials(); err != nil {
		return nil, err
	}
	if err := e.startService(ctx); err != nil {
		return nil, err
	}
	if err := e.startSockets(); err != nil {
		return nil, err
	}
	if err := e.startEgress(ctx); err != nil {
		return nil, err
	}
	return e, nil
}

func (e *Env) plantCredentials() error {
	home, err := os.UserHomeDir()
	if err != nil {
		return fmt.Errorf("attack: plant credentials: %w", err)
	}
	dir, err := os.MkdirTemp(home, ".moat-attack-")
	if err != nil {
		return fmt.Errorf("attack: plant credentials: %w", err)
	}
	e.dir = dir
	aws := filepath.Join(dir, ".aws")
	if err := os.Mkdir(aws, 0o700); err != nil {
		return fmt.Errorf("attack: plant credentials: %w", err)
	}
	e.credToken = randomText(40)
	content := fmt.Sprintf("[default]\naws_access_key_id = AKIA%s\naws_secret_access_key = %s\n",
		strings.ToUpper(randomText(16)), e.credToken)
	e.CredentialsPath = filepath.Join(aws, "credentials")
	if err := os.WriteFile(e.CredentialsPath, []byte(content), 0o600); err != nil {
		return fmt.Errorf("attack: plant credentials: %w", err)
	}
	return nil
}

func (e *Env) startService(ctx context.Context) error {
	e.serviceToken = "moat-internal-" + randomText(32)
	var lc net.ListenConfig
	v4, err := lc.Listen(ctx, "tcp4", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("attack: start the fake service: %w", err)
	}
	e.listeners = append(e.listeners, v4)
	e.ServicePort = v4.Addr().(*net.TCPAddr).Port
	// The same port on ::1, when the host has IPv6 and the port is free
	// there; the service is reachable on 127.0.0.1 either way.
	if v6, err := lc.Listen(ctx, "tcp6", net.JoinHostPort("::1", fmt.Sprint(e.ServicePort))); err == nil {
		e.listeners = append(e.listeners, v6)
	}
	for _, l := range e.listeners {
		e.wg.Add(1)
		go e.serve(l)
	}
	return nil
}

// serve answers every connection on l with the service token.
func (e *Env) serve(l net.Listener) {
	defer e.wg.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // e.g. out of file descriptors
			continue
		}
		e.conns.Add(1)
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			defer c.Close()
			c.SetWriteDeadline(time.Now().Add(2 * time.Second))
			c.Write([]byte(e.serviceToken + "\n"))
		}()
	}
}

// Close stops the service and removes the planted files. It may be called
// more than once; later calls return the first call's result.
func (e *Env) Close() error {
	e.closeOnce.Do(func() {
		var errs []error
		for _, l := range e.listeners {
			if err := l.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		for _, l := range e.unixL {
			if err := l.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		for _, c := range e.unixG {
			if err := c.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		errs = append(errs, e.closeEgress()...)
		e.wg.Wait()
		for _, d := range []string{e.dir, e.sockDir, e.egressDir} {
			if d == "" {
				continue
			}
			if err := os.RemoveAll(d); err != nil {
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			e.closeErr = fmt.Errorf("attack: close: %w", err)
		}
	})
	return e.closeErr
}

// randomText returns n random lowercase hex digits.
func randomText(n int) string {
	b := make([]byte, (n+1)/2)
	rand.Read(b)
	return hex.EncodeToString(b)[:n]
}
