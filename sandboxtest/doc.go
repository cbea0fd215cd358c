// Package sandboxtest is the conformance suite every moat isolation level
// must pass: one call checks that an implementation of [moat.Sandbox] keeps
// the contract, in the spirit of testing/fstest.TestFS and containerd's
// snapshot test suite.
//
// A level runs it from its own test file with one line:
//
//	func TestConformance(t *testing.T) {
//		sandboxtest.Run(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
//			sb, err := subprocess.New(subprocess.Config{Limits: l})
//			if err != nil {
//				t.Fatal(err)
//			}
//			return sb
//		}, sandboxtest.Options{})
//	}
//
// The factory builds a sandbox with the limits a check needs (small ones, to
// stay fast); the suite closes it. A level that keeps things on the host
// (containers, VMs, state directories) passes [Options.Leftovers] so that the
// suite can fail when one outlives its sandbox.
//
// What the suite checks, one subtest each (run one alone with
// -run 'TestConformance/Limits/Memory'):
//
//   - Streams, ExitCode, Result: stdout and stderr kept apart and exact, exit
//     codes, an uncaught exception, the Result's level and duration.
//   - Request: empty code is refused with [moat.ErrInvalid]; code holding NUL
//     bytes or invalid UTF-8 is Python's syntax error, not the sandbox's;
//     output that is not UTF-8 comes back byte for byte and the Result still
//     marshals to JSON.
//   - Environment: no variable of the host reaches the code, through its
//     environment or another process's /proc/<pid>/environ; stdin is empty.
//   - WorkDir: writable, fresh per run, and gone from the host afterwards.
//   - Limits: wall time (a tree that calls setsid and ignores SIGTERM is
//     killed whole), CPU time (of one process and of the tree), memory (of
//     one process and of the tree), processes, file size, disk, output (the
//     cap bounds what the Request's writers get as well as the Result, and
//     code that prints forever is ended long before its wall time) and open
//     files, each with the Reason the contract names.
//   - Signal, Cancel, Concurrency, Close: a crash by signal, cancelling
//     before and during a run, many runs at once, and closing.
//   - NoLeaks, after everything: no goroutine of the test process left.
//
// After each subtest, once its sandboxes are closed, the suite checks that
// the level reports no leftovers and that the test process has no child it
// did not have before. Checks that start processes mark them with a random
// string in their command line and fail if the host still has one shortly
// after Run returns; checks that write files name them with a random string
// and search the host's temporary and state directories for it.
//
// Sessions have a suite of their own, [TestSessions], which a level that
// implements [moat.Sessioner] runs with the same factory:
//
//	sandboxtest.TestSessions(t, newSandbox, sandboxtest.SessionsOptions{})
//
// It checks that files persist between runs and through the file
// operations, that the operations refuse escapes and planted links, the
// limits of runs and of the session's disk, that nothing left behind runs
// between runs, that sessions are kept apart, the live interpreter, and
// closing (see TestSessions for the list).
//
// The network through moat's egress proxy has a suite of its own,
// [TestNetwork], which a level with Config.Egress runs with a factory that
// takes the proxy (nil: no network):
//
//	sandboxtest.TestNetwork(t, func(t *testing.T, p *egress.Proxy) moat.Sandbox { ... }, sandboxtest.NetworkOptions{})
//
// It stands up loopback upstreams (HTTP, HTTPS, a package index serving a
// wheel it builds, a name server for the proxy, a UDP listener) reached
// by names pinned with Network.Resolve, and checks from what they
// recorded that allowed names are reached, that unlisted names, IP
// addresses, names resolving to loopback, DNS, UDP, direct connections and
// SNI fronting are refused, that a secret reaches only its host as the
// real value while the code holds a placeholder, that pip installs through
// the proxy, and that a sandbox without a proxy has no network.
//
// The suite judges from the host where it can (processes, files) and never
// from the level's own word alone. It needs python3 in the sandbox, runs as
// the level's tests run (as root on CI), and must not be called from a
// parallel test.
package sandboxtest
