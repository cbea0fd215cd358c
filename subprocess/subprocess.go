// Package subprocess is moat's lightest isolation level: each run is a fresh
// python3 child process on the host kernel.
//
// With the default ("strict") hardening, which needs root, every run gets:
//
//   - a PID namespace whose init is moat's helper, so that the whole process
//     tree dies with the run, double-forks and setsid included;
//   - a root of its own (root.go): a private mount namespace holding only
//     read-only binds of the system directories, a few device nodes, the
//     working directory and a procfs of the run's own PID namespace
//     (hidepid), so that no other path of the host (socket files, /run,
//     /tmp, other runs, host processes) exists for the code by any name;
//   - a network namespace of its own with only a loopback that is down: no
//     host interface, address or route, and abstract unix names of its own;
//     and a UTS namespace named "moat", not the host;
//   - a per-run cgroup (v2, or the v1 memory and pids hierarchies) for the
//     memory and process limits;
//   - a dedicated unprivileged uid and gid from a configurable range, so that
//     RLIMIT_NPROC holds and the invoking user's files are not readable;
//   - a private working directory on a size-limited tmpfs (noexec, nosuid,
//     nodev), its HOME, removed after the run;
//   - rlimits for CPU time, file size, open files, processes and core dumps;
//   - no_new_privs, Landlock (read-only system directories, read-write only
//     the working directory, no TCP bind or connect, abstract unix sockets and
//     signals scoped to the sandbox, where the kernel's ABI has them) and a
//     seccomp filter that refuses socket() of every family (AF_UNIX too: a
//     unix socket reaches the host's socket files by path), keeping only
//     socketpair(AF_UNIX) of the stream and seqpacket types (a datagram end
//     takes a destination with every sendto and sendmsg), refuses bind,
//     connect, listen and accept (which could only re-aim a socketpair end),
//     and the dangerous system calls;
//   - an empty environment (PATH, HOME, LANG only) and stdin from /dev/null.
//
// If any of these cannot be applied, [New] and [Sandbox.Run] return an error
// wrapping [moat.ErrUnavailable]; the level never runs code with less.
//
// A Sandbox is also a [moat.Sessioner]: a session keeps its tmpfs working
// directory and its uid between runs, and optionally one live interpreter
// (see session.go).
//
// The "tutorial" hardening keeps only plain rlimits (CPU, RLIMIT_AS for
// memory, file size, open files, core dumps), to reproduce the usual
// tutorial's baseline for comparison. It is never chosen implicitly.
//
// The restrictions are applied between fork and exec by a helper stage: moat
// re-executes its own binary, which this package intercepts in its init
// function. Any binary that imports this package can therefore serve as the
// helper, test binaries included.
package subprocess

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/internal/seccomp"
	"github.com/moatsandbox/moat/internal/uidpool"
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
	// Logger receives a line per run at debug level and set-up facts at
	// info level. Nil means discard.
	Logger *slog.Logger `json:"-"`
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
	if c.SessionCPUTime < 0 {
		return fmt.Errorf("subprocess: session cpu time %v is negative: %w", c.SessionCPUTime, moat.ErrInvalid)
	}
	if c.Python != "" && !filepath.IsAbs(c.Python) {
		return fmt.Errorf("subprocess: python %q must be an absolute path: %w", c.Python, moat.ErrInvalid)
	}
	return nil
}

// Sandbox is the subprocess level. It is safe for concurrent use.
type Sandbox struct {
	cfg     Config
	limits  moat.Limits
	strict  bool
	root    bool
	python  string
	runsDir string
	// owner is this process's id (package owner) in ownersDir: the prefix
	// of its working directories and cgroups.
	owner     string
	ownersDir string
	cg        *cgroup.Manager // strict only
	pyDirs    []string        // strict only: the interpreter's library dirs outside readOnlyDirs
	pyFiles   []string        // strict only: its binary and shared library outside readOnlyDirs
	rootDir   string          // strict only: where the helpers mount the runs' roots
	uids      *uidpool.Pool   // strict only
	notes     []string
	log       *slog.Logger

	mu     sync.Mutex
	closed bool
	runs   sync.WaitGroup
	warm   chan *helperProc // helpers started in advance; see warm.go
}

var _ moat.Sandbox = (*Sandbox)(nil)

