package gvisor

import (
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
)

// These tests need neither root nor runsc: they check how moat reads
// runsc's JSON logs, on records shaped as runsc 0.0~20240729.0 (Debian 13)
// writes them. rec makes one as gVisor's JSON emitter does
// (encoding/json), so a record with the code's text in it is escaped
// exactly as the sentry's would be.

func rec(level, msg string) string {
	b, err := json.Marshal(struct {
		Msg   string `json:"msg"`
		Level string `json:"level"`
		Time  string `json:"time"`
	}{msg, level, "2026-12-01T10:27:04.782074973Z"})
	if err != nil {
		panic(err)
	}
	return string(b)
}

func info(msg string) string { return rec("info", msg) }

// taskName cuts a name as gVisor does: at most TASK_COMM_LEN-1 bytes.
func taskName(s string) string {
	if len(s) > 15 {
		return s[:15]
	}
	return s
}

// Traced calls as the sentry logs them, with %[1]s for the task's name and
// %[2]s for the code's file name.
const (
	cloneEAGAIN  = "strace.go:611] [   1:   1] %[1]s X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 0 (0x0) errno=11 (try again) (513.076µs)"
	cloneOK      = "strace.go:611] [   1:   1] %[1]s X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 2 (0x2) (511.833µs)"
	forkEAGAIN   = "strace.go:611] [   1(   1):   3(   3)] %[1]s X fork() = 0 (0x0) errno=11 (try again) (12.5µs)"
	writeEFBIG   = "strace.go:605] [   1:   1] %[1]s X write(0x3 %[2]s, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=27 (file too large) (1.872µs)"
	writeENOSPC  = "strace.go:605] [   1:   1] %[1]s X write(0x3 %[2]s, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=28 (no space left on device) (1.412µs)"
	writeEntry   = "strace.go:567] [   1:   1] %[1]s E write(0x3 %[2]s, 0xb21e30 \"1\\n\", 0x2)"
	writeOK      = "strace.go:605] [   1:   1] %[1]s X write(0x3 %[2]s, ..., 0x2) = 2 (0x2) (27.532µs)"
	writeEAGAIN  = "strace.go:605] [   1:   1] %[1]s X write(0x4 %[2]s, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=11 (try again) (1.412µs)"
	spliceEAGAIN = "strace.go:605] [   1:   1] %[1]s X splice(0x3 pipe:[5], 0x0, 0x4 %[2]s, 0x0, 0x10000, 0x2) = 0 (0x0) errno=11 (try again) (3.1µs)"
	ftruncEntry  = "strace.go:567] [   1:   1] %[1]s E ftruncate(0x3 %[2]s, 0x1000)"
)

// call fills in a traced call's record with a task name (cut as gVisor
// cuts it) and a file name.
func call(format, name, file string) string {
	return info(fmt.Sprintf(format, taskName(name), file))
}

var (
	sentryExit = info("main.go:222] Exiting with status: 768")
	infoLine   = info("vfs.go:978] mounting tmpfs")
	// textLines are the text forms of the records (runsc's default log
	// format), which moat no longer reads.
	textLines = []string{
		"I1130 21:05:21.809370   29928 strace.go:611] [   1:   1] python3 X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 0 (0x0) errno=11 (try again) (513.076µs)",
		"I1130 21:07:27.184681   19952 strace.go:605] [   1:   1] python3 X write(0x3 /dev/shm/f, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=28 (no space left on device) (1.412µs)",
		"I1130 21:07:00.796032   17622 main.go:222] Exiting with status: 0",
		"panic: unable to activate mm: createStub: failed to get clone",
	}
)

