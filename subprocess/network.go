package subprocess

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"

	"github.com/moatsandbox/moat/internal/egress"
)

// The network of a run (Config.Egress, strict hardening only).
//
// Every helper has a network namespace of its own (helperproc.go). Without
// Egress its loopback stays down and the code cannot make a socket at all
// (seccomp). With Egress, moat places a TCP listener on 127.0.0.1:3128
// inside the helper's namespace as soon as the helper is started, before
// any run is given to it (egress.ListenIn, which brings the loopback up);
// the listener's socket is moat's, and its connections are served by the
// egress proxy outside. Nothing else is in the namespace: no interface but
// the loopback, no address but 127.0.0.1/8 and ::1, no route off it, no
// resolver. The code gets:
//
//   - seccomp's TCP variant (seccomp.FilterTCP): socket() of an IPv4 TCP
//     socket and connect() only; UDP, raw and ICMP sockets, IPv6, AF_UNIX,
//     netlink, packet and AF_VSOCK sockets stay refused, and so do bind,
//     listen and accept, so the code cannot serve a port of its own either;
//   - Landlock's TCP connect right for port 3128 alone (ABI 4 and later);
//   - the proxy's environment (HTTP_PROXY and the like, the CA bundle's
//     path, the secrets' placeholders: egress.Run.Env);
//   - the CA bundle (egress.Proxy.CABundle) as a read-only file of moat's,
//     bound into the run's root at its host path and readable under
//     Landlock.
//
// So a connection from the code reaches moat's listener or nothing, and a
// name lookup fails (no resolv.conf, no UDP). A one-shot run has an
// egress.Run of its own (its placeholders and its notes); a session has one
// for its life, served on each of its helpers' listeners in turn. A
// listener lives as long as its helper: it is closed when the helper has
// ended, so that the namespace it holds goes with it.

// proxyURL is the proxy's address as the code sees it.
var proxyURL = "http://127.0.0.1:" + strconv.Itoa(egress.Port)

// serve serves l with r until l or r is closed. A variable, so that a test
// can put its own handler behind the listener.
var serve = func(b *backend, r *egress.Run, l net.Listener) {
	if err := r.Serve(l); err != nil && !errors.Is(err, net.ErrClosed) {
		b.log.Warn("subprocess: egress proxy", "err", err)
	}
}

// listenIn places the proxy's listener in the network namespace of the
// started helper whose host pid is pid. The caller closes it.
func (b *backend) listenIn(pid int) (net.Listener, error) {
	l, err := egress.ListenIn("/proc/"+strconv.Itoa(pid)+"/ns/net", egress.Port)
	if err != nil {
		return nil, unavailable("cannot place the egress proxy's listener in the run's network namespace", "", err)
	}
	return l, nil
}

// writeCA writes the proxy's CA bundle where the runs read it: a file of
// moat's in the runs directory, named after the owner so that New's reaper
// removes it once its owner is dead, mode 0644 (the run's uid reads it).
func (b *backend) writeCA() error {
	var rnd [4]byte
	rand.Read(rnd[:])
	path := filepath.Join(b.runsDir, b.owner+"-ca-"+hex.EncodeToString(rnd[:])+".pem")
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return unavailable("cannot write the egress proxy's CA bundle", "", err)
	}
	_, err = f.Write(b.cfg.Egress.CABundle())
	if err == nil {
		err = f.Chmod(0o644) // whatever the umask
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return unavailable("cannot write the egress proxy's CA bundle", "", err)
	}
	b.caPath = path
	return nil
}

// removeCA removes the CA bundle, if any.
func (b *backend) removeCA() {
	if b.caPath == "" {
		return
	}
	if err := os.Remove(b.caPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		b.log.Warn("subprocess: remove the egress CA bundle", "err", err)
	}
}

// withNetwork gives the spec of a run served by r its network: the
// proxy's environment, the CA bundle in its root and under Landlock, the
// TCP connect right to the proxy's port and seccomp's TCP variant.
func (b *backend) withNetwork(sp *spec, r *egress.Run) {
	sp.Env = append(sp.Env, r.Env(proxyURL, b.caPath)...)
	sp.Network = true
	if sp.Root != nil {
		sp.Root.ReadOnly = append(sp.Root.ReadOnly, b.caPath)
	}
	if sp.Landlock != nil {
		sp.Landlock.ReadFiles = append(sp.Landlock.ReadFiles, b.caPath)
		sp.Landlock.ConnectTCP = append(sp.Landlock.ConnectTCP, egress.Port)
	}
}

// errNetworkNeedsStrict is New's refusal of Egress without strict
// hardening, whose runs share the host's network.
func errNetworkNeedsStrict() error {
	return unavailable(fmt.Sprintf("a network (egress proxy) needs strict hardening: with hardening=%s the code shares the host's network and its traffic cannot be confined to the proxy", HardeningTutorial),
		"use the strict hardening (as root)", nil)
}