// pythonCandidates are tried in order when Config.Python is empty.
var pythonCandidates = []string{"/usr/bin/python3", "/usr/local/bin/python3"}

// readOnlyDirs are the system directories the code may read and execute
// from; everything else of the host is invisible to it.
var readOnlyDirs = []string{"/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/python3", "/etc/ssl", "/etc/ca-certificates"}

// readOnlyFiles are single system files Python and its libraries read.
var readOnlyFiles = []string{"/etc/ld.so.cache", "/etc/localtime", "/etc/mime.types", "/dev/urandom", "/dev/random"}

// rwFiles are device files the code may write to.
var rwFiles = []string{"/dev/null", "/dev/zero", "/dev/full"}

// New checks that every protection of cfg's profile can be applied here,
// reaps what earlier moat processes that died left behind, and returns the
// sandbox. It returns an error wrapping moat.ErrUnavailable when a
// protection cannot be had.
func New(cfg Config) (*Sandbox, error) {
	s, err := prepare(cfg)
	if err != nil {
		return nil, err
	}
	id, err := owner.Self(s.ownersDir)
	if err != nil {
		return nil, unavailable("cannot record this process as an owner in "+s.ownersDir, "", err)
	}
	s.owner = id
	s.reap()
	s.warm = make(chan *helperProc, 1)
	go s.refill()
	return s, nil
}

// Check says whether a sandbox with cfg can run here, without reaping or
// keeping anything.
func Check(cfg Config) moat.Availability {
	s, err := prepare(cfg)
	if err != nil {
		return moat.Unavailable(moat.LevelSubprocess, err)
	}
	a := moat.Availability{Level: moat.LevelSubprocess, Available: true}
	a.Reason = strings.Join(s.notes, "; ")
	a.Details = s.details()
	return a
}

func (s *Sandbox) details() []string {
	d := []string{"python: " + s.python, "hardening: " + string(s.cfg.Hardening)}
	if s.strict {
		abi, _ := llsys.LandlockGetABIVersion()
		d = append(d,
			fmt.Sprintf("cgroup: v%d (memory, pids, cpu account)", s.cg.Version()),
			fmt.Sprintf("landlock: ABI %d", abi),
			"namespaces: pid, ipc, net (loopback down), mount (own root, own procfs with hidepid)",
			"seccomp: filter installed per run",
			fmt.Sprintf("uids: %d-%d", s.cfg.UIDFirst, s.cfg.UIDFirst+s.cfg.UIDCount-1))
	}
	return d
}

func unavailable(reason, remedy string, err error) error {
	return &moat.UnavailableError{Level: moat.LevelSubprocess, Reason: reason, Remedy: remedy, Err: err}
}

