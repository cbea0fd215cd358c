package engine

import (
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
)

// Evidence is what moat knows about how a run ended, all of it from outside
// the code. The engine sets Canceled, WallTime and Output; the backend sets
// the rest from what its level lets the host see.
type Evidence struct {
	// Set by the engine.

	// Canceled: the engine killed the run because the caller's context
	// ended.
	Canceled bool
	// WallTime: the engine killed the run at the wall time.
	WallTime bool
	// Output: an output stream passed its cap and the engine killed the
	// run.
	Output bool

	// Set by the backend.

	// Exited says the code's first process ended by itself and Status is
	// how, as the host kernel (or a component outside the code that the
	// level trusts: gVisor's sentry, the microvm guest agent) reported it.
	// When it is false the code was killed, and the verdict says SIGKILL.
	Exited bool
	Status syscall.WaitStatus
	// CPUTime: the run's CPU time reached the limit (the backend's watch
	// killed it, or its rlimit sent SIGXCPU). A death by SIGXCPU is not
	// evidence by itself, since the code can send itself the signal (and,
	// where a shell reports the status, exit with 152): a backend sets
	// CPUTime for one only when the host measured the run's CPU time
	// limit spent (XCPUAtLimit).
	CPUTime bool
	// Memory: the memory limit was hit (an OOM kill in the run's cgroup).
	Memory bool
	// Pids: the process limit refused a fork or a thread.
	Pids bool
	// FileSize: the run wrote a file that reached the file size limit.
	FileSize bool
	// Disk: the run's writable space ran out.
	Disk bool

	// Notes are facts for the Result's Notes (an interpreter restarted).
	Notes []string
	// Spent says a session's budget ran out with this run; the session's
	// later runs fail with moat.ErrSpent.
	Spent bool
}

// Verdict is how a run ended, for moat.Result.
type Verdict struct {
	ExitCode int
	Signal   syscall.Signal // 0 when the code exited by itself
	Reason   moat.Reason
}

// SignalName is the Result's name for v.Signal, or "".
func (v Verdict) SignalName() string {
	if v.Signal == 0 {
		return ""
	}
	return unix.SignalName(v.Signal)
}

// Judge turns evidence into the run's verdict. The exit code is the code's
// status, or 128 plus the signal that ended it; a run that moat ended
// (cancelled, at the wall time, past the output cap) or that was not seen
// to end by itself reports SIGKILL. The reason is the first that applies in
// the order moat.Reason documents: canceled, timeout, memory, pids,
// filesize, disk, output, signal.
func Judge(ev Evidence) Verdict {
	var v Verdict
	killedByUs := ev.Canceled || ev.WallTime || ev.Output
	switch {
	case killedByUs || !ev.Exited:
		v.Signal = syscall.SIGKILL
	case ev.Status.Signaled():
		v.Signal = ev.Status.Signal()
	case ev.Status.Exited():
		v.ExitCode = ev.Status.ExitStatus()
	default:
		// A status that is neither an exit nor a death (stopped, continued)
		// does not say the code ended: it was not seen to end.
		v.Signal = syscall.SIGKILL
	}
	if v.Signal != 0 {
		v.ExitCode = 128 + int(v.Signal)
	}
	switch {
	case ev.Canceled:
		v.Reason = moat.ReasonCanceled
	case ev.WallTime || ev.CPUTime:
		v.Reason = moat.ReasonTimeout
	case ev.Memory:
		v.Reason = moat.ReasonMemory
	case ev.Pids:
		v.Reason = moat.ReasonPids
	case ev.FileSize:
		v.Reason = moat.ReasonFileSize
	case ev.Disk:
		v.Reason = moat.ReasonDisk
	case ev.Output:
		v.Reason = moat.ReasonOutput
	case v.Signal != 0:
		v.Reason = moat.ReasonSignal
	}
	return v
}

// XCPUAtLimit reports whether status is a death by SIGXCPU that the CPU
// time limit explains: the run used at least limit of CPU time (the run's
// CPU time limit, not its rounded RLIMIT_CPU) by the host's measure (used,
// from the run's cgroup or a trusted reaper's rusage), less slack for a
// measure taken up to that long before the death. The host's measures add
// up every process of the run, while the kernel sends SIGXCPU to one
// process that used its soft RLIMIT_CPU; so the backends set that soft
// limit to the CPU time limit rounded up to whole seconds (RlimitCPU): a
// process the kernel stops used at least the limit, and code that spreads
// CPU time over processes before it sends itself the signal passes only
// where the run's whole limit is spent, less slack. A death by the signal
// with less CPU time behind it is the code's own doing.
//
// XCPUSlack is the slack for a measure at the death: the kernel's CPU
// accounting of a process (its rusage) is sampled at ticks and can show a
// few ms under the soft limit that its SIGXCPU passed.
func XCPUAtLimit(status syscall.WaitStatus, used, limit, slack time.Duration) bool {
	return status.Signaled() && status.Signal() == syscall.SIGXCPU && limit > 0 && used >= limit-slack
}

// RlimitCPU is the soft RLIMIT_CPU that a backend sets on the processes of
// a run with CPU time limit cpu: cpu rounded up to whole seconds, at least
// one (the kernel counts RLIMIT_CPU in seconds). The host's watch of the
// run's whole CPU time ends a run at cpu itself; see XCPUAtLimit for why
// the per-process limit is never below it.
func RlimitCPU(cpu time.Duration) time.Duration {
	return max((cpu + time.Second - 1).Truncate(time.Second), time.Second)
}

// XCPUSlack: see XCPUAtLimit. The code would have to spend the rest of the
// limit less this to pass a SIGXCPU of its own for the limit's.
const XCPUSlack = 50 * time.Millisecond

// Exit and Signaled build the Status of a process that exited with code
// or was killed by sig, for backends whose level reports them apart.
func Exit(code int) syscall.WaitStatus { return syscall.WaitStatus(uint32(code&0xff) << 8) }

// Signaled: see Exit.
func Signaled(sig syscall.Signal) syscall.WaitStatus { return syscall.WaitStatus(uint32(sig) & 0x7f) }
