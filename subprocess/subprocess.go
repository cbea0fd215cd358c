// Package subprocess is moat's lightest isolation level: each run is a fresh
// python3 child process on the host kernel.
//
// With the default ("strict") hardening, which needs root, every run gets:
//
//   - a PID namespace whose init is moat's helper, so that the whole process
//     tree dies with the run, double-forks and setsid included;
//   - a root of its own (internal/helper/root.go): a private mount namespace holding only
//     read-only binds of the system directories, a few device nodes, the
//     working directory and a procfs of the run's own PID namespace
//     (hidepid), so that no other path of the host (socket files, /run,
//     /tmp, other runs, host processes) exists for the code by any name;
//   - a network namespace of its own with only a loopback that is down: no
//     host interface, address or route, and abstract unix names of its own;
//     and a UTS namespace named "moat", not the host. With Config.Egress
//     the loopback is up and holds one thing, moat's egress proxy listener
//     on 127.0.0.1:3128, the one address the code may connect to (see
//     network.go);
//   - a per-run cgroup (v2, or the v1 memory and pids hierarchies) for the
//     memory and process limits;
//   - a dedicated unprivileged uid and gid from a configurable range, so that
//     RLIMIT_NPROC holds and the invoking user's files are not readable;
//   - a private working directory on a size-limited tmpfs (noexec, nosuid,
//     nodev), its HOME, removed after the run: a shared object or binary the
//     run writes there cannot be mapped executable or run (a run whose
//     stderr shows the loader's "failed to map segment from shared object"
//     gets a note saying why; native code comes from the host's packages);
//   - rlimits for CPU time, file size, open files, processes and core dumps;
//   - no_new_privs, Landlock (read-only system directories, read-write only
//     the working directory, no TCP bind or connect, abstract unix sockets and
//     signals scoped to the sandbox, where the kernel's ABI has them) and a
//     seccomp filter that refuses socket() of every family (AF_UNIX too: a
//     unix socket reaches the host's socket files by path), keeping only
//     socketpair(AF_UNIX) of the stream and seqpacket types (a datagram end
//     takes a destination with every sendto and sendmsg), refuses bind,
//     connect, listen and accept (which could only re-aim a socketpair end),
//     and the dangerous system calls (with Config.Egress: IPv4 TCP sockets
//     and connect are allowed, Landlock lets them connect to port 3128
//     only);
//   - an empty environment (PATH, HOME, LANG only) and stdin from /dev/null.
//
// If any of these cannot be applied, [New] and [Sandbox.Run] return an error
// wrapping [moat.ErrUnavailable]; the level never runs code with less.
//
// A Sandbox is also a [moat.Sessioner]: a session keeps its tmpfs working
// directory and its uid between runs, and optionally one live interpreter
// (see session.go and interpreter.go).
//
// The run's life around the code — the checks of the request, the output
// cap, the wall time, cancellation, the verdict, Close — is the engine's
// (internal/engine); this package is its backend (backend.go): an instance
// is a helper process started ahead of its run (helperproc.go), a run is
// the helper given the run's spec (run.go), and what the host saw of its end
// is the run's evidence (evidence.go).
//
// The "tutorial" hardening keeps only plain rlimits (CPU, RLIMIT_AS for
// memory, file size, open files, core dumps), to reproduce the usual
// tutorial's baseline for comparison. It is never chosen implicitly.
//
// The restrictions are applied between fork and exec by a helper stage (internal/helper/helper.go): moat
// re-executes its own binary, which this package intercepts in its init
// function. Any binary that imports this package can therefore serve as the
// helper, test binaries included.
package subprocess

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/owner"
)

// Hardening selects how much of the protection a run gets.
type Hardening string

const (
	// HardeningStrict is every protection listed in the package doc. It is
	// the default and needs root.
	HardeningStrict Hardening = "strict"
	// HardeningTutorial keeps only plain rlimits. It exists to show what
	// the usual tutorial's sandbox lets through; never use it for real work.
	HardeningTutorial Hardening = "tutorial"
)