// prepare validates cfg and probes the host, without side effects beyond
// creating moat's own directories.
func prepare(cfg Config) (*Sandbox, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Hardening, _ = ParseHardening(string(cfg.Hardening))
	if cfg.UIDFirst == 0 {
		cfg.UIDFirst = 2100000000
	}
	if cfg.UIDCount == 0 {
		cfg.UIDCount = 65536
	}
	s := &Sandbox{
		cfg:    cfg,
		limits: cfg.Limits.WithDefaults(),
		strict: cfg.Hardening == HardeningStrict,
		root:   os.Geteuid() == 0,
		log:    cfg.Logger,
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	python, err := findPython(cfg.Python)
	if err != nil {
		return nil, err
	}
	s.python = python

	runDir := cfg.RunDir
	if runDir == "" {
		if s.root {
			runDir = "/run/moat"
		} else {
			runDir = filepath.Join(os.TempDir(), fmt.Sprintf("moat-%d", os.Getuid()))
		}
	}
	s.runsDir = filepath.Join(runDir, "runs")
	// Owners are recorded in one place per machine when root, since the
	// cgroups they own are per machine too.
	s.ownersDir = filepath.Join(runDir, "owners")
	if s.root {
		s.ownersDir = "/run/moat/owners"
	}
	// 0711: the sandbox uids may pass through to their own directory but
	// not list the others.
	for _, d := range []string{runDir, s.runsDir} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, unavailable("cannot create the run directory "+d, "set run_dir to a writable directory", err)
		}
		if err := os.Chmod(d, 0o711); err != nil {
			return nil, unavailable("cannot set the mode of "+d, "", err)
		}
	}

	if !s.strict {
		if _, err := os.Stat(prlimit); err != nil {
			return nil, unavailable("tutorial hardening needs "+prlimit+" to set RLIMIT_AS", "install util-linux", err)
		}
		s.notes = append(s.notes, "hardening=tutorial: plain rlimits only (no dedicated uid, cgroups, Landlock, seccomp or disk limit)")
		if !s.root {
			s.notes = append(s.notes, fmt.Sprintf("not root: runs as the invoking uid %d", os.Getuid()))
			if !userNamespacesWork() {
				return nil, unavailable("not root and user namespaces are disabled, so the process tree of a run cannot be contained",
					"run as root, or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)", nil)
			}
		}
		return s, nil
	}

	if !s.root {
		return nil, unavailable(fmt.Sprintf("not root (uid %d): strict hardening needs root for per-run uids, cgroups and a size-limited working directory", os.Getuid()),
			"run moat as root, or choose --hardening=tutorial explicitly to run with plain rlimits only", nil)
	}
	if abi, err := llsys.LandlockGetABIVersion(); err != nil || abi < 1 {
		return nil, unavailable("the kernel has no Landlock", "use a kernel >= 5.13 with Landlock enabled (CONFIG_SECURITY_LANDLOCK, lsm=...,landlock)", err)
	}
	if _, err := seccomp.Filter(); err != nil {
		return nil, unavailable("no seccomp filter for this architecture", "", err)
	}
	// PR_GET_SECCOMP fails with EINVAL on a kernel without seccomp. (A mode
	// other than 0 means moat itself runs filtered, which only adds.)
	if _, err := unix.PrctlRetInt(unix.PR_GET_SECCOMP, 0, 0, 0, 0); err != nil {
		return nil, unavailable("the kernel has no seccomp", "use a kernel with CONFIG_SECCOMP_FILTER", err)
	}
	cg, err := cgroup.Detect("moat")
	if err != nil {
		return nil, unavailable("no usable memory and pids cgroup controllers", "mount cgroup v2 with memory and pids enabled, or the v1 memory and pids hierarchies", err)
	}
	s.cg = cg
	uids, err := uidpool.New(cfg.UIDFirst, cfg.UIDCount, uidpool.HostDir)
	if err != nil {
		return nil, unavailable("cannot set up the uid pool", "", err)
	}
	s.uids = uids
	if err := othersCanExecute(s.python); err != nil {
		return nil, unavailable("the sandbox uids cannot run "+s.python, "install python3 from the system's packages or set python to an interpreter outside private home directories", err)
	}
	if s.pyDirs, s.pyFiles, err = pythonTree(s.python, runDir); err != nil {
		return nil, unavailable("the interpreter's own files cannot be opened to the code alone", "install python3 under a prefix of its own (PREFIX/bin/python3, such as /opt/python3.11/bin/python3)", err)
	}
	// The mount point of the runs' own roots (root.go): mounted over in
	// the helpers' private mount namespaces only.
	s.rootDir = filepath.Join(runDir, "root")
	if err := os.MkdirAll(s.rootDir, 0o700); err != nil {
		return nil, unavailable("cannot create "+s.rootDir, "", err)
	}
	return s, nil
}

func findPython(p string) (string, error) {
	cands := pythonCandidates
	if p != "" {
		cands = []string{p}
	}
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return c, nil
		}
	}
	return "", unavailable("python3 not found (tried "+strings.Join(cands, ", ")+")", "install python3 (apt-get install python3) or set python", nil)
}

// othersCanExecute checks that a uid with no relation to the file's owner
// can reach and execute path (after symlinks).
func othersCanExecute(path string) error {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return err
	}
	st, err := os.Stat(real)
	if err != nil {
		return err
	}
	if st.Mode()&0o005 != 0o005 {
		return fmt.Errorf("%s is mode %v", real, st.Mode().Perm())
	}
	for dir := filepath.Dir(real); ; dir = filepath.Dir(dir) {
		st, err := os.Stat(dir)
		if err != nil {
			return err
		}
		if st.Mode()&0o001 == 0 {
			return fmt.Errorf("directory %s is mode %v", dir, st.Mode().Perm())
		}
		if dir == "/" {
			return nil
		}
	}
}

