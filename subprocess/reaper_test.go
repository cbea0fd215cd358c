package subprocess

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func TestParseStatus(t *testing.T) {
	usage := &syscall.Rusage{Utime: syscall.Timeval{Sec: 1, Usec: 250000}, Stime: syscall.Timeval{Usec: 500000}}
	exit7 := encodeReport(syscall.WaitStatus(7<<8), usage)
	killed := encodeReport(syscall.WaitStatus(syscall.SIGKILL), usage)
	stopped := encodeReport(syscall.WaitStatus(0x137f), usage) // stopped by SIGSTOP
	cases := []struct {
		name string
		in   []byte
		ok   bool
		want helperStatus
		err  string // a prefix of want.err
	}{
		{"nothing", nil, false, helperStatus{}, ""},
		{"started only", []byte("started\n"), false, helperStatus{}, ""},
		{"exit", exit7, true, helperStatus{exited: true, code: 7, cpuMS: 1750}, ""},
		{"started, then exit", append([]byte("started\n"), exit7...), true, helperStatus{exited: true, code: 7, cpuMS: 1750}, ""},
		{"signal", killed, true, helperStatus{signaled: true, signal: syscall.SIGKILL, cpuMS: 1750}, ""},
		{"error", []byte("error landlock: no\n"), true, helperStatus{}, "landlock: no"},
		{"started, then error", []byte("started\nerror seccomp: x\n"), true, helperStatus{}, "seccomp: x"},
		{"cut short", exit7[:len(exit7)-1], true, helperStatus{}, "unreadable helper status"},
		{"too long", append(exit7, 0), true, helperStatus{}, "unreadable helper status"},
		{"the old text form", []byte("exit 0 12\n"), true, helperStatus{}, "unreadable helper status"},
		{"stopped", stopped, true, helperStatus{}, "helper reported wait status"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, ok := parseStatus(c.in)
			if ok != c.ok {
				t.Fatalf("ok %v, want %v (%+v)", ok, c.ok, got)
			}
			if c.err != "" {
				if !strings.HasPrefix(got.err, c.err) {
					t.Errorf("err %q, want one starting %q", got.err, c.err)
				}
				return
			}
			if got != c.want {
				t.Errorf("got %+v, want %+v", got, c.want)
			}
		})
	}
}

func FuzzParseStatus(f *testing.F) {
	f.Add([]byte("started\n"))
	f.Add([]byte("error x: y\n"))
	f.Add(encodeReport(syscall.WaitStatus(3<<8), &syscall.Rusage{}))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, ok := parseStatus(b)
		if ok && st.err == "" && !st.exited && !st.signaled {
			t.Errorf("%q: a report that is neither an error, an exit nor a signal: %+v", b, st)
		}
		// A report decodes to what encodes back to it (bytes 12 to 16,
		// zero in a report, are not read).
		if ws, ru, ok := decodeReport(b); ok {
			again := encodeReport(ws, &ru)
			copy(again[12:16], b[12:16])
			if !bytes.Equal(again, b) {
				t.Errorf("%q: decoded and encoded again, %q", b, again)
			}
		}
	})
}

// TestReaperMatchesSource rebuilds the reaper from testdata/reaper_amd64.S
// with GNU as and objcopy and compares it with reaperELF:
//
//	as --64 -o reaper.o testdata/reaper_amd64.S
//	objcopy -O binary -j .text reaper.o reaper
func TestReaperMatchesSource(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the reaper is written for amd64 only; here the Go helper reaps (reaper_other.go)")
	}
	for _, tool := range []string{"as", "objcopy"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s (binutils) to rebuild the reaper from its source: %v", tool, err)
		}
	}
	dir := t.TempDir()
	obj, bin := filepath.Join(dir, "reaper.o"), filepath.Join(dir, "reaper")
	for _, args := range [][]string{
		{"as", "--64", "-o", obj, "testdata/reaper_amd64.S"},
		{"objcopy", "-O", "binary", "-j", ".text", obj, bin},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	got, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, reaperELF) {
		t.Errorf("reaperELF (%d bytes) is not testdata/reaper_amd64.S assembled (%d bytes): regenerate reaper_amd64.go", len(reaperELF), len(got))
	}
}

// privateKiB is the private memory of process pid (smaps_rollup), in KiB.
func privateKiB(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && (f[0] == "Private_Clean:" || f[0] == "Private_Dirty:") {
			v, _ := strconv.Atoi(f[1])
			n += v
		}
	}
	return n
}

