package gvisor

import (
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
)

// exited is the evidence of a run whose sentry reported the container's
// wait status ws, as a clean run leaves it.
func exited(ws syscall.WaitStatus) evidence {
	return evidence{
		runscExit: exitCode(ws),
		run:       runLog{exited: true, status: ws},
		sent:      sentryFacts{exited: true, status: ws},
	}
}

func TestVerdict(t *testing.T) {
	const (
		exit0   = syscall.WaitStatus(0)
		exit3   = syscall.WaitStatus(3 << 8)
		exit137 = syscall.WaitStatus(137 << 8)
		sigsegv = syscall.WaitStatus(syscall.SIGSEGV)
		sigxcpu = syscall.WaitStatus(syscall.SIGXCPU)
		sigkill = syscall.WaitStatus(syscall.SIGKILL)
		exit2   = syscall.WaitStatus(2 << 8) // the status of a sentry that panicked
	)
	with := func(ev evidence, f func(*evidence)) evidence { f(&ev); return ev }
	// A sentry that panicked: runsc could not wait for the container and
	// reports the sentry's own exit instead.
	panicked := evidence{
		runscExit: 2,
		run:       runLog{exited: true, status: exit2, warnings: []string{"Wait RPC to container failed"}},
		panicLog:  []byte("panic: Signal-induced panic\n\ngoroutine 12 [running]:\n"),
	}
	// A sentry killed by a SIGKILL from outside: no panic, no end of its
	// own, and runsc reports the sentry's death.
	killedOutside := evidence{runscExit: 137, run: runLog{exited: true, status: sigkill}}
	for _, c := range []struct {
		name string
		ev   evidence
		want outcome
		err  string // part of the error, when the run must fail
	}{
		{"exit 0", exited(exit0), outcome{}, ""},
		{"exit 3", exited(exit3), outcome{exitCode: 3}, ""},
		{"exit 137, not a signal", exited(exit137), outcome{exitCode: 137}, ""},
		{"SIGSEGV", exited(sigsegv), outcome{exitCode: 139, signal: syscall.SIGSEGV, reason: moat.ReasonSignal}, ""},
		{"SIGXCPU", exited(sigxcpu), outcome{exitCode: 128 + int(syscall.SIGXCPU), signal: syscall.SIGXCPU, reason: moat.ReasonTimeout}, ""},
		{"wall time", with(evidence{runscExit: -1}, func(e *evidence) { e.killed = true }), outcome{exitCode: 137, signal: syscall.SIGKILL, reason: moat.ReasonTimeout}, ""},
		{"canceled", with(evidence{runscExit: -1}, func(e *evidence) { e.killed, e.canceled = true, true }), outcome{exitCode: 137, signal: syscall.SIGKILL, reason: moat.ReasonCanceled}, ""},
		{"cpu time", with(exited(exit0), func(e *evidence) { e.cpuOver = true }), outcome{exitCode: 137, signal: syscall.SIGKILL, reason: moat.ReasonTimeout}, ""},
		{"output cap", with(exited(exit0), func(e *evidence) { e.outOver, e.truncated = true, true }), outcome{exitCode: 137, signal: syscall.SIGKILL, reason: moat.ReasonOutput}, ""},
		{"output cap, sandbox gone", with(evidence{runscExit: -1}, func(e *evidence) { e.outOver, e.truncated = true, true }), outcome{exitCode: 137, signal: syscall.SIGKILL, reason: moat.ReasonOutput}, ""},
		{"cgroup oom, sentry killed", with(killedOutside, func(e *evidence) { e.cgroup.OOMKill = true }), outcome{exitCode: 137, signal: syscall.SIGKILL, reason: moat.ReasonMemory}, ""},
		{"cgroup oom, code's exit reported", with(exited(exit3), func(e *evidence) { e.cgroup.OOMKill = true }), outcome{exitCode: 3, reason: moat.ReasonMemory}, ""},
		{"host pids limit, sentry panicked", with(panicked, func(e *evidence) { e.cgroup = cgroup.Events{PidsMax: true} }), outcome{exitCode: 137, signal: syscall.SIGKILL, reason: moat.ReasonPids}, ""},
		{"task limit", with(exited(exit0), func(e *evidence) { e.sent.pids = true }), outcome{reason: moat.ReasonPids}, ""},
		{"file size", with(exited(exit0), func(e *evidence) { e.sent.fileSize = true }), outcome{reason: moat.ReasonFileSize}, ""},
		{"disk", with(exited(exit0), func(e *evidence) { e.sent.disk = true }), outcome{reason: moat.ReasonDisk}, ""},
		{"output", with(exited(exit0), func(e *evidence) { e.truncated = true }), outcome{reason: moat.ReasonOutput}, ""},
		{"memory before pids", with(exited(exit0), func(e *evidence) { e.cgroup.OOMKill, e.sent.pids = true, true }), outcome{reason: moat.ReasonMemory}, ""},

		{"sentry panicked", panicked, outcome{}, "the sentry crashed: panic: Signal-induced panic"},
		{"sentry killed from outside", killedOutside, outcome{}, "the sentry ended without reporting"},
		{"runsc failed", evidence{runscExit: 128, run: runLog{fatal: "creating container: cannot create sandbox"}}, outcome{}, "runsc failed, nothing ran"},
		{"runsc killed", evidence{runscExit: -1}, outcome{}, "without the container's status"},
		{"runtime wrote to the panic log", with(exited(exit0), func(e *evidence) { e.panicLog = []byte("fatal error: x") }), outcome{}, "the sentry crashed"},
		{"runsc's exit code disagrees", with(exited(exit0), func(e *evidence) { e.runscExit = 1 }), outcome{}, "disagree"},
		{"the sentry's status disagrees", with(exited(exit0), func(e *evidence) { e.sent.status = exit3 }), outcome{}, "disagree"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := c.ev.verdict()
			if c.err != "" {
				if !errors.Is(err, moat.ErrUnavailable) || !strings.Contains(err.Error(), c.err) {
					t.Errorf("verdict = %+v, %v; want an error wrapping ErrUnavailable with %q", got, err, c.err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Errorf("verdict = %+v, %v; want %+v", got, err, c.want)
			}
		})
	}
}
