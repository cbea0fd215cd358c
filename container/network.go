package container

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/internal/egress"
)

// The network of a Sandbox with an egress proxy (Config.Egress).
//
// Every container still has network mode none: a network namespace of its
// own holding nothing but its loopback, no other interface, no route. moat
// brings that loopback up and listens on 127.0.0.1:3128 inside it
// (egress.ListenIn, from moat's own process, through /proc/<init>/ns/net)
// once the container's init runs and before the code goes in, and serves
// the listener with the proxy (one egress.Run per container, or per
// session). So the code reaches moat's listener and nothing else: any
// other address has no route (ENETUNREACH), any other port of the loopback
// has nobody listening, UDP and ICMP stay on the loopback, there is no
// resolver (no /etc/resolv.conf; glibc's fallback 127.0.0.1:53 has no
// server), NET_RAW is dropped with every capability, and moat's seccomp
// profile then allows sockets of AF_UNIX, AF_INET and AF_INET6 only
// (AF_VSOCK, whose ports are not namespaced, AF_NETLINK, AF_PACKET and
// every other family stay refused; see allowInet). Without an egress
// proxy nothing of this happens: the loopback stays down and the profile
// allows AF_UNIX sockets only.
//
// The code's environment gets the proxy's (HTTP_PROXY and the rest, and
// the secrets' placeholders, unique to the container or session) at the
// container's creation; the proxy's CA bundle is a host file that moat
// writes as root at New, before any container exists, and that every
// container gets as a read-only bind mount at caPath and over the image's
// trust store (trustStore): the root is read-only, and a file in one of the
// run's tmpfs mounts would be the code's to change. Its content is public
// (certificates, no key).

// caPath is where the proxy's CA bundle is inside a container; trustStore
// is the Debian trust store's path, where OpenSSL's default bundle points.
const (
	caPath     = "/etc/moat/ca.pem"
	trustStore = "/etc/ssl/certs/ca-certificates.crt"
)

// proxyURL is the proxy's address as the code names it.
var proxyURL = "http://127.0.0.1:" + strconv.Itoa(egress.Port)

// egressRun is what a container or session uses of its egress.Run; tests
// stand in for it (see newEgressRun).
type egressRun interface {
	Env(proxyURL, caFile string) []string
	Serve(l net.Listener) error
	Notes() []string
	Close()
}

// newEgressRun makes the egress run of a container or session. A Sandbox
// takes it at New; tests replace it before.
var newEgressRun = func(p *egress.Proxy) egressRun { return p.NewRun() }

// caDir is where moat keeps the CA bundle files it mounts into containers.
const caDir = "/run/moat/container"

// writeCABundle writes bundle to a root-owned file named by its digest in
// caDir, once, and returns its path. The file is never removed: sessions
// outlive their Sandbox, and it is small and public.
func writeCABundle(bundle []byte) (string, error) {
	if err := os.MkdirAll(caDir, 0o755); err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	// Only root may write there: the engine mounts the file into every
	// container, so whoever could replace it would choose what the code
	// trusts.
	st, err := os.Lstat(caDir)
	if err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !st.IsDir() || !ok || sys.Uid != 0 || st.Mode().Perm()&0o022 != 0 {
		return "", fmt.Errorf("container: %s is not a directory of root's that others cannot write", caDir)
	}
	sum := sha256.Sum256(bundle)
	path := filepath.Join(caDir, "ca-"+hex.EncodeToString(sum[:])[:16]+".pem")
	tmp, err := os.CreateTemp(caDir, ".ca-*")
	if err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(bundle); err != nil {
		tmp.Close()
		return "", fmt.Errorf("container: write the egress CA bundle: %w", err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return "", fmt.Errorf("container: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	return path, nil
}

// listenIn places the proxy's listener in the network namespace of the
// container whose init is pid, held by pidfd. The pidfd is checked after:
// a live process keeps its pid, so if the init still runs, the namespace
// was its own and not that of a process that took its pid meanwhile.
func listenIn(pidfd, pid int) (net.Listener, error) {
	l, err := egress.ListenIn(fmt.Sprintf("/proc/%d/ns/net", pid), egress.Port)
	if err != nil {
		return nil, unavailable("moat cannot place its egress proxy in the container's network namespace", "run moat as root on the engine's own host", err)
	}
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	if n, err := unix.Poll(fds, 0); err != nil || n > 0 {
		l.Close()
		return nil, fmt.Errorf("container: the container's init ended while moat placed its egress proxy (%v)", err)
	}
	return l, nil
}

// netDescribe says how the Sandbox's containers reach the network.
func (b *backend) netDescribe() string {
	if b.egress == nil {
		return "network: none (network mode none, loopback down, inet sockets refused by seccomp)"
	}
	return "network: only moat's egress proxy, listening on 127.0.0.1:" + strconv.Itoa(egress.Port) +
		" inside each container's own network namespace (loopback only, no route, no resolver, NET_RAW dropped; seccomp allows unix and inet sockets only, no vsock); " +
		b.egress.Describe()
}

// serveEgress serves l with r until either is closed; Serve closes l.
func (b *backend) serveEgress(r egressRun, l net.Listener) {
	go func() {
		if err := r.Serve(l); err != nil {
			b.log.Debug("container: egress proxy", "err", err)
		}
	}()
}