// notRootRemedy is the remedy for strict hardening without root. It names
// the one profile that runs without root and what that profile lets
// through: of the tutorial's six attacks (attack.All[:6]) it blocks the
// loop, the allocation and the big file only.
const notRootRemedy = "run moat as root; --hardening=tutorial runs without it but blocks only 3 of the tutorial's 6 attacks " +
	"(the loop, the allocation, the big file): a fork flood, a read of your credentials and a connection to this host's local services get through, " +
	"so never give it code you do not trust"

// ParseHardening returns the profile named s ("" means strict).
func ParseHardening(s string) (Hardening, error) {
	switch Hardening(s) {
	case "", HardeningStrict:
		return HardeningStrict, nil
	case HardeningTutorial:
		return HardeningTutorial, nil
	}
	return "", fmt.Errorf("subprocess: unknown hardening %q (strict or tutorial): %w", s, moat.ErrInvalid)
}

// Config configures a subprocess sandbox. The zero value is the safe
// default.
type Config struct {
	// Limits bound each run. Zero fields mean moat's defaults.
	Limits moat.Limits `json:"limits"`
	// Hardening is the protection profile. Zero means strict.
	Hardening Hardening `json:"hardening,omitempty"`
	// Python is the interpreter to run. Zero means the first of
	// /usr/bin/python3 and /usr/local/bin/python3; moat's own PATH is never
	// searched. It must be readable and executable by the sandbox uids.
	Python string `json:"python,omitempty"`
	// RunDir holds the runs' working directories. Zero means /run/moat when
	// moat is root, else a directory under os.TempDir().
	RunDir string `json:"run_dir,omitempty"`
	// UIDFirst and UIDCount are the range of uids (and gids of the same
	// number) given to runs, one per concurrent run, when moat is root.
	// Zero means 2100000000 and 65536. No user of the host should own a uid
	// in this range.
	UIDFirst int `json:"uid_first,omitempty"`
	UIDCount int `json:"uid_count,omitempty"`
	// SessionCPUTime is the most CPU time the live interpreters of one
	// session (moat.SessionOptions.Interpreter) may use in all over the
	// session's life, runs and the time between them together. The run that
	// reaches it ends with moat.ReasonTimeout; the session's later runs then
	// fail with an error wrapping moat.ErrClosed (its files stay readable
	// until Close). Zero means ten times Limits.CPUTime (100s with the
	// default limits). Sessions without an interpreter leave nothing
	// running between runs and are bounded per run only.
	SessionCPUTime moat.Duration `json:"session_cpu_time,omitempty"`
	// Warm is how many runs are kept set up ahead of their code, each its
	// uid, working directory, cgroup and a python3 started under all the
	// run's restrictions, waiting for the code (about 3 MiB of memory of
	// its own each): zero means one, -1 none, at most 16
	// (engine.Config.Warm).
	Warm int `json:"warm,omitempty"`
	// WarmMax is how many the pool may grow to under a burst of runs that
	// found none ready, shrinking back to Warm when the burst is over
	// (engine.Config.WarmMax). Zero means four (or Warm, when that is
	// more); at most 16.
	WarmMax int `json:"warm_max,omitempty"`
	// Logger receives a line per run at debug level and set-up facts at
	// info level. Nil means discard.
	Logger *slog.Logger `json:"-"`
	// Egress, when set, gives each run a network: its own network
	// namespace holding only a loopback with the proxy's listener on
	// 127.0.0.1:3128, the proxy's environment and CA bundle, and TCP
	// connect to that port alone (network.go). Nil means no network, as
	// before: the loopback is down and the code cannot make a socket. It
	// needs strict hardening. The caller owns the proxy and closes it after
	// the sandbox.
	Egress *egress.Proxy `json:"-"`
}

