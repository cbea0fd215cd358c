package helper

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"syscall"

	"github.com/landlock-lsm/go-landlock/landlock"
	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/internal/seccomp"
)

// The helper stage. moat re-executes its own binary (/proc/self/exe) with
// argv[0] set to Arg0; the helper reads the spec, JSON, from fd 4. The helper runs
// as the init (PID 1) of a fresh PID namespace when moat is root: it joins
// the run's cgroups, sets the rlimits, no_new_privs, Landlock and seccomp on
// its own thread, starts python3 under the run's uid (the restrictions are
// inherited across fork and exec), reaps every process of the namespace, and
// reports python3's end on fd 3 — once python3 runs, as the reaper, a tiny
// program it execs in its own place (reaper.go). When it exits, the kernel
// kills whatever is left in the namespace, so nothing of the run outlives it.
//
// This runs in package init, before main, so that any binary importing this
// package (moat itself, test binaries) can serve as the helper. It is a
// package of its own, importing little, because the Go runtime initializes
// packages in order of import path among those whose imports are done
// (the language spec's "Package initialization"): this one's init then
// runs before those of the packages it does not depend on (Docker's client,
// Prometheus, the SDKs: about 4 ms of CPU per helper in moat's binary),
// whose work a helper would only throw away.

// Arg0 is the argv[0], alone in argv, that makes a moat process the helper.
const Arg0 = "moat-sandbox-helper"

// StatusFD is the pipe on which the helper reports to moat, SpecFD the one
// on which it receives its spec, and CodeFD the one it passes on to a
// pre-started python3 (its fd 3), on which moat sends the code's file name.
const (
	StatusFD = 3
	SpecFD   = 4
	CodeFD   = 5
)

func init() {
	if len(os.Args) == 1 && os.Args[0] == Arg0 {
		runtime.LockOSThread() // never unlocked: restrictions are per thread
		// syscall.Exit, not os.Exit: nothing to flush, and a binary built
		// with -race would otherwise sleep a second at exit.
		syscall.Exit(Main())
	}
}

// Spec is everything the helper needs, decided by moat beforehand.
type Spec struct {
	Python string   `json:"python"`
	Args   []string `json:"args"` // python3's argv, argv[0] included
	Env    []string `json:"env"`
	Dir    string   `json:"dir"`
	UID    int      `json:"uid"` // -1: keep moat's
	GID    int      `json:"gid"`

	// Cgroups are the files the helper's thread writes "0" into to join
	// the run's cgroups; python3, forked from that thread, starts there.
	Cgroups []string `json:"cgroups,omitempty"`
	Rlimits []Rlimit `json:"rlimits,omitempty"` // set on the helper, inherited
	// AddressSpace is RLIMIT_AS for python3 only (the Go helper itself
	// would not survive it); 0 means none.
	AddressSpace uint64 `json:"as,omitempty"`

	// Root, when set, is the run's own view of the filesystem (root.go),
	// entered before anything else restricts the helper.
	Root *RootSpec `json:"root,omitempty"`

	NoNewPrivs bool      `json:"nnp,omitempty"`
	Landlock   *LockSpec `json:"landlock,omitempty"`
	Seccomp    bool      `json:"seccomp,omitempty"`
	// Network selects seccomp's TCP variant (network.go): the run's
	// namespace holds moat's egress listener.
	Network bool `json:"net,omitempty"`
	// Prestart says python3 starts now, before its code is known, and
	// waits for the code's file name on its fd 3 (the helper's CodeFD):
	// Args run the bootstrap (prestart.go). The helper says "started" on
	// its status pipe once python3 is forked.
	Prestart bool `json:"pre,omitempty"`
}

type Rlimit struct {
	Resource int    `json:"r"`
	Cur      uint64 `json:"c"`
	Max      uint64 `json:"m"`
}

type LockSpec struct {
	ReadOnly  []string `json:"ro"`  // directories: read and execute
	ReadFiles []string `json:"rof"` // single files: read
	ExecFiles []string `json:"xf"`  // single files: read and execute
	RWFiles   []string `json:"rwf"` // single files: read and write (/dev/null)
	Work      string   `json:"work"`
	// ConnectTCP are the TCP ports the code may connect to (ABI 4+):
	// the egress proxy's, or none.
	ConnectTCP []uint16 `json:"tcp,omitempty"`
}