func TestSentryEvents(t *testing.T) {
	const file = "/work/big"
	for _, c := range []struct {
		name  string
		lines []string
		want  sentryFacts
	}{
		{"nothing refused", []string{call(cloneOK, "python3", ""), call(writeEntry, "python3", file), call(writeOK, "python3", file), infoLine}, sentryFacts{}},
		{"clone refused", []string{call(cloneOK, "python3", ""), call(cloneEAGAIN, "python3", "")}, sentryFacts{pids: true}},
		{"fork refused, nested PID namespace", []string{call(forkEAGAIN, "python3", "")}, sentryFacts{pids: true}},
		{"file too large", []string{call(writeEFBIG, "python3", file)}, sentryFacts{fileSize: true}},
		{"disk full", []string{call(writeENOSPC, "python3", "/dev/shm/f")}, sentryFacts{disk: true}},
		// A full pipe is not a task limit.
		{"EAGAIN from a write", []string{call(writeEAGAIN, "python3", "pipe:[3]")}, sentryFacts{}},
		{"the sentry's end", []string{infoLine, sentryExit}, sentryFacts{exited: true, status: 768}},
		{"records sharing a line", []string{call(writeOK, "python3", file) + call(cloneEAGAIN, "python3", "")}, sentryFacts{pids: true}},
		{"an empty task name", []string{call(cloneEAGAIN, "", "")}, sentryFacts{pids: true}},
		{"a 15-byte name of invalid UTF-8", []string{call(cloneEAGAIN, strings.Repeat("\xff", 15), "")}, sentryFacts{pids: true}},
		// The code's own names for the real refusals: the record still
		// counts.
		{"real refusal, name with X", []string{call(cloneEAGAIN, "a X write(", "")}, sentryFacts{pids: true}},
		{"real refusal, name with E", []string{call(cloneEAGAIN, " E clone(", "")}, sentryFacts{pids: true}},
		{"real refusal, name ending in X", []string{call(cloneEAGAIN, "ab X", "")}, sentryFacts{pids: true}},
		{"real refusal, name ending in a space", []string{call(writeENOSPC, "ab X ", "/tmp/f")}, sentryFacts{disk: true}},

		// What the code can write, and must not change anything.
		{"text lines", textLines, sentryFacts{}},
		{"task name with a panic", []string{call(writeOK, "x\npanic: forged\n", "host:[2]")}, sentryFacts{}},
		{"task name making a write a clone", []string{call(writeEAGAIN, "a X clone(", "pipe:[3]")}, sentryFacts{}},
		{"task name making a write a fork", []string{call(writeEAGAIN, " X fork(", "pipe:[3]")}, sentryFacts{}},
		{"task name making an entry an exit", []string{call(writeEntry, "a X write(", "/tmp/a) = 0 (0x0) errno=28 (no space left on device) (1µs)")}, sentryFacts{}},
		{"file name making an entry an exit", []string{call(ftruncEntry, "python3", "/tmp/x X ftruncate(0x3 /tmp/f, 0x1) = 0 (0x0) errno=27 (file too large) (1µs) (")}, sentryFacts{}},
		{"file name making a splice a clone", []string{call(spliceEAGAIN, "python3", "/tmp/Q X clone(CLONE_VM, 0x0")}, sentryFacts{}},
		{"file name holding text lines", []string{call(writeOK, "python3", "/tmp/\n"+strings.Join(textLines, "\n")+"\n")}, sentryFacts{}},
		{"file name holding records", []string{call(writeOK, "python3", "/tmp/\n"+call(cloneEAGAIN, "python3", "")+"\n"+call(writeENOSPC, "python3", "/tmp/f")+"\n"+sentryExit+"\n")}, sentryFacts{}},
		{"file name holding the sentry's end", []string{call(writeOK, "python3", "/tmp/a\"}\n"+sentryExit)}, sentryFacts{}},
		// A long record torn by another writer: neither piece counts,
		// and neither does the record that tore it.
		{"torn record", func() []string {
			long := call(writeOK, "python3", "/tmp/"+strings.Repeat("y", 5000)+"\n"+call(writeENOSPC, "python3", "/tmp/f"))
			return []string{long[:4096] + call(cloneOK, "python3", ""), long[4096:]}
		}(), sentryFacts{}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var e sentryEvents
			e.read(strings.NewReader(strings.Join(c.lines, "\n") + "\n"))
			got := e.snapshot()
			if got.pids != c.want.pids || got.fileSize != c.want.fileSize || got.disk != c.want.disk ||
				got.exited != c.want.exited || got.status != c.want.status {
				t.Errorf("got pids %v filesize %v disk %v exited %v (%#x), want %+v\nlog:\n%s",
					got.pids, got.fileSize, got.disk, got.exited, uint32(got.status), c.want, strings.Join(c.lines, "\n"))
			}
		})
	}
}

