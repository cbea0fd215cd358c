package subprocess

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/internal/seccomp"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// backend is the subprocess level under the engine (engine.Backend and
// engine.SessionBackend): what New found out about the host, fixed for the
// sandbox's life, and the prepared instances it hands the engine. An
// instance is a run set up ahead, its python3 started and waiting for the
// code (prestart.go); its Start gives it the code (run.go).
type backend struct {
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
	caPath    string          // with Config.Egress: the proxy's CA bundle (network.go)
	notes     []string
	log       *slog.Logger
	spare     spare // a helper for a session's next run (spare.go)
	// teardown counts the removals of ended runs still in progress
	// (instance.Discard); Close waits for them.
	teardown sync.WaitGroup
}

var (
	_ engine.Backend        = (*backend)(nil)
	_ engine.SessionBackend = (*backend)(nil)
)

// Prepare makes everything of one run but its code: its uid, working
// directory, cgroup and egress run, and a helper that has its spec and has
// started python3 under every restriction of the run, waiting for the
// code (prestart.go); see engine.Backend.
func (b *backend) Prepare(ctx context.Context) (engine.Instance, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	h, err := b.startHelper()
	if err != nil {
		return nil, err
	}
	in := &instance{b: b, h: h}
	if err := in.setUp(); err != nil {
		in.Discard()
		return nil, err
	}
	return in, nil
}

// Close ends the spare helper of sessions' runs and removes the egress
// proxy's CA bundle, if any; every instance and run has released its own
// by then (sessions keep what they hold), and the owner lock lasts as long
// as this process.
func (b *backend) Close() error {
	b.teardown.Wait()
	b.closeSpare()
	b.removeCA()
	return nil
}

// pythonCandidates are tried in order when Config.Python is empty.
var pythonCandidates = []string{"/usr/bin/python3", "/usr/local/bin/python3"}

// readOnlyDirs are the system directories the code may read and execute
// from; everything else of the host is invisible to it.
var readOnlyDirs = []string{"/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/python3", "/etc/ssl", "/etc/ca-certificates"}

// readOnlyFiles are single system files Python and its libraries read.
var readOnlyFiles = []string{"/etc/ld.so.cache", "/etc/localtime", "/etc/mime.types", "/dev/urandom", "/dev/random"}

// rwFiles are device files the code may write to.
var rwFiles = []string{"/dev/null", "/dev/zero", "/dev/full"}

// details lists the protections Check found, for moat doctor.
func (b *backend) details() []string {
	warm := b.cfg.Warm
	if warm == 0 {
		warm = engine.DefaultWarm
	}
	pool := fmt.Sprintf("pool: %d runs set up ahead (up to %d under a burst), each with python3 started under the run's restrictions, waiting for its code", max(warm, 0), warmMax(b.cfg.Warm, b.cfg.WarmMax))
	d := []string{"python: " + b.python, "hardening: " + string(b.cfg.Hardening), pool}
	if b.strict {
		abi, _ := llsys.LandlockGetABIVersion()
		d = append(d,
			fmt.Sprintf("cgroup: v%d (memory, pids, cpu account)", b.cg.Version()),
			fmt.Sprintf("landlock: ABI %d", abi),
			"namespaces: pid, ipc, net, mount (own root, own procfs with hidepid)",
			"seccomp: filter installed per run",
			fmt.Sprintf("uids: %d-%d", b.cfg.UIDFirst, b.cfg.UIDFirst+b.cfg.UIDCount-1))
		if b.cfg.Egress != nil {
			d = append(d, "network: the run's own network namespace, loopback only, with moat's egress proxy listener placed in it ("+b.cfg.Egress.Describe()+")")
		} else {
			d = append(d, "network: none (the run's own network namespace, loopback down)")
		}
	}
	return d
}

// unavailable is the level's error for a protection it cannot apply.
func unavailable(reason, remedy string, err error) error {
	return &moat.UnavailableError{Level: moat.LevelSubprocess, Reason: reason, Remedy: remedy, Err: err}
}