// Main returns the helper's exit status.
func Main() int {
	status := os.NewFile(StatusFD, "status")
	specFile := os.NewFile(SpecFD, "spec")
	if status == nil || specFile == nil {
		return 126
	}
	arg, err := io.ReadAll(specFile)
	specFile.Close()
	if err != nil || len(arg) == 0 {
		return 0 // discarded before any run: nothing to do
	}
	fail := func(step string, err error) int {
		fmt.Fprintf(status, "error %s: %v\n", step, err)
		return 125
	}
	// python3 gets fds 0, 1 and 2 only: not the status pipe, and not what
	// moat itself inherited without close-on-exec, which exec.Cmd passes on.
	if err := closeOnExecFrom(StatusFD); err != nil {
		return fail("close-on-exec", err)
	}
	// Not dumpable: where python3 runs under the helper's own uid
	// (hardening=tutorial), its descriptors (the status pipe), memory and
	// ptrace would be open to the code, which could write the report.
	// The reaper, which exec makes dumpable again, is exec'd unreadable
	// for the same reason (loadReaper).
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fail("dumpable", err)
	}
	var sp Spec
	if err := json.Unmarshal(arg, &sp); err != nil {
		return fail("spec", err)
	}
	for _, f := range sp.Cgroups {
		if err := os.WriteFile(f, []byte("0"), 0); err != nil {
			return fail("join cgroup", err)
		}
	}
	// The reaper (reaper.go) is loaded now, while the host's /proc is
	// there; it serves only an init, which the helper is in the run's own
	// PID namespace.
	reaper := -1
	if os.Getpid() == 1 {
		reaper = loadReaper()
	}
	if sp.Root != nil {
		if err := enterRoot(sp.Root); err != nil {
			return fail("root", err)
		}
	}
	for _, r := range sp.Rlimits {
		if err := syscall.Setrlimit(r.Resource, &syscall.Rlimit{Cur: r.Cur, Max: r.Max}); err != nil {
			return fail("setrlimit "+strconv.Itoa(r.Resource), err)
		}
	}
	if sp.NoNewPrivs {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			return fail("no_new_privs", err)
		}
	}
	if sp.Landlock != nil {
		if err := restrictLandlock(sp.Landlock); err != nil {
			return fail("landlock", err)
		}
	}
	if sp.Seccomp {
		filter := seccomp.Filter
		if sp.Network {
			filter = seccomp.FilterTCP
		}
		prog, err := filter()
		if err != nil {
			return fail("seccomp", err)
		}
		if err := seccomp.Install(prog); err != nil {
			return fail("seccomp", err)
		}
	}

	attr := &syscall.ProcAttr{
		Dir:   sp.Dir,
		Env:   sp.Env,
		Files: []uintptr{0, 1, 2},
		Sys:   &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL},
	}
	if sp.Prestart {
		attr.Files = append(attr.Files, CodeFD)
	}
	if sp.UID >= 0 {
		attr.Sys.Credential = &syscall.Credential{Uid: uint32(sp.UID), Gid: uint32(sp.GID), Groups: []uint32{}}
	}
	pid, err := startPython(sp, attr)
	if err != nil {
		return fail("start "+sp.Python, err)
	}
	if sp.Prestart {
		// python3 holds the code pipe now; the helper's own end would
		// keep it open if python3 died.
		syscall.Close(CodeFD)
		fmt.Fprintf(status, "started\n")
	}
	// python3, forked above, keeps the default OOM score; the helper, which
	// is in the run's memory cgroup too, steps out of the OOM killer's way
	// so that it is the code that gets killed, not its reporter. If this
	// fails, the run still ends as a memory result (see process.evidence).
	if os.Geteuid() == 0 {
		os.WriteFile("/proc/self/oom_score_adj", []byte("-1000"), 0)
	}
	if reaper >= 0 {
		// From here on the reaper does what the loop below does, in a
		// few hundred bytes instead of a Go runtime. It returns only if
		// the exec failed; the loop then does the job.
		execReaper(reaper, pid)
	}
	// Reap every process that ends up ours (as PID 1 of the namespace,
	// orphans are reparented to us) until python3 itself has ended. The
	// reaper does the same, step for step.
	for {
		var ws syscall.WaitStatus
		var ru syscall.Rusage
		wpid, err := syscall.Wait4(-1, &ws, 0, &ru)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return fail("wait", err)
		}
		if wpid != pid {
			continue
		}
		if os.Getpid() == 1 {
			// As the init of the run's own PID namespace (and only
			// then: outside one, -1 would be every process the helper
			// may signal): every other process of the run is killed and
			// reaped, and the helper's own ends of the output closed,
			// before the report, so that moat knows from the report
			// alone that nothing of the run is left, and sees the end
			// of the output now, not at the helper's exit.
			syscall.Kill(-1, syscall.SIGKILL)
			for {
				if _, err := syscall.Wait4(-1, nil, 0, nil); errors.Is(err, syscall.ECHILD) || (err != nil && !errors.Is(err, syscall.EINTR)) {
					break
				}
			}
			syscall.Close(1)
			syscall.Close(2)
		}
		if !ws.Exited() && !ws.Signaled() {
			continue
		}
		status.Write(EncodeReport(ws, &ru))
		return 0
	}
}