// Validate reports whether c is usable; the error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	if err := c.Limits.Validate(); err != nil {
		return err
	}
	if _, err := ParseHardening(string(c.Hardening)); err != nil {
		return err
	}
	if c.UIDFirst < 0 || c.UIDCount < 0 || (c.UIDFirst != 0 && c.UIDFirst < 1000) {
		return fmt.Errorf("subprocess: uid range %d+%d must lie above the system's users: %w", c.UIDFirst, c.UIDCount, moat.ErrInvalid)
	}
	if err := engine.ValidateWarmMax(moat.LevelSubprocess, c.Warm, c.WarmMax); err != nil {
		return err
	}
	if err := engine.ValidateWarm(moat.LevelSubprocess, c.Warm); err != nil {
		return err
	}
	if c.SessionCPUTime < 0 {
		return fmt.Errorf("subprocess: session cpu time %v is negative: %w", c.SessionCPUTime, moat.ErrInvalid)
	}
	if c.Python != "" && !filepath.IsAbs(c.Python) {
		return fmt.Errorf("subprocess: python %q must be an absolute path: %w", c.Python, moat.ErrInvalid)
	}
	return nil
}

// Sandbox is the subprocess level: the engine over this package's backend.
// It is safe for concurrent use.
type Sandbox struct {
	*engine.Sandbox // Run, Level, Limits, Close
	b               *backend
}

var (
	_ moat.Sandbox   = (*Sandbox)(nil)
	_ moat.Sessioner = (*Sandbox)(nil)
)

// New checks that every protection of cfg's profile can be applied here,
// reaps what earlier moat processes that died left behind, and returns the
// sandbox. It returns an error wrapping moat.ErrUnavailable when a
// protection cannot be had.
func New(cfg Config) (*Sandbox, error) {
	b, err := prepare(cfg)
	if err != nil {
		return nil, err
	}
	id, err := owner.Self(b.ownersDir)
	if err != nil {
		return nil, unavailable("cannot record this process as an owner in "+b.ownersDir, "", err)
	}
	b.owner = id
	b.reap()
	if cfg.Egress != nil {
		if err := b.writeCA(); err != nil {
			return nil, err
		}
	}
	es, err := engine.New(engine.Config{
		Level:   moat.LevelSubprocess,
		Limits:  b.limits,
		Warm:    cfg.Warm,
		WarmMax: warmMax(cfg.Warm, cfg.WarmMax),
		Notes:   b.notes,
		Hints:   nativeHints,
		Logger:  b.log,
		// A Prepare (a helper's start, its namespaces and root, python3's
		// start) costs twice the CPU of a warm run: made while the run that
		// took the instance goes on, it slowed that run by half on two
		// cores (0.49-0.79x of a bare python3 start against 0.18-0.26x,
		// README). Made after the run, it delays nothing but a next run
		// that comes within its time, which then makes its own and grows
		// the pool (engine.Config.WarmMax).
		RefillAfterRun: true,
	}, b)
	if err != nil {
		b.removeCA()
		return nil, err
	}
	return &Sandbox{Sandbox: es, b: b}, nil
}

// Check says whether a sandbox with cfg can run here, without reaping or
// keeping anything. ctx is not needed by this level's probes, which are
// local and short; it is taken for the one signature of every level.
func Check(ctx context.Context, cfg Config) moat.Availability {
	b, err := prepare(cfg)
	if err != nil {
		return moat.Unavailable(moat.LevelSubprocess, err)
	}
	a := moat.Availability{Level: moat.LevelSubprocess, Available: true}
	a.Reason = strings.Join(b.notes, "; ")
	a.Details = b.details()
	return a
}

// NewSession returns a session with a private working directory that lives
// until Close; see moat.Sessioner and session.go. ctx bounds only the
// creation.
func (s *Sandbox) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	es, err := s.Sandbox.NewSession(ctx, opts)
	if err != nil {
		return nil, err
	}
	ss := es.(*engine.Session)
	return &Session{Session: ss, inst: ss.Instance().(*session)}, nil
}

// DefaultWarmMax is the most a pool grows to under a burst, unless
// Config.WarmMax says otherwise: each instance is a python3 started under
// the run's restrictions, about 3 MiB.
const DefaultWarmMax = 4

func warmMax(warm, warmMax int) int {
	switch {
	case warmMax != 0:
		return warmMax
	case warm < 0:
		return 0
	default:
		return max(warm, DefaultWarmMax)
	}
}