// prepare validates cfg and probes the host, without side effects beyond
// creating moat's own directories.
func prepare(cfg Config) (*backend, error) {
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
	b := &backend{
		cfg:    cfg,
		limits: cfg.Limits.WithDefaults(),
		strict: cfg.Hardening == HardeningStrict,
		root:   os.Geteuid() == 0,
		log:    cfg.Logger,
	}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	python, err := findPython(cfg.Python)
	if err != nil {
		return nil, err
	}
	b.python = python

	runDir := cfg.RunDir
	if runDir == "" {
		if b.root {
			runDir = "/run/moat"
		} else {
			runDir = filepath.Join(os.TempDir(), fmt.Sprintf("moat-%d", os.Getuid()))
		}
	}
	b.runsDir = filepath.Join(runDir, "runs")
	// Owners are recorded in one place per machine when root, since the
	// cgroups they own are per machine too.
	b.ownersDir = filepath.Join(runDir, "owners")
	if b.root {
		b.ownersDir = "/run/moat/owners"
	}
	// 0711: the sandbox uids may pass through to their own directory but
	// not list the others.
	for _, d := range []string{runDir, b.runsDir} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, unavailable("cannot create the run directory "+d, "set run_dir to a writable directory", err)
		}
		if err := os.Chmod(d, 0o711); err != nil {
			return nil, unavailable("cannot set the mode of "+d, "", err)
		}
	}

	if !b.strict {
		if cfg.Egress != nil {
			return nil, errNetworkNeedsStrict()
		}
		if _, err := os.Stat(prlimit); err != nil {
			return nil, unavailable("tutorial hardening needs "+prlimit+" to set RLIMIT_AS", "install util-linux", err)
		}
		b.notes = append(b.notes, "hardening=tutorial: plain rlimits only (no dedicated uid, cgroups, Landlock, seccomp or disk limit)")
		if !b.root {
			b.notes = append(b.notes, fmt.Sprintf("not root: runs as the invoking uid %d", os.Getuid()))
			if !userNamespacesWork() {
				return nil, unavailable("not root and user namespaces are disabled, so the process tree of a run cannot be contained",
					"run as root, or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)", nil)
			}
		}
		return b, nil
	}

	if !b.root {
		// The remedy says what the profile that runs without root lets
		// through, not only that it exists.
		return nil, unavailable(fmt.Sprintf("not root (uid %d): strict hardening needs root for per-run uids, cgroups and a size-limited working directory", os.Getuid()),
			notRootRemedy, nil)
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
	b.cg = cg
	uids, err := uidpool.New(cfg.UIDFirst, cfg.UIDCount, uidpool.HostDir)
	if err != nil {
		return nil, unavailable("cannot set up the uid pool", "", err)
	}
	b.uids = uids
	if err := othersCanExecute(b.python); err != nil {
		return nil, unavailable("the sandbox uids cannot run "+b.python, "install python3 from the system's packages or set python to an interpreter outside private home directories", err)
	}
	if b.pyDirs, b.pyFiles, err = pythonTree(b.python, runDir); err != nil {
		return nil, unavailable("the interpreter's own files cannot be opened to the code alone", "install python3 under a prefix of its own (PREFIX/bin/python3, such as /opt/python3.11/bin/python3)", err)
	}
	// The mount point of the runs' own roots (internal/helper/root.go): mounted over in
	// the helpers' private mount namespaces only.
	b.rootDir = filepath.Join(runDir, "root")
	if err := os.MkdirAll(b.rootDir, 0o700); err != nil {
		return nil, unavailable("cannot create "+b.rootDir, "", err)
	}
	return b, nil
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
func (b *backend) reap() {
	entries, _ := os.ReadDir(b.runsDir)
	for _, e := range entries {
		if !b.deadOwner(e.Name()) {
			continue
		}
		dir := filepath.Join(b.runsDir, e.Name())
		unix.Unmount(dir, unix.MNT_DETACH)
		if err := os.RemoveAll(dir); err != nil {
			b.log.Warn("subprocess: reap leftover directory", "dir", dir, "err", err)
		} else {
			b.log.Info("subprocess: reaped leftover directory", "dir", dir)
		}
	}
	if b.cg != nil {
		names, err := b.cg.ReapDead(b.deadOwner)
		if len(names) > 0 {
			b.log.Info("subprocess: reaped leftover cgroups", "groups", names)
		}
		if err != nil {
			b.log.Warn("subprocess: reap leftover cgroups", "err", err)
		}
	}
}

// deadOwner reports whether name ("<owner>-<id>") belongs to a moat process
// that is no longer alive. Names of other forms are never reaped.
func (b *backend) deadOwner(name string) bool {
	id, ok := owner.Of(name)
	return ok && !owner.Alive(b.ownersDir, id)
}