// closeOnExecFrom marks every file descriptor from first on close-on-exec.
func closeOnExecFrom(first int) error {
	err := unix.CloseRange(uint(first), ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
	if err == nil || !(errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL)) {
		return err
	}
	// Before Linux 5.11: one at a time.
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err
	}
	for _, e := range entries {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= first {
			unix.CloseOnExec(fd)
		}
	}
	return nil
}

// Prlimit is util-linux's prlimit(1), which sets a limit on itself and
// execs the command: the way to give python3 an RLIMIT_AS that the Go
// helper itself would not survive.
const Prlimit = "/usr/bin/prlimit"

// startPython forks and execs python3, through prlimit(1) when an address
// space limit is asked for.
func startPython(sp Spec, attr *syscall.ProcAttr) (int, error) {
	if sp.AddressSpace == 0 {
		return syscall.ForkExec(sp.Python, sp.Args, attr)
	}
	argv := append([]string{"prlimit", fmt.Sprintf("--as=%d:%d", sp.AddressSpace, sp.AddressSpace), "--", sp.Python}, sp.Args[1:]...)
	return syscall.ForkExec(Prlimit, argv, attr)
}

// workAccess is what the code may do in its working directory: everything
// but executing files and making device nodes.
const workAccess = llsys.AccessFSWriteFile | llsys.AccessFSReadFile | llsys.AccessFSReadDir |
	llsys.AccessFSRemoveDir | llsys.AccessFSRemoveFile | llsys.AccessFSMakeDir |
	llsys.AccessFSMakeReg | llsys.AccessFSMakeSock | llsys.AccessFSMakeFifo |
	llsys.AccessFSMakeSym | llsys.AccessFSRefer | llsys.AccessFSTruncate

// restrictLandlock enforces the ruleset on the calling thread; python3
// inherits it. Every access right the kernel's ABI knows is handled, so
// anything not granted below is denied: TCP bind (ABI 4+) gets no rule at
// all, TCP connect none but to the ports of l.ConnectTCP, and abstract unix sockets and signals are scoped to the
// sandbox (ABI 6+).
func restrictLandlock(l *LockSpec) error {
	abi, err := llsys.LandlockGetABIVersion()
	if err != nil || abi < 1 {
		return fmt.Errorf("landlock is not available in this kernel (abi %d): %v", abi, err)
	}
	rules := []landlock.Rule{
		landlock.RODirs(l.ReadOnly...).IgnoreIfMissing(),
		landlock.ROFiles(l.ReadFiles...).IgnoreIfMissing(),
		landlock.PathAccess(llsys.AccessFSExecute|llsys.AccessFSReadFile, l.ExecFiles...).IgnoreIfMissing(),
		landlock.RWFiles(l.RWFiles...).IgnoreIfMissing(),
		landlock.PathAccess(workAccess, l.Work),
	}
	for _, port := range l.ConnectTCP {
		rules = append(rules, landlock.ConnectTCP(port))
	}
	// BestEffort only drops what this kernel's ABI cannot express; the ABI
	// floor above keeps the filesystem rules mandatory.
	fd, flags, err := landlock.V7.BestEffort().NewRulesetFD(rules...)
	if err != nil {
		return err
	}
	if fd < 0 {
		return errors.New("landlock ruleset is empty")
	}
	defer unix.Close(fd)
	return llsys.LandlockRestrictSelf(fd, flags)
}