// userNamespacesWork probes, with a trivial child, whether this user may
// create a user and PID namespace.
func userNamespacesWork() bool {
	pid, err := syscall.ForkExec("/bin/true", []string{"true"}, &syscall.ProcAttr{
		Env: []string{},
		Sys: &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWPID,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: os.Getuid(), HostID: os.Getuid(), Size: 1}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: os.Getgid(), HostID: os.Getgid(), Size: 1}},
		},
	})
	if err != nil {
		return false
	}
	var ws syscall.WaitStatus
	syscall.Wait4(pid, &ws, 0, nil)
	return ws.Exited() && ws.ExitStatus() == 0
}

// reap removes what moat processes that are no longer alive left behind:
// working directories (unmounting their tmpfs) and cgroups.
func (s *Sandbox) reap() {
	entries, _ := os.ReadDir(s.runsDir)
	for _, e := range entries {
		if !s.deadOwner(e.Name()) {
			continue
		}
		dir := filepath.Join(s.runsDir, e.Name())
		unix.Unmount(dir, unix.MNT_DETACH)
		if err := os.RemoveAll(dir); err != nil {
			s.log.Warn("subprocess: reap leftover directory", "dir", dir, "err", err)
		} else {
			s.log.Info("subprocess: reaped leftover directory", "dir", dir)
		}
	}
	if s.cg != nil {
		names, err := s.cg.ReapDead(s.deadOwner)
		if len(names) > 0 {
			s.log.Info("subprocess: reaped leftover cgroups", "groups", names)
		}
		if err != nil {
			s.log.Warn("subprocess: reap leftover cgroups", "err", err)
		}
	}
}

// deadOwner reports whether name ("<owner>-<id>") belongs to a moat process
// that is no longer alive. Names of other forms are never reaped.
func (s *Sandbox) deadOwner(name string) bool {
	id, ok := owner.Of(name)
	return ok && !owner.Alive(s.ownersDir, id)
}

// Level returns moat.LevelSubprocess.
func (s *Sandbox) Level() moat.Level { return moat.LevelSubprocess }

// Limits returns the limits every run gets, defaults filled in.
func (s *Sandbox) Limits() moat.Limits { return s.limits }

// Close makes later runs fail with moat.ErrClosed and waits for runs in
// progress. It is safe to call more than once.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	s.closed = true
	if s.warm != nil {
		s.drainWarm()
	}
	s.mu.Unlock()
	s.runs.Wait()
	return nil
}

// begin checks req and counts a run in, for Close to wait on; the caller
// calls s.runs.Done when the run has ended.
func (s *Sandbox) begin(req moat.Request) error {
	if len(req.Code) == 0 {
		return fmt.Errorf("subprocess: empty code: %w", moat.ErrInvalid)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("subprocess: %w", moat.ErrClosed)
	}
	s.runs.Add(1)
	return nil
}

