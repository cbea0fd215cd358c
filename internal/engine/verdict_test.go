package engine

import (
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func TestJudge(t *testing.T) {
	kill := syscall.SIGKILL
	for _, c := range []struct {
		name   string
		ev     Evidence
		code   int
		sig    syscall.Signal
		reason moat.Reason
	}{
		{"exit 0", Evidence{Exited: true, Status: Exit(0)}, 0, 0, moat.ReasonNone},
		{"exit 3", Evidence{Exited: true, Status: Exit(3)}, 3, 0, moat.ReasonNone},
		{"exit 255", Evidence{Exited: true, Status: Exit(255)}, 255, 0, moat.ReasonNone},
		{"own signal", Evidence{Exited: true, Status: Signaled(syscall.SIGSEGV)}, 139, syscall.SIGSEGV, moat.ReasonSignal},
		{"own sigkill", Evidence{Exited: true, Status: Signaled(kill)}, 137, kill, moat.ReasonSignal},
		{"not seen to end", Evidence{}, 137, kill, moat.ReasonSignal},
		{"a stopped status", Evidence{Exited: true, Status: syscall.WaitStatus(0x137f)}, 137, kill, moat.ReasonSignal},
		{"a continued status", Evidence{Exited: true, Status: syscall.WaitStatus(0xffff)}, 137, kill, moat.ReasonSignal},
		{"canceled", Evidence{Canceled: true}, 137, kill, moat.ReasonCanceled},
		{"canceled beats everything", Evidence{Canceled: true, WallTime: true, CPUTime: true, Memory: true, Pids: true, FileSize: true, Disk: true, Output: true}, 137, kill, moat.ReasonCanceled},
		{"canceled though it exited", Evidence{Canceled: true, Exited: true, Status: Exit(0)}, 137, kill, moat.ReasonCanceled},
		{"wall time", Evidence{WallTime: true}, 137, kill, moat.ReasonTimeout},
		{"wall time beats output", Evidence{WallTime: true, Output: true}, 137, kill, moat.ReasonTimeout},
		{"cpu by watch", Evidence{CPUTime: true}, 137, kill, moat.ReasonTimeout},
		{"cpu by rlimit", Evidence{Exited: true, Status: Signaled(syscall.SIGXCPU), CPUTime: true}, 152, syscall.SIGXCPU, moat.ReasonTimeout},
		{"sigxcpu the host did not see", Evidence{Exited: true, Status: Signaled(syscall.SIGXCPU)}, 152, syscall.SIGXCPU, moat.ReasonSignal},
		{"timeout beats memory", Evidence{CPUTime: true, Memory: true}, 137, kill, moat.ReasonTimeout},
		{"memory", Evidence{Memory: true}, 137, kill, moat.ReasonMemory},
		{"memory exit code kept", Evidence{Memory: true, Exited: true, Status: Exit(1)}, 1, 0, moat.ReasonMemory},
		{"memory beats pids", Evidence{Memory: true, Pids: true}, 137, kill, moat.ReasonMemory},
		{"pids", Evidence{Pids: true, Exited: true, Status: Exit(1)}, 1, 0, moat.ReasonPids},
		{"pids beats filesize", Evidence{Pids: true, FileSize: true, Exited: true, Status: Exit(1)}, 1, 0, moat.ReasonPids},
		{"filesize", Evidence{FileSize: true, Exited: true, Status: Exit(1)}, 1, 0, moat.ReasonFileSize},
		{"filesize beats disk", Evidence{FileSize: true, Disk: true, Exited: true, Status: Exit(1)}, 1, 0, moat.ReasonFileSize},
		{"disk", Evidence{Disk: true, Exited: true, Status: Exit(0)}, 0, 0, moat.ReasonDisk},
		{"disk beats output", Evidence{Disk: true, Output: true}, 137, kill, moat.ReasonDisk},
		{"output", Evidence{Output: true, Exited: true, Status: Exit(0)}, 137, kill, moat.ReasonOutput},
		{"output beats signal", Evidence{Output: true, Exited: true, Status: Signaled(syscall.SIGSEGV)}, 137, kill, moat.ReasonOutput},
	} {
		t.Run(c.name, func(t *testing.T) {
			v := Judge(c.ev)
			if v.ExitCode != c.code || v.Signal != c.sig || v.Reason != c.reason {
				t.Errorf("Judge(%+v) = %d %v %q, want %d %v %q", c.ev, v.ExitCode, v.Signal, v.Reason, c.code, c.sig, c.reason)
			}
			if (v.Signal == 0) != (v.SignalName() == "") {
				t.Errorf("signal name %q for %v", v.SignalName(), v.Signal)
			}
		})
	}
}

func TestStatusBuilders(t *testing.T) {
	for code := 0; code < 256; code++ {
		if st := Exit(code); !st.Exited() || st.ExitStatus() != code {
			t.Fatalf("Exit(%d) = %#x", code, uint32(st))
		}
	}
	for sig := syscall.Signal(1); sig < 65; sig++ {
		if st := Signaled(sig); !st.Signaled() || st.Signal() != sig {
			t.Fatalf("Signaled(%d) = %#x", sig, uint32(st))
		}
	}
}

func TestXCPUAtLimit(t *testing.T) {
	xcpu, segv := Signaled(syscall.SIGXCPU), Signaled(syscall.SIGSEGV)
	s, slack := time.Second, 100*time.Millisecond
	for _, c := range []struct {
		name   string
		status syscall.WaitStatus
		used   time.Duration
		want   bool
	}{
		{"at the limit", xcpu, s, true},
		{"past it", xcpu, 3 * s, true},
		{"within the slack", xcpu, s - slack, true},
		{"self-sent, no CPU", xcpu, 0, false},
		{"self-sent, some CPU", xcpu, s / 2, false},
		{"another signal", segv, 3 * s, false},
		{"an exit 152", Exit(152), 3 * s, false},
	} {
		if got := XCPUAtLimit(c.status, c.used, s, slack); got != c.want {
			t.Errorf("%s: XCPUAtLimit(%#x, %v) = %v, want %v", c.name, uint32(c.status), c.used, got, c.want)
		}
	}
	for cpu, want := range map[time.Duration]time.Duration{0: s, 500 * time.Millisecond: s, s: s, 1900 * time.Millisecond: 2 * s, 10 * s: 10 * s} {
		if got := RlimitCPU(cpu); got != want {
			t.Errorf("RlimitCPU(%v) = %v, want %v (never below the limit)", cpu, got, want)
		}
	}
	if XCPUAtLimit(xcpu, 3*s, 0, slack) {
		t.Error("XCPUAtLimit with no limit (none set) = true")
	}
}
