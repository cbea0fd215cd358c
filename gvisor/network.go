package gvisor

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"

	"github.com/moatsandbox/moat/internal/egress"
)

// The network of a sandbox with an egress proxy (Config.Egress).
//
// Without one, runsc runs with --network=none: gVisor's own network stack
// with a loopback device and nothing else, which no host socket backs.
//
// With one, the sandbox's only way out is moat's proxy, and the reason is
// the host kernel's network namespaces, not anything gVisor decides:
//
//   - moat starts runsc (and so the sentry and the gofer, which runsc
//     starts) in a network namespace of its own, made for this sandbox
//     (CLONE_NEWNET on runsc's process). A new namespace holds a loopback
//     device and nothing else: no other device, no route, no address of the
//     host. Nothing in the sandbox can create a namespace or move a device
//     (the code has no capability; the guest filter denies setns, unshare
//     and clone's namespace flags), and a device can only be moved into a
//     namespace from outside it.
//   - runsc runs with --network=host, so gVisor's TCP and UDP sockets are
//     host sockets of the sentry, in that namespace; the spec declares no
//     network namespace, because with --network=host runsc starts the
//     sandbox in a new, empty one when the spec asks for one (checked with
//     runsc 20240729), and in its own, moat's, otherwise.
//   - before the code runs, moat listens on 127.0.0.1:3128 inside that
//     namespace (egress.ListenIn, which also brings its loopback up) and
//     hands the listener to the proxy. Every other address is either
//     unreachable (no route) or a closed port of the sandbox's own
//     loopback: no DNS server, nothing answering UDP, no host service.
//   - gVisor has no AF_VSOCK and no AF_PACKET family, and its raw sockets
//     need CAP_NET_RAW (and runsc's --net-raw, which moat never passes);
//     AF_UNIX sockets are the sentry's own, and --host-uds=none keeps the
//     host's out of reach.
//
// The code finds the proxy in its environment (egress.Run.Env: HTTP_PROXY,
// HTTPS_PROXY and their lower-case forms) and moat's CA bundle at caFile,
// a host file of the bundle bind-mounted read-only, with the code's view
// of it owned by root and mode 0644.

// proxyURL is the proxy's address as the code sees it.
var proxyURL = fmt.Sprintf("http://127.0.0.1:%d", egress.Port)

// caMountDir is where the directory holding the CA bundle is mounted in
// the sandbox, read-only. It must exist in the root filesystem: runsc
// creates a missing mount point in the root filesystem on the host, even a
// read-only one, and moat never writes to the image.
const caMountDir = "/mnt"

// caFileName is the CA bundle's name in caMountDir.
const caFileName = "moat-ca.pem"

// caFile is the CA bundle's path in the sandbox.
var caFile = filepath.Join(caMountDir, caFileName)

// checkEgressRoot checks that the root filesystem has the mount point of
// the CA bundle.
func checkEgressRoot(root string) error {
	st, err := os.Lstat(filepath.Join(root, caMountDir))
	if err != nil {
		return fmt.Errorf("gvisor: no %s in the root filesystem to mount the egress proxy's CA bundle on: %w", caMountDir, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("gvisor: %s in the root filesystem is not a directory", caMountDir)
	}
	return nil
}

// egressEnv is what the code's environment gets for run r of the proxy.
func egressEnv(r *egress.Run) []string { return r.Env(proxyURL, caFile) }

// withEgress changes spec, about to be written to bundle, for a sandbox
// whose only way out is the proxy: no network namespace of the spec's (the
// sandbox stays in runsc's, moat's own), and the CA bundle written to the
// bundle and mounted read-only at caMountDir.
func withEgress(spec *ociSpec, bundle string, p *egress.Proxy) error {
	spec.Linux.Namespaces = slices.DeleteFunc(slices.Clone(spec.Linux.Namespaces), func(ns ociNamespace) bool {
		return ns.Type == "network"
	})
	dir := filepath.Join(bundle, "egress")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	ca := filepath.Join(dir, caFileName)
	if err := os.WriteFile(ca, p.CABundle(), 0o644); err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	// WriteFile's mode passes through the umask.
	if err := os.Chmod(ca, 0o644); err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	spec.Mounts = append(spec.Mounts, ociMount{Destination: caMountDir, Type: "bind", Source: dir,
		Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	return nil
}

// listenEgress places the proxy's listener in the network namespace of
// runsc's process pid and serves it with r. The caller has not reaped pid,
// so it names runsc until the caller waits for it.
func listenEgress(pid int, r *egress.Run) (net.Listener, error) {
	ns := fmt.Sprintf("/proc/%d/ns/net", pid)
	// Never moat's own namespace: the listener would then be the host's,
	// and the sandbox's sockets too.
	theirs, err1 := os.Stat(ns)
	own, err2 := os.Stat("/proc/thread-self/ns/net")
	if err1 != nil || err2 != nil || os.SameFile(theirs, own) {
		return nil, unavailable("runsc is not in a network namespace of its own", "", errors.Join(err1, err2))
	}
	l, err := egress.ListenIn(ns, egress.Port)
	if err != nil {
		return nil, unavailable("cannot place the egress proxy's listener in the sandbox's network namespace", "", err)
	}
	go r.Serve(l)
	return l, nil
}