// Run runs req.Code under python3; see moat.Sandbox for the contract.
func (s *Sandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	if err := s.begin(req); err != nil {
		return nil, err
	}
	defer s.runs.Done()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r := &run{s: s, req: req}
	defer r.cleanup()
	res, err := r.do(ctx)
	if err == nil {
		s.log.Debug("subprocess: run", "id", r.id, "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason)
	}
	return res, err
}

// run is the state of one Run, released by cleanup in reverse order.
type run struct {
	s     *Sandbox
	req   moat.Request
	id    string
	start time.Time

	dir string
	// atStart are the files at the file size limit that the directory held
	// when the run began, the code file moat wrote included: those left
	// as they were are not this run's doing.
	atStart map[fileKey]fileStamp
	mounted bool
	lease   *uidpool.Lease
	group   *cgroup.Group
}

func (r *run) do(ctx context.Context) (*moat.Result, error) {
	s := r.s
	r.start = time.Now()
	var rnd [8]byte
	rand.Read(rnd[:])
	r.id = s.owner + "-" + hex.EncodeToString(rnd[:])
	lim := s.limits

	uid, gid := -1, -1
	if s.strict {
		lease, err := s.uids.Acquire()
		if err != nil {
			return nil, fmt.Errorf("subprocess: %w", err)
		}
		r.lease = lease
		uid, gid = lease.UID, lease.UID
	}

	// The working directory.
	r.dir = filepath.Join(s.runsDir, r.id)
	if err := os.Mkdir(r.dir, 0o700); err != nil {
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	if s.strict {
		if err := mountWorkDir(r.dir, lim.Disk, uid, gid); err != nil {
			return nil, err
		}
		r.mounted = true
	}
	// The code goes in a file: argv cannot carry NUL bytes, and stdin is
	// the code's own, empty.
	const codeName = ".moat-main.py"
	if err := writeNewFile(r.dir, codeName, r.req.Code, uid, gid); err != nil {
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EFBIG) {
			return nil, fmt.Errorf("subprocess: code of %d bytes does not fit in the %v working directory: %w", len(r.req.Code), lim.Disk, moat.ErrInvalid)
		}
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	if int64(len(r.req.Code)) >= int64(lim.FileSize) {
		// The fresh directory holds only the code file: it is not the
		// run's, and no walk is needed on the run's path otherwise.
		r.atStart = filesAtLimit(r.dir, int64(lim.FileSize))
	}
	if s.strict {
		group, err := s.cg.New(r.id, cgroup.Limits{Memory: int64(lim.Memory), Pids: int64(lim.Pids)})
		if err != nil {
			return nil, unavailable("cannot create the run's cgroup", "", err)
		}
		r.group = group
	}
	sp := s.runSpec(r.dir, uid, gid, r.group, []string{"python3", filepath.Join(r.dir, codeName)})
	arg, err := json.Marshal(sp)
	if err != nil {
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	return r.exec(ctx, arg)
}

// runSpec is the helper's spec for running args (python3's argv) in dir as
// uid and gid (-1: moat's), in group (strict hardening only): every run,
// one-shot or in a session, is started from it.
func (s *Sandbox) runSpec(dir string, uid, gid int, group *cgroup.Group, args []string) spec {
	lim := s.limits
	sp := spec{
		Python: s.python,
		Args:   args,
		Env:    []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + dir, "LANG=C.UTF-8"},
		Dir:    dir,
		UID:    uid,
		GID:    gid,
	}
	cpu := uint64(time.Duration(lim.CPUTime).Seconds())
	sp.Rlimits = []rlimit{
		// SIGXCPU at the limit, SIGKILL a second later for code that
		// ignores it.
		{unix.RLIMIT_CPU, cpu, cpu + 1},
		{unix.RLIMIT_FSIZE, uint64(lim.FileSize), uint64(lim.FileSize)},
		{unix.RLIMIT_NOFILE, uint64(lim.OpenFiles), uint64(lim.OpenFiles)},
		{unix.RLIMIT_CORE, 0, 0},
	}
	if !s.strict {
		// The tutorial's memory limit: address space, per process.
		sp.AddressSpace = uint64(lim.Memory)
		return sp
	}
	sp.Cgroups = group.JoinFiles()
	// The uid is the run's own, so RLIMIT_NPROC counts this run only.
	sp.Rlimits = append(sp.Rlimits, rlimit{unix.RLIMIT_NPROC, uint64(lim.Pids), uint64(lim.Pids)})
	sp.NoNewPrivs = true
	sp.Seccomp = true
	ro := append(append([]string{}, readOnlyDirs...), s.pyDirs...)
	sp.Root = &rootSpec{Mount: s.rootDir, ReadOnly: ro, Devices: rwFiles, Work: dir}
	for _, f := range readOnlyFiles {
		if strings.HasPrefix(f, "/dev/") {
			sp.Root.Devices = append(sp.Root.Devices, f) // Landlock keeps them read-only
		} else {
			sp.Root.ReadOnly = append(sp.Root.ReadOnly, f)
		}
	}
	sp.Root.ReadOnly = append(sp.Root.ReadOnly, s.pyFiles...)
	sp.Landlock = &lockSpec{
		ReadOnly:  ro,
		ReadFiles: readOnlyFiles,
		ExecFiles: s.pyFiles,
		RWFiles:   rwFiles,
		Work:      dir,
	}
	return sp
}

// mountWorkDir mounts a tmpfs of disk bytes (and an inode per 4 KiB) on
// dir, owned by uid and gid, noexec, nosuid, nodev.
func mountWorkDir(dir string, disk moat.Bytes, uid, gid int) error {
	inodes := int64(disk / (4 * moat.KiB))
	if inodes < 64 {
		inodes = 64
	}
	opts := fmt.Sprintf("size=%d,nr_inodes=%d,mode=0700,uid=%d,gid=%d", int64(disk), inodes, uid, gid)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return unavailable("cannot mount the size-limited working directory", "", err)
	}
	return nil
}

// pythonTree returns what of an interpreter that lives outside the
// standard read-only directories the code must be able to read for
// python3 to start: its real binary and shared library (files) and its
// standard library directories, as the interpreter itself reports them.
// Only those are opened to the code, never the prefix they share (a home
// directory, /opt): a directory that would open more than the interpreter's
// own tree (/, a top-level directory, one that holds moat's run directory)
// is refused.
func pythonTree(python, runDir string) (dirs, files []string, err error) {
	real, err := filepath.EvalSymlinks(python)
	if err != nil {
		return nil, nil, err
	}
	inSystem := func(p string) bool {
		for _, d := range readOnlyDirs {
			if p == d || strings.HasPrefix(p, d+"/") {
				return true
			}
		}
		return false
	}
	if inSystem(real) {
		return nil, nil, nil
	}
	files = append(files, real)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// -I -S: nothing of the environment, the user's site or a .pth file.
	cmd := exec.CommandContext(ctx, real, "-I", "-S", "-c", `import json, sysconfig
v = sysconfig.get_config_var
print(json.dumps([sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"), v("LIBDIR") or "", v("LDLIBRARY") or ""]))`)
	cmd.Env = []string{}
	cmd.Dir = "/"
	out, err := cmd.Output()
	if err != nil {
		return nil, nil, fmt.Errorf("ask %s for its library directories: %w", real, err)
	}
	var paths [4]string
	if err := json.Unmarshal(out, &paths); err != nil {
		return nil, nil, fmt.Errorf("%s reported %q: %w", real, out, err)
	}
	if paths[2] != "" && paths[3] != "" && !strings.Contains(paths[3], "/") {
		if lib, err := filepath.EvalSymlinks(filepath.Join(paths[2], paths[3])); err == nil && !inSystem(lib) {
			files = append(files, lib)
		}
	}
	for _, d := range paths[:2] {
		if d == "" {
			continue
		}
		d, err := filepath.EvalSymlinks(d)
		if err != nil || inSystem(d) || slices.Contains(dirs, d) {
			continue
		}
		if !filepath.IsAbs(d) || d == "/" || filepath.Dir(d) == "/" {
			return nil, nil, fmt.Errorf("%s's library directory %s would open too much", real, d)
		}
		for _, m := range []string{runDir, "/run/moat"} {
			if m == d || strings.HasPrefix(m, d+"/") {
				return nil, nil, fmt.Errorf("%s's library directory %s would open moat's directory %s", real, d, m)
			}
		}
		dirs = append(dirs, d)
	}
	return dirs, files, nil
}

// exec hands the spec to a helper and waits for the run to end.
func (r *run) exec(ctx context.Context, arg []byte) (*moat.Result, error) {
	s, lim := r.s, r.s.limits
	h, err := s.takeHelper()
	if err != nil {
		return nil, err
	}
	defer h.closeFiles()

	// The first byte past the output cap ends the run, by the wall timer's
	// kill: nothing past the cap is passed on, and the code cannot go on
	// writing into a stream that is only drained.
	var outOver atomic.Bool
	over := func() { outOver.Store(true); h.cmd.Process.Kill() }
	stdout := capture.New(int64(lim.Output), r.req.Stdout, over)
	stderr := capture.New(int64(lim.Output), r.req.Stderr, over)
	copied := make(chan struct{}, 2)
	go func() { io.Copy(stdout, h.stdout); copied <- struct{}{} }()
	go func() { io.Copy(stderr, h.stderr); copied <- struct{}{} }()

	// The wall clock starts with the spec: from here on the helper is the
	// run's. Killing the helper, init of the run's PID namespace, kills
	// every process of the run.
	runCtx, cancel := context.WithTimeout(ctx, time.Duration(lim.WallTime))
	defer cancel()
	stopKill := context.AfterFunc(runCtx, func() { h.cmd.Process.Kill() })
	defer stopKill()
	_, err = h.spec.Write(arg)
	h.spec.Close()
	if err != nil {
		h.cmd.Process.Kill()
		h.cmd.Wait()
		if ctx.Err() != nil {
			return nil, ctx.Err() // killed by the cancel, before anything ran
		}
		return nil, unavailable("the sandbox helper died before its run", "", err)
	}
	var cpuOver atomic.Bool
	if r.group != nil {
		// RLIMIT_CPU bounds each process; the cgroup's account bounds the
		// run as a whole, children included.
		stop := r.group.WatchCPU(0, time.Duration(lim.CPUTime), func() { h.cmd.Process.Kill() }, &cpuOver)
		defer stop()
	}
	waitErr := h.cmd.Wait()
	end := time.Now()
	// Every holder of the output pipes was in the namespace, now gone; the
	// bound only guards against a kernel that is slow to tear it down.
	for i := 0; i < 2; i++ {
		select {
		case <-copied:
		case <-time.After(time.Second):
			h.stdout.Close()
			h.stderr.Close()
			<-copied
		}
	}
	statusBytes, _ := io.ReadAll(io.LimitReader(h.status, 4096))
	st, reported := parseStatus(statusBytes)
	if reported && st.err != "" {
		return nil, fmt.Errorf("subprocess: sandbox set-up failed, nothing ran: %s: %w", st.err, moat.ErrUnavailable)
	}
	if r.group != nil {
		// The namespace is gone with its init; this only makes sure.
		if err := r.group.Kill(); err != nil {
			return nil, fmt.Errorf("subprocess: %w", err)
		}
	}

	res := &moat.Result{
		Level:     moat.LevelSubprocess,
		Stdout:    stdout.Bytes(),
		Stderr:    stderr.Bytes(),
		Truncated: stdout.Truncated() || stderr.Truncated(),
		Notes:     s.notes,
	}
	var events cgroup.Events
	if r.group != nil {
		events = r.group.Events()
	}
	// Without a report, the helper was killed before python3 ended: by the
	// CPU watch, by the wall timer or the caller's cancel, or by the
	// kernel's OOM killer (the helper is in the run's memory cgroup).
	killedByUs := false
	if !reported {
		switch {
		case cpuOver.Load():
			st = helperStatus{signaled: true, signal: syscall.SIGKILL, cpuMS: time.Duration(lim.CPUTime).Milliseconds()}
		case runCtx.Err() != nil:
			killedByUs = true
		case outOver.Load():
			st = helperStatus{signaled: true, signal: syscall.SIGKILL}
		case events.OOMKill:
			st = helperStatus{signaled: true, signal: syscall.SIGKILL}
		default:
			return nil, fmt.Errorf("subprocess: helper ended without a report: %v: %s: %w", waitErr, tail(stderr.Bytes(), 512), moat.ErrUnavailable)
		}
	}
	switch {
	case st.exited:
		res.ExitCode = st.code
	case st.signaled:
		res.ExitCode = 128 + int(st.signal)
		res.Signal = unix.SignalName(st.signal)
	default:
		res.ExitCode = 128 + int(syscall.SIGKILL)
		res.Signal = unix.SignalName(syscall.SIGKILL)
	}
	if outOver.Load() {
		// Killed for its output, even if python3 ended first.
		res.ExitCode, res.Signal = 128+int(syscall.SIGKILL), unix.SignalName(syscall.SIGKILL)
	}

	cpuLimitMS := time.Duration(lim.CPUTime).Milliseconds()
	switch {
	case killedByUs && ctx.Err() != nil:
		res.Reason = moat.ReasonCanceled
	case killedByUs:
		res.Reason = moat.ReasonTimeout
	case st.signaled && (st.signal == syscall.SIGXCPU || (st.signal == syscall.SIGKILL && st.cpuMS >= cpuLimitMS)):
		res.Reason = moat.ReasonTimeout
	case events.OOMKill || (!s.strict && memoryErrorAtEnd(res.Stderr)):
		res.Reason = moat.ReasonMemory
	case events.PidsMax:
		res.Reason = moat.ReasonPids
	case r.fileAtLimit(int64(lim.FileSize)):
		res.Reason = moat.ReasonFileSize
	case r.mounted && r.diskFull():
		res.Reason = moat.ReasonDisk
	case res.Truncated:
		res.Reason = moat.ReasonOutput
	case st.signaled:
		res.Reason = moat.ReasonSignal
	}
	res.Duration = end.Sub(r.start)
	return res, nil
}

// memoryErrorAtEnd reports whether Python ended on a MemoryError, which is
// how RLIMIT_AS shows (tutorial hardening only; the code could print it).
func memoryErrorAtEnd(stderr []byte) bool {
	lines := bytes.Split(bytes.TrimRight(stderr, "\n"), []byte("\n"))
	return len(lines) > 0 && bytes.HasPrefix(lines[len(lines)-1], []byte("MemoryError"))
}

// fileAtLimit reports whether the run wrote a file that reached the file
// size limit: the host-side trace of RLIMIT_FSIZE (Python ignores SIGXFSZ
// and gets EFBIG instead). Only what this run wrote counts: a session's
// earlier files may sit at the limit legitimately, so a file that was at the
// limit when the run began (r.atStart) counts only if it changed since.
//
// The test is against the files' own earlier stamps, not against the host's
// clock: file times come from the kernel's coarse clock, which lags
// time.Now by up to a tick (4 ms here), so a file written at once after a
// run's start would look older than the run. Since Linux 6.13 (multigrain
// timestamps, tmpfs included) a change after the stat that took the stamp
// always gets a new time; on older kernels a rewrite to the same size in the
// same tick as the run's start is missed.
func (r *run) fileAtLimit(limit int64) bool {
	found := false
	walkAtLimit(r.dir, limit, func(k fileKey, st fileStamp) bool {
		if old, ok := r.atStart[k]; !ok || old != st {
			found = true
		}
		return !found
	})
	return found
}

// fileKey names a file by its inode; fileStamp is what a write changes.
type (
	fileKey   struct{ dev, ino uint64 }
	fileStamp struct {
		size         int64
		mtime, ctime syscall.Timespec
	}
)

// filesAtLimit returns the files under dir at or past the file size limit.
func filesAtLimit(dir string, limit int64) map[fileKey]fileStamp {
	m := map[fileKey]fileStamp{}
	walkAtLimit(dir, limit, func(k fileKey, st fileStamp) bool {
		m[k] = st
		return true
	})
	return m
}

// walkAtLimit calls fn for each regular file under dir at or past the file
// size limit, without following symbolic links, until fn returns false.
func walkAtLimit(dir string, limit int64, fn func(fileKey, fileStamp) bool) {
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return filepath.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		info, err := d.Info()
		if err != nil || info.Size() < limit {
			return nil
		}
		st, ok := info.Sys().(*syscall.Stat_t)
		if !ok {
			return nil
		}
		k := fileKey{uint64(st.Dev), st.Ino}
		if !fn(k, fileStamp{st.Size, st.Mtim, st.Ctim}) {
			return filepath.SkipAll
		}
		return nil
	})
}