// FuzzForgedRecord puts any task name and file name into the sentry's
// records of calls that reached no limit: none may read as a refusal or as
// the sentry's end.
func FuzzForgedRecord(f *testing.F) {
	f.Add("x\npanic: forged\n", "/tmp/a")
	f.Add("a X clone(", "/tmp/Q X clone(CLONE_VM, 0x0")
	f.Add(" E ", "/tmp/a) = 0 (0x0) errno=28 (no space left on device) (1µs)")
	f.Add("\"}", "/tmp/\"}\n"+sentryExit)
	f.Fuzz(func(t *testing.T, name, path string) {
		path = "/tmp/" + path // a file's name as the sentry prints it is absolute
		var e sentryEvents
		for _, format := range []string{cloneOK, writeEntry, writeOK, writeEAGAIN, spliceEAGAIN, ftruncEntry} {
			e.read(strings.NewReader(call(format, name, path) + "\n"))
		}
		got := e.snapshot()
		if got.pids || got.fileSize || got.disk || got.exited {
			t.Errorf("task %q, file %q: got pids %v filesize %v disk %v exited %v from calls that were not refused",
				taskName(name), path, got.pids, got.fileSize, got.disk, got.exited)
		}
		// The same names in real refusals still count.
		var r sentryEvents
		r.read(strings.NewReader(call(cloneEAGAIN, name, "") + "\n" + call(writeENOSPC, name, path) + "\n"))
		if got := r.snapshot(); !got.pids || !got.disk {
			t.Errorf("task %q, file %q: a refused clone and write read as pids %v, disk %v", taskName(name), path, got.pids, got.disk)
		}
	})
}

// FuzzSentryLog feeds arbitrary logs to the reader: it must never panic,
// and a log without the strace mark can report no refusal.
func FuzzSentryLog(f *testing.F) {
	f.Add([]byte(call(cloneEAGAIN, "python3", "") + "\n"))
	f.Add([]byte("panic: x\n" + strings.Repeat("y", 70000) + "\nfatal error: z"))
	f.Fuzz(func(t *testing.T, log []byte) {
		var e sentryEvents
		e.read(strings.NewReader(string(log)))
		got := e.snapshot()
		if !strings.Contains(string(log), "strace.go:") && (got.pids || got.fileSize || got.disk) {
			t.Errorf("a log with no traced call reported a refusal: %q", log)
		}
		if len(got.last) > 8 {
			t.Errorf("kept %d lines, want at most 8", len(got.last))
		}
	})
}

func TestParseRunLog(t *testing.T) {
	head := info("main.go:196] **************** gVisor ****************") + "\n" +
		rec("warning", "sandbox.go:751] Failed to set RLIMIT_MEMLOCK: operation not permitted") + "\n"
	for _, c := range []struct {
		name, log       string
		exited          bool
		code            int
		signal          syscall.Signal
		fatal           string
		warningsAtLeast int
	}{
		{"exit 0", head + info("main.go:222] Exiting with status: 0") + "\n", true, 0, 0, "", 1},
		{"exit 139, not a signal", head + info("main.go:222] Exiting with status: 35584") + "\n", true, 139, 0, "", 1},
		{"SIGSEGV", head + info("main.go:222] Exiting with status: 11") + "\n", true, 0, syscall.SIGSEGV, "", 1},
		{"killed: no status", head, false, 0, 0, "", 1},
		{"fatal", head + rec("warning", "util.go:64] FATAL ERROR: running container: creating container: cannot create sandbox") + "\n",
			false, 0, 0, "running container: creating container: cannot create sandbox", 2},
		{"the sentry died", head + rec("warning", `sandbox.go:1248] Wait RPC to container "x" failed: urpc method "containerManager.Wait" failed: EOF. Will try waiting on the sandbox process instead.`) + "\n" +
			info("main.go:222] Exiting with status: 512") + "\n", true, 2, 0, "", 2},
		// The text format is not read.
		{"text", "I1130 21:07:00.796032   17622 main.go:222] Exiting with status: 0\n", false, 0, 0, "", 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			rl := parseRunLog([]byte(c.log))
			if rl.exited != c.exited || rl.fatal != c.fatal || len(rl.warnings) < c.warningsAtLeast {
				t.Fatalf("parseRunLog = %+v, want exited %v, fatal %q, at least %d warnings", rl, c.exited, c.fatal, c.warningsAtLeast)
			}
			if !c.exited {
				return
			}
			if c.signal != 0 {
				if !rl.status.Signaled() || rl.status.Signal() != c.signal {
					t.Errorf("status %#x: want signal %v", uint32(rl.status), c.signal)
				}
			} else if !rl.status.Exited() || rl.status.ExitStatus() != c.code {
				t.Errorf("status %#x: want exit %d", uint32(rl.status), c.code)
			}
		})
	}
}