// children are the pids of pid's children.
func children(t *testing.T, pid int) []int {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + strconv.Itoa(pid) + "/children")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		n, _ := strconv.Atoi(f)
		out = append(out, n)
	}
	return out
}

// checkReaper checks that the helper pid, once its python3 runs, is the
// reaper: one thread, a small fraction of python3's private memory.
func checkReaper(t *testing.T, what string, pid int) {
	t.Helper()
	if runtime.GOARCH != "amd64" {
		t.Skip("the reaper is written for amd64 only; here the Go helper reaps (reaper_other.go)")
	}
	comm, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	if got := strings.TrimSpace(string(comm)); got != reaperArg0 {
		t.Errorf("%s: the helper is %q, not %s", what, got, reaperArg0)
	}
	kids := children(t, pid)
	if len(kids) != 1 {
		t.Fatalf("%s: the helper has children %v, want its python3 alone", what, kids)
	}
	helper, python := privateKiB(t, pid), privateKiB(t, kids[0])
	if helper*20 > python {
		t.Errorf("%s: the helper holds %d KiB of private memory, python3 %d KiB: want under a twentieth", what, helper, python)
	}
}

// TestIdleHelperIsTheReaper: the helper of an idle session's interpreter
// and of a pooled one-shot run, whose python3 has started, is the reaper,
// not a Go runtime (reaper.go).
func TestIdleHelperIsTheReaper(t *testing.T) {
	requireRootHere(t)
	sb, err := New(Config{Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	s, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	res, err := s.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
	if err != nil || string(res.Stdout) != "1\n" {
		t.Fatalf("%v %+v", err, res)
	}
	checkReaper(t, "an idle interpreter", s.(*Session).inst.current().cmd.Process.Pid)

	in, err := sb.b.Prepare(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer in.Discard()
	// Prepare returns once python3 is forked; the exec of the reaper and
	// python3's start follow.
	pid := in.(*instance).h.cmd.Process.Pid
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		comm, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
		if kids := children(t, pid); strings.TrimSpace(string(comm)) == reaperArg0 && len(kids) == 1 && privateKiB(t, kids[0]) > 1024 {
			break
		}
	}
	checkReaper(t, "a pooled run", pid)
}

// TestReaperReapsOrphans: the processes a run leaves to the init (a child
// whose parent has ended) are reaped while the run goes on, in a one-shot
// run and in a live interpreter: none of them stays a zombie.
func TestReaperReapsOrphans(t *testing.T) {
	requireRootHere(t)
	sb, err := New(Config{Warm: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	// Each child forks a grandchild, says its pid and ends; the
	// grandchild ends a little later, the init's child by then. A pid
	// that still takes signal 0 is a zombie no one reaped.
	const orphans = `import os, time
r, w = os.pipe()
for i in range(5):
    if os.fork() == 0:
        pid = os.fork()
        if pid == 0:
            time.sleep(0.2)
            os._exit(0)
        os.write(w, b'%d\n' % pid)
        os._exit(0)
    os.wait()
os.close(w)
pids = [int(p) for p in os.read(r, 4096).split()]
`
	const count = `time.sleep(1)
left = 0
for p in pids:
    try:
        os.kill(p, 0)
        left += 1
    except ProcessLookupError:
        pass
print(len(pids), left)
`
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(orphans + count)})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(res.Stdout)); got != "5 0" {
		t.Errorf("one-shot run: orphans, unreaped: %q (stderr %q)", got, res.Stderr)
	}
	s, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range 2 {
		res, err := s.Run(context.Background(), moat.Request{Code: []byte(orphans + count)})
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(string(res.Stdout)); got != "5 0" {
			t.Errorf("interpreter run %d: orphans, unreaped: %q (stderr %q)", i+1, got, res.Stderr)
		}
	}
	// Positive control: a zombie of the code's own, which only the code
	// may reap, shows.
	res, err = sb.Run(context.Background(), moat.Request{Code: []byte("import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\npids = [pid]\n" + count)})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(res.Stdout)); got != "1 1" {
		t.Errorf("positive control: %q, want the code's own unwaited child left (stderr %q)", got, res.Stderr)
	}
}

func requireRootHere(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root: the strict subprocess level needs it")
		}
		t.Skip("strict hardening needs root (CI runs this as root)")
	}
}