// diskFull reports whether the working directory's tmpfs ran out of blocks
// or inodes.
func (r *run) diskFull() bool {
	var st unix.Statfs_t
	if err := unix.Statfs(r.dir, &st); err != nil {
		return false
	}
	return st.Bavail == 0 || st.Ffree == 0
}

// cleanup releases everything of the run. Errors are logged: the result is
// already decided, and what fails here is reaped by the next New.
func (r *run) cleanup() {
	if r.group != nil {
		if err := r.group.Kill(); err != nil {
			r.s.log.Warn("subprocess: cleanup", "id", r.id, "err", err)
		}
		if err := r.group.Remove(); err != nil {
			r.s.log.Warn("subprocess: cleanup", "id", r.id, "err", err)
		}
	}
	if r.dir != "" {
		if r.mounted {
			if err := unix.Unmount(r.dir, unix.MNT_DETACH); err != nil {
				r.s.log.Warn("subprocess: cleanup", "id", r.id, "err", err)
			}
		}
		if err := os.RemoveAll(r.dir); err != nil {
			r.s.log.Warn("subprocess: cleanup", "id", r.id, "err", err)
		}
	}
	if r.lease != nil {
		r.lease.Release()
	}
}

// tail returns the last n bytes of b, for error messages.
func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.ToValidUTF8(string(bytes.TrimSpace(b)), "?")
}
