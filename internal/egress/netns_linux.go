package egress

import (
	"fmt"
	"net"
	"runtime"

	"golang.org/x/sys/unix"
)

// ListenIn returns a TCP listener on 127.0.0.1:port inside the network
// namespace at nsPath (such as /proc/PID/ns/net), after bringing that
// namespace's loopback up. The listener's socket belongs to that namespace
// for its whole life, though moat's process stays in its own: connections
// to 127.0.0.1:port from inside reach moat, and nothing of the namespace
// reaches anywhere else through it.
//
// It does its work on a locked OS thread that enters the namespace and
// goes back; if going back fails the thread is left locked, so Go ends it
// rather than reuse a thread in the sandbox's namespace.
func ListenIn(nsPath string, port int) (net.Listener, error) {
	target, err := unix.Open(nsPath, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("egress: open network namespace %s: %w", nsPath, err)
	}
	defer unix.Close(target)
	type result struct {
		l   net.Listener
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		own, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("egress: open own network namespace: %w", err)}
			return
		}
		defer unix.Close(own)
		if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("egress: enter network namespace %s: %w", nsPath, err)}
			return
		}
		l, err := listenLoopback(port)
		if err := unix.Setns(own, unix.CLONE_NEWNET); err != nil {
			// The thread stays locked: Go ends it with this goroutine.
			if l != nil {
				l.Close()
			}
			ch <- result{err: fmt.Errorf("egress: leave network namespace %s: %w", nsPath, err)}
			return
		}
		runtime.UnlockOSThread()
		ch <- result{l, err}
	}()
	r := <-ch
	return r.l, r.err
}

// listenLoopback brings up the loopback of the thread's network namespace
// and listens on 127.0.0.1:port there.
func listenLoopback(port int) (net.Listener, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("egress: socket: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return nil, fmt.Errorf("egress: %w", err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return nil, fmt.Errorf("egress: loopback flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return nil, fmt.Errorf("egress: bring the loopback up: %w", err)
	}
	l, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return nil, fmt.Errorf("egress: listen in the sandbox's namespace: %w", err)
	}
	return l, nil
}
