package main

// What of the agent can be tested on the host, without a VM. The agent is
// PID 1 of a guest: most of it mounts, loads modules, writes the cgroup
// root, sets the clock, reseeds the kernel's generator or reboots, and must
// never run here. These tests call only what does none of that: the frames
// it sends and reads, the report it builds from python3's wait status and
// the run's evidence, the parsers of its inputs, the zygote's Python (run
// with the host's python3) and the guard that stops main outside a VM.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// TestMain runs main itself when asked to: the agent's guard, run by
// TestMainOutsideVM in a child that is not PID 1.
func TestMain(m *testing.M) {
	if os.Getenv("MOAT_AGENT_TEST_MAIN") == "1" {
		main()
		os.Exit(0) // main returned: the guard did not stop it
	}
	os.Exit(m.Run())
}

// The agent mounts over the root, writes the cgroup root and reboots the
// machine it runs on: outside a VM (not PID 1) it refuses at once.
func TestMainOutsideVM(t *testing.T) {
	if os.Getpid() == 1 {
		t.Fatal("the test runs as PID 1: the agent's guard cannot be tested here")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MOAT_AGENT_TEST_MAIN=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("main outside a VM: %v, stdout %q, stderr %q; want exit status 2", err, stdout.String(), stderr.String())
	}
	if !strings.Contains(stderr.String(), "must run as PID 1") || stdout.Len() != 0 {
		t.Errorf("main outside a VM: stdout %q, stderr %q; want only the refusal on stderr", stdout.String(), stderr.String())
	}
}

// portPair returns the agent's end of a connected pair of sockets, standing
// in for the virtio-serial port, and the host's end.
func portPair(t *testing.T) (agentEnd, hostEnd *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	agentEnd, hostEnd = os.NewFile(uintptr(fds[0]), "agent"), os.NewFile(uintptr(fds[1]), "host")
	t.Cleanup(func() { agentEnd.Close(); hostEnd.Close() })
	return agentEnd, hostEnd
}

// Frames sent at once from several goroutines (the two output pumps,
// Started, Exit) arrive whole, one after the other, each as it was sent.
func TestSendConcurrent(t *testing.T) {
	agentEnd, hostEnd := portPair(t)
	a := &agent{port: agentEnd}
	const senders, each = 4, 40
	var wg sync.WaitGroup
	for g := range senders {
		wg.Go(func() {
			for i := range each {
				// Sizes up to a whole MaxReport frame, larger than what a
				// socket or a pipe takes in one write.
				n := (g*each + i) * 7919 % wire.MaxReport
				p := append([]byte(fmt.Sprintf("%d %d ", g, i)), bytes.Repeat([]byte{byte('a' + g)}, n)...)
				if len(p) > wire.MaxReport {
					p = p[:wire.MaxReport]
				}
				k := wire.KindStdout
				if g%2 == 1 {
					k = wire.KindStderr
				}
				if err := a.send(k, p); err != nil {
					t.Errorf("send: %v", err)
					return
				}
			}
		})
	}
	go func() { wg.Wait(); agentEnd.Close() }()

	// Read to the end even after a bad frame, so that no sender is left
	// blocked when the test ends.
	next := make([]int, senders)
	bad := false
	for n := 0; ; n++ {
		k, p, err := wire.Read(hostEnd, wire.MaxReport)
		if err == io.EOF {
			if !bad && n != senders*each {
				t.Errorf("%d frames, want %d", n, senders*each)
			}
			break
		}
		if err != nil {
			t.Errorf("frame %d: %v", n, err)
			io.Copy(io.Discard, hostEnd)
			break
		}
		if bad {
			continue
		}
		var g, i int
		if _, err := fmt.Sscanf(string(p), "%d %d ", &g, &i); err != nil || g < 0 || g >= senders {
			t.Errorf("frame %d: payload %.40q does not start with its sender", n, p)
			bad = true
			continue
		}
		wantKind := wire.KindStdout
		if g%2 == 1 {
			wantKind = wire.KindStderr
		}
		body := p[len(fmt.Sprintf("%d %d ", g, i)):]
		if k != wantKind || i != next[g] || len(bytes.Trim(body, string(rune('a'+g)))) != 0 {
			t.Errorf("frame %d: %s from sender %d, number %d (want %s, number %d), %d bytes mixed with another frame's",
				n, k, g, i, wantKind, next[g], len(body))
			bad = true
			continue
		}
		next[g]++
	}
	wg.Wait()
}

func TestSendJSON(t *testing.T) {
	agentEnd, hostEnd := portPair(t)
	a := &agent{port: agentEnd}
	go func() {
		a.sendJSON(wire.KindHello, wire.Hello{Kernel: "6.18.0-moat", BootMS: 812})
		a.send(wire.KindStarted, nil)
		a.sendJSON(wire.KindExit, &wire.Exit{Signal: 9, CPU: true, CPUMS: 10, WallMS: 20})
		if err := a.sendJSON(wire.KindExit, func() {}); err == nil {
			t.Errorf("sendJSON of a func: no error")
		}
		agentEnd.Close()
	}()
	k, p, err := wire.Read(hostEnd, wire.MaxReport)
	var h wire.Hello
	if err != nil || k != wire.KindHello || json.Unmarshal(p, &h) != nil || h != (wire.Hello{Kernel: "6.18.0-moat", BootMS: 812}) {
		t.Errorf("hello: %s %q %v", k, p, err)
	}
	if k, p, err := wire.Read(hostEnd, wire.MaxReport); err != nil || k != wire.KindStarted || len(p) != 0 {
		t.Errorf("started: %s %q %v", k, p, err)
	}
	k, p, err = wire.Read(hostEnd, wire.MaxReport)
	var e wire.Exit
	if err != nil || k != wire.KindExit || json.Unmarshal(p, &e) != nil || e != (wire.Exit{Signal: 9, CPU: true, CPUMS: 10, WallMS: 20}) {
		t.Errorf("exit: %s %q %v", k, p, err)
	}
	if _, _, err := wire.Read(hostEnd, wire.MaxReport); err != io.EOF {
		t.Errorf("after the exit: %v, want EOF (nothing sent for a value that does not marshal)", err)
	}
}

// serve takes a Refresh, then one Run or Session frame, and nothing else.
// Every case here fails before the agent touches the machine: none carries
// a seed or a time (with them, refresh would set this host's clock and feed
// its random pool).
func TestServeRejects(t *testing.T) {
	frame := func(k wire.Kind, p string) []byte {
		var b bytes.Buffer
		wire.Write(&b, k, []byte(p))
		return b.Bytes()
	}
	run := func(r wire.Run) []byte {
		if r.UnixNano > 0 || len(r.Seed) > 0 {
			t.Fatal("a test Run must not carry a time or a seed")
		}
		b, _ := json.Marshal(r)
		return frame(wire.KindRun, string(b))
	}
	for _, tt := range []struct {
		name string
		in   []byte
		want string
		is   error
	}{
		{"nothing", nil, "read run", io.EOF},
		{"a header cut short", []byte{byte(wire.KindRun), 0, 0}, "read run", io.ErrUnexpectedEOF},
		{"a payload cut short", frame(wire.KindRun, `{"code":"cHJpbnQoMSk="}`)[:12], "read run", io.ErrUnexpectedEOF},
		{"a frame past MaxPayload", []byte{byte(wire.KindRun), 0x02, 0x00, 0x00, 0x01}, "read run", wire.ErrTooLarge},
		{"a hello", frame(wire.KindHello, `{}`), "want a refresh, a run or a session frame, got hello", nil},
		{"stdout", frame(wire.KindStdout, "x"), "want a refresh, a run or a session frame, got stdout", nil},
		{"a file operation before a session", frame(wire.KindFile, `{"op":"stat","name":"x"}`), "want a refresh, a run or a session frame, got file", nil},
		{"a kill", frame(wire.KindKill, ""), "want a refresh, a run or a session frame, got kill", nil},
		{"an unknown kind", frame(wire.Kind(0), ""), "want a refresh, a run or a session frame, got kind(0x0)", nil},
		{"not JSON", frame(wire.KindRun, "print(1)"), "run: ", nil},
		{"an empty run", frame(wire.KindRun, ""), "run: ", nil},
		{"code that is not base64", frame(wire.KindRun, `{"code":"%%%"}`), "run: ", nil},
		{"a limit that is not a number", frame(wire.KindRun, `{"memory":"256MiB"}`), "run: ", nil},
		{"no seed", run(wire.Run{Code: []byte("print(1)"), CPUMS: 1000}), "no seed", nil},
		{"no seed, a time before 1970", run(wire.Run{Code: []byte("print(1)"), UnixNano: -1}), "no seed", nil},
		{"a session that is not JSON", frame(wire.KindSession, "{"), "session: ", nil},
		{"a session without a seed", frame(wire.KindSession, `{"disk":1048576}`), "no seed", nil},
		{"a refresh that is not JSON", frame(wire.KindRefresh, "{"), "refresh: ", nil},
		{"a refresh without a seed", frame(wire.KindRefresh, `{}`), "no seed", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			agentEnd, hostEnd := portPair(t)
			// Small enough for the socket's buffer: written before serve
			// reads, then the host's side of the stream ends.
			if _, err := hostEnd.Write(tt.in); err != nil {
				t.Fatal(err)
			}
			if err := unix.Shutdown(int(hostEnd.Fd()), unix.SHUT_WR); err != nil {
				t.Fatal(err)
			}
			a := &agent{port: agentEnd}
			err := a.serve()
			if err == nil || !strings.Contains(err.Error(), tt.want) || tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("serve = %v, want an error with %q (wrapping %v)", err, tt.want, tt.is)
			}
			// It sent nothing: no Started, no Exit.
			agentEnd.Close()
			if k, p, err := wire.Read(hostEnd, wire.MaxReport); err != io.EOF {
				t.Errorf("the agent sent %s %q (%v); want nothing", k, p, err)
			}
		})
	}
}

// states returns python3's state after Wait for each way a process can end
// that report cares about, from real processes (no core dumps).
var states = sync.OnceValue(func() map[string]*os.ProcessState {
	m := map[string]*os.ProcessState{}
	for name, script := range map[string]string{
		"exit 0": "exit 0", "exit 1": "exit 1", "exit 3": "exit 3", "exit 255": "exit 255",
		"SIGKILL": "kill -KILL $$", "SIGXCPU": "kill -XCPU $$", "SIGSEGV": "kill -SEGV $$",
		"SIGINT": "kill -INT $$", "SIGTERM": "kill -TERM $$", "SIGXFSZ": "kill -XFSZ $$",
	} {
		cmd := exec.Command("/bin/sh", "-c", "ulimit -c 0; "+script)
		cmd.Run()
		m[name] = cmd.ProcessState
	}
	return m
})

// report states what it saw and decides nothing: the status as it is, and
// each piece of evidence, asked once.
func TestReport(t *testing.T) {
	lim := &wire.Run{CPUMS: 1000}
	type ev struct {
		over                      bool
		cpuMS                     int64
		oom, pids, file, diskFull bool
	}
	for _, tt := range []struct {
		state string
		ev    ev
		want  wire.Exit
	}{
		{"exit 0", ev{}, wire.Exit{}},
		{"exit 1", ev{}, wire.Exit{ExitCode: 1}},
		{"exit 3", ev{}, wire.Exit{ExitCode: 3}},
		{"exit 255", ev{}, wire.Exit{ExitCode: 255}},
		{"SIGSEGV", ev{}, wire.Exit{Signal: 11}},
		{"SIGINT", ev{}, wire.Exit{Signal: 2}},
		{"SIGTERM", ev{}, wire.Exit{Signal: 15}},
		{"SIGXCPU", ev{}, wire.Exit{Signal: 24}},
		{"SIGXFSZ", ev{file: true}, wire.Exit{Signal: 25, FileSize: true}},

		// The agent's own kill at the CPU time, even when python3 exited as
		// the kill came.
		{"SIGKILL", ev{over: true, oom: true, pids: true, file: true, diskFull: true},
			wire.Exit{Signal: 9, CPU: true, OOM: true, Pids: true, FileSize: true, Disk: true}},
		{"exit 0", ev{over: true}, wire.Exit{CPU: true}},
		// RLIMIT_CPU's SIGKILL at the hard limit: the cgroup is past it.
		{"SIGKILL", ev{cpuMS: 1000}, wire.Exit{Signal: 9, CPU: true}},
		{"SIGKILL", ev{cpuMS: 5000, oom: true}, wire.Exit{Signal: 9, CPU: true, OOM: true}},
		// A SIGKILL under the CPU limit is someone else's.
		{"SIGKILL", ev{cpuMS: 999, oom: true}, wire.Exit{Signal: 9, OOM: true}},
		{"SIGKILL", ev{cpuMS: 999}, wire.Exit{Signal: 9}},
		// Past the CPU time but exited by itself: no kill of moat's.
		{"exit 1", ev{cpuMS: 5000}, wire.Exit{ExitCode: 1}},

		{"exit 1", ev{pids: true, file: true, diskFull: true}, wire.Exit{ExitCode: 1, Pids: true, FileSize: true, Disk: true}},
		{"exit 1", ev{diskFull: true}, wire.Exit{ExitCode: 1, Disk: true}},
		{"exit 0", ev{oom: true}, wire.Exit{OOM: true}},
	} {
		name := fmt.Sprintf("%s %+v", tt.state, tt.ev)
		var asked string
		probe := func(c string, v bool) func() bool {
			return func() bool { asked += c; return v }
		}
		exit, err := report(states()[tt.state].Sys().(syscall.WaitStatus), lim, evidence{
			overTime: tt.ev.over, cpuMS: tt.ev.cpuMS, wallMS: 1234,
			oomKilled: probe("O", tt.ev.oom), pidsRefused: probe("P", tt.ev.pids),
			fileAtLimit: probe("F", tt.ev.file), diskFull: probe("D", tt.ev.diskFull),
		})
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		want := tt.want
		want.CPUMS, want.WallMS = tt.ev.cpuMS, 1234
		if *exit != want {
			t.Errorf("%s: report = %+v, want %+v", name, *exit, want)
		}
		if asked != "OPFD" {
			t.Errorf("%s: looked at %q, want each piece of evidence once (OPFD)", name, asked)
		}
	}
}

func TestFlatKeyed(t *testing.T) {
	const memoryEvents = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 1\n"
	for _, tt := range []struct {
		text, key string
		want      int64
	}{
		{memoryEvents, "oom_kill", 2},
		{memoryEvents, "oom_group_kill", 1},
		{memoryEvents, "oom", 3},
		{memoryEvents, "max", 12},
		{memoryEvents, "low", 0},
		{memoryEvents, "oom_", 0},
		{memoryEvents, "kill", 0},
		{memoryEvents, "", 0},
		{"max 5\n", "max", 5},
		{"max 5", "max", 5}, // no final newline
		{"usage_usec 1234567\nuser_usec 1000000\nsystem_usec 234567\n", "usage_usec", 1234567},
		{"usage_usec 9223372036854775807\n", "usage_usec", 9223372036854775807},
		{"usage_usec 99999999999999999999\n", "usage_usec", 9223372036854775807},
		{"max  7 \n", "max", 7},
		{"max\t7\n", "max", 7},
		{"max 7 8\nmax 9\n", "max", 9},
		{"max seven\n", "max", 0},
		{"max\n", "max", 0},
		{"", "max", 0},
		{"\n\n\n", "max", 0},
		{"max 1\nmax 2\n", "max", 1},
		{strings.Repeat("x", 70000) + "\nmax 4\n", "max", 0}, // a line past the scanner's limit ends the scan
	} {
		if got := flatKeyed([]byte(tt.text), tt.key); got != tt.want {
			t.Errorf("flatKeyed(%.40q, %q) = %d, want %d", tt.text, tt.key, got, tt.want)
		}
	}
}

func TestFileAtLimit(t *testing.T) {
	write := func(p string, n int) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, make([]byte, n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const limit = 4096
	for _, tt := range []struct {
		name  string
		files map[string]int // path under the first of two dirs ("b/..." for the second) → size
		links map[string]string
		want  bool
	}{
		{"nothing", nil, nil, false},
		{"files under the limit", map[string]int{"a": limit - 1, "d/e/f": 0, "g": 100}, nil, false},
		{"a file at the limit", map[string]int{"a": 1, "work/out.bin": limit}, nil, true},
		{"a file past the limit", map[string]int{"a": limit + 1}, nil, true},
		{"deep down", map[string]int{"1/2/3/4/5/6/7/8/x": limit}, nil, true},
		{"in the second dir", map[string]int{"a": 1, "b/shm/seg": limit}, nil, true},
		{"in a directory the code called .moat", map[string]int{"work/.moat/main.py": limit}, nil, true},
		{"a symbolic link to a large file is not a file the run wrote", nil, map[string]string{"big": "../outside/big"}, false},
		{"a dangling symbolic link", nil, map[string]string{"x": "/nonexistent"}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			root := t.TempDir()
			first, second := filepath.Join(root, "u"), filepath.Join(root, "b")
			os.Mkdir(first, 0o755)
			os.Mkdir(second, 0o755)
			write(filepath.Join(root, "outside", "big"), 2*limit)
			since := time.Now().Add(-time.Second)
			for p, n := range tt.files {
				if rest, ok := strings.CutPrefix(p, "b/"); ok {
					write(filepath.Join(second, rest), n)
				} else {
					write(filepath.Join(first, p), n)
				}
			}
			for p, target := range tt.links {
				if err := os.Symlink(target, filepath.Join(first, p)); err != nil {
					t.Fatal(err)
				}
			}
			if got := fileAtLimit(limit, since, nil, first, second); got != tt.want {
				t.Errorf("fileAtLimit = %v, want %v", got, tt.want)
			}
		})
	}
	if fileAtLimit(limit, time.Time{}, nil, filepath.Join(t.TempDir(), "missing")) {
		t.Errorf("fileAtLimit of a missing directory = true")
	}
	// A directory it cannot read does not stop the walk of the others.
	root := t.TempDir()
	write(filepath.Join(root, "closed", "x"), 1)
	write(filepath.Join(root, "open", "big"), limit)
	if err := os.Chmod(filepath.Join(root, "closed"), 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(filepath.Join(root, "closed"), 0o755) })
	if !fileAtLimit(limit, time.Time{}, nil, filepath.Join(root, "closed"), filepath.Join(root, "open")) {
		t.Errorf("fileAtLimit past an unreadable directory = false, want true")
	}
}

// In a session, a file at the limit from before the run, or one the host
// wrote during it, is not the run's: only files changed since the run
// began count, by their ctime (which the code cannot set back, unlike the
// mtime).
func TestFileAtLimitSince(t *testing.T) {
	const limit = 4096
	dir := t.TempDir()
	old := filepath.Join(dir, "old")
	if err := os.WriteFile(old, make([]byte, limit), 0o644); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * ctimeSlack)
	since := time.Now()
	if fileAtLimit(limit, since, nil, dir) {
		t.Errorf("a file at the limit from before the run counts as the run's")
	}
	// Touching its mtime back does not hide a file the run wrote.
	fresh := filepath.Join(dir, "fresh")
	if err := os.WriteFile(fresh, make([]byte, limit), 0o644); err != nil {
		t.Fatal(err)
	}
	long := time.Now().Add(-time.Hour)
	if err := os.Chtimes(fresh, long, long); err != nil {
		t.Fatal(err)
	}
	if !fileAtLimit(limit, since, nil, dir) {
		t.Errorf("a file at the limit written in the run, its mtime set back, does not count")
	}
	var st syscall.Stat_t
	if err := syscall.Stat(fresh, &st); err != nil {
		t.Fatal(err)
	}
	if fileAtLimit(limit, since, map[uint64]bool{st.Ino: true}, dir) {
		t.Errorf("a file the host wrote during the run counts as the run's")
	}
}

// diskFull sees both ways a tmpfs fills up: no block and no inode left.
func TestDiskFull(t *testing.T) {
	if diskFull(t.TempDir()) {
		t.Errorf("diskFull of an empty temporary directory = true")
	}
	if diskFull(filepath.Join(t.TempDir(), "missing")) {
		t.Errorf("diskFull of a missing directory = true")
	}
	if os.Geteuid() != 0 {
		t.Skip("mounting a small tmpfs needs root; CI runs as root")
	}
	mount := func(opts string) string {
		dir := t.TempDir()
		if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
			t.Fatalf("mount tmpfs %s: %v", opts, err)
		}
		t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
		return dir
	}

	blocks := mount("size=64k,nr_inodes=1024")
	if diskFull(blocks) {
		t.Errorf("diskFull of an empty 64k tmpfs = true")
	}
	f, err := os.Create(filepath.Join(blocks, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.Write(make([]byte, 128<<10))
	f.Close()
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("writing 128KiB to a 64k tmpfs: %v, want ENOSPC", err)
	}
	if !diskFull(blocks) {
		t.Errorf("diskFull of a tmpfs with no space left = false")
	}

	inodes := mount("size=1m,nr_inodes=8")
	for i := 0; ; i++ {
		f, err := os.Create(filepath.Join(inodes, fmt.Sprint(i)))
		if err != nil {
			if !errors.Is(err, unix.ENOSPC) {
				t.Fatal(err)
			}
			break
		}
		f.Close()
		if i > 100 {
			t.Fatal("a tmpfs of 8 inodes took 100 files")
		}
	}
	if !diskFull(inodes) {
		t.Errorf("diskFull of a tmpfs with no inode left = false")
	}
}

// loadModules' checks that come before it loads anything (it loads nothing
// on this host).
func TestLoadModules(t *testing.T) {
	dir := t.TempDir()
	if err := loadModules(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("no order file: %v, want ErrNotExist", err)
	}
	for _, order := range []string{"", "\n", "  \n\t\n"} {
		os.WriteFile(filepath.Join(dir, "order"), []byte(order), 0o644)
		if err := loadModules(dir); err != nil {
			t.Errorf("order %q, a kernel with every driver built in: %v, want nil", order, err)
		}
	}
	os.WriteFile(filepath.Join(dir, "order"), []byte("virtio_mmio.ko\n"), 0o644)
	if err := loadModules(dir); !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "virtio_mmio.ko") {
		t.Errorf("a module named but missing: %v, want ErrNotExist naming it", err)
	}
}

func TestWaitFor(t *testing.T) {
	dir := t.TempDir()
	if err := waitFor(dir, 0); err != nil {
		t.Errorf("waitFor of a directory that is there: %v", err)
	}
	missing := filepath.Join(dir, "vda")
	if err := waitFor(missing, 20*time.Millisecond); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("waitFor of a path that never comes: %v, want an error naming it", err)
	}
	go func() {
		time.Sleep(30 * time.Millisecond)
		os.WriteFile(missing, nil, 0o644)
	}()
	if err := waitFor(missing, time.Minute); err != nil {
		t.Errorf("waitFor of a path that comes: %v", err)
	}
}

func TestFindPortMissing(t *testing.T) {
	const name = "moat.agent.test-no-such-port"
	if dev, err := findPort(name, 20*time.Millisecond); err == nil || !strings.Contains(err.Error(), name) {
		t.Errorf("findPort(%q) = %q, %v; want an error naming it", name, dev, err)
	}
}

// python3 runs chrooted, as the run's uid with no supplementary group (not
// root's), in a session of its own, with an environment of its own.
func TestPythonCmd(t *testing.T) {
	t.Setenv("MOAT_TEST_SECRET", "s3cret")
	cmd := pythonCmd("/.moat/zygote.py")
	if cmd.Path != python || !slices.Equal(cmd.Args, []string{"python3", "/.moat/zygote.py"}) || cmd.Dir != workDir {
		t.Errorf("path %q, args %q, dir %q", cmd.Path, cmd.Args, cmd.Dir)
	}
	wantEnv := []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + workDir, "LANG=C.UTF-8"}
	if !slices.Equal(cmd.Env, wantEnv) {
		t.Errorf("env %q, want exactly %q (never the agent's)", cmd.Env, wantEnv)
	}
	sp := cmd.SysProcAttr
	if sp == nil || sp.Chroot != newRoot || !sp.Setsid || sp.Credential == nil {
		t.Fatalf("SysProcAttr %+v, want a chroot to %s, a new session and a credential", sp, newRoot)
	}
	c := sp.Credential
	if c.Uid != runUID || c.Gid != runGID || len(c.Groups) != 0 || c.NoSetGroups {
		t.Errorf("credential %+v, want uid %d, gid %d, and setgroups to none", c, runUID, runGID)
	}
	if runUID == 0 || runGID == 0 {
		t.Errorf("the run's uid %d and gid %d must not be root's", runUID, runGID)
	}
	if len(sp.AmbientCaps) != 0 || sp.Setctty || sp.Foreground || sp.Ptrace || sp.UseCgroupFD {
		t.Errorf("SysProcAttr %+v grants more than it should", sp)
	}
}

// The zygote runs the code as `python3 PATH` would. Here both run under the
// host's python3 and must print the same and end the same; the guest's
// python3 is the image's.
func TestZygoteAsPython3(t *testing.T) {
	py := hostPython(t)
	dir := t.TempDir()
	zygote := filepath.Join(dir, "zygote.py")
	if err := os.WriteFile(zygote, []byte(zygoteSource), 0o444); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ name, code string }{
		{"output", "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.stdout.write('no newline')\n"},
		{"its view of itself", `import sys, json, __main__
print(__name__, __file__, __cached__, __spec__, __package__, __doc__)
print(sorted(globals()))
print(type(__builtins__).__name__, __builtins__ is __import__('builtins'))
print(sys.argv, sys.orig_argv[1:], sys.path[0])
print(__main__.__dict__ is globals(), sys.modules['__main__'] is __main__)
print(type(__loader__).__name__, __loader__.name, __loader__.path)
print(__annotations__)
`},
		{"annotations", "x: int = 1\ny: 'str'\nprint(__annotations__)\n"},
		{"the code's own source", "import inspect\ndef f():\n    return 1\nprint(inspect.getsource(f), end='')\n"},
		{"a class pickled from __main__", "import pickle\nclass C:\n    x = 3\nprint(pickle.loads(pickle.dumps(C())).x, C.__module__)\n"},
		{"a warning", "import warnings\nwarnings.warn('careful')\n"},
		{"the zygote's pipes are closed", "import os\nfor fd in 3, 4:\n    try:\n        os.fstat(fd)\n    except OSError as e:\n        print(e.errno)\n"},
		{"no code", ""},
		{"an uncaught exception", "def f():\n    raise KeyError('deep')\nf()\n"},
		{"a chained exception", "try:\n    1/0\nexcept Exception as e:\n    raise ValueError('x') from e\n"},
		{"an exception while handling one", "try:\n    {}['k']\nexcept KeyError:\n    None.x\n"},
		{"an exception group", "raise ExceptionGroup('g', [ValueError(1), TypeError(2)])\n"},
		{"a hook of the code's own", "import sys\nsys.excepthook = lambda t, v, tb: print('hook', t.__name__, tb.tb_frame.f_code.co_filename == __file__)\nraise OSError\n"},
		{"at exit", "import atexit\natexit.register(print, 'bye')\nraise RuntimeError\n"},
		{"a thread outliving the code", "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.05), print('late'))).start()\nprint('early')\n"},
		{"a syntax error", "print(1)\ndef (:\n"},
		{"an indentation error", "if True:\nprint(1)\n"},
		{"a NUL byte", "print(1)\n\x00\n"},
		{"a NUL byte on the first line", "x = '\x00'\n"},
		{"a coding declaration", "# -*- coding: latin-1 -*-\nprint('\xe9')\n"},
		{"exit 0", "import sys\nprint('a')\nsys.exit()\nprint('b')\n"},
		{"exit 3", "import sys\nsys.exit(3)\n"},
		{"exit with a message", "import sys\nsys.exit('bye')\n"},
		{"exit 256+7", "raise SystemExit(263)\n"},
		{"exit True", "raise SystemExit(True)\n"},
		{"exit from a function", "import sys\ndef f():\n    sys.exit(4)\nf()\n"},
		{"os._exit", "import os\nprint('lost in the buffer')\nos._exit(5)\n"},
		{"a KeyboardInterrupt", "print('a')\nraise KeyboardInterrupt\n"},
		{"a KeyboardInterrupt two frames deep", "import atexit\natexit.register(print, 'bye')\ndef f():\n    raise KeyboardInterrupt('x')\nf()\n"},
		{"a subclass of KeyboardInterrupt", "class K(KeyboardInterrupt):\n    pass\nraise K\n"},
		{"killed by a signal", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code := filepath.Join(dir, "main.py")
			if err := os.WriteFile(code, []byte(tt.code), 0o444); err != nil {
				t.Fatal(err)
			}
			want := runPython(t, exec.Command(py, code), "")
			got := runPython(t, exec.Command(py, zygote), code)
			if got != want {
				t.Errorf("the zygote: %s\npython3:    %s", got, want)
			}
		})
	}

	// Code that is not UTF-8 and declares no encoding: the same end, a
	// SyntaxError in other words (see zygoteSource).
	code := filepath.Join(dir, "main.py")
	if err := os.WriteFile(code, []byte("print('\xff')\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	want := runPython(t, exec.Command(py, code), "")
	got := runPython(t, exec.Command(py, zygote), code)
	if got.exit != want.exit || got.stdout != want.stdout || !strings.Contains(got.stderr, "SyntaxError: ") ||
		!strings.Contains(got.stderr, "utf-8") || strings.Contains(got.stderr, "zygote") {
		t.Errorf("code not UTF-8: the zygote: %s\npython3: %s", got, want)
	}
}

// hostPython returns the host's python3 binary (not a shim that wraps it).
func hostPython(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("python3", "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		t.Fatalf("python3, which moat runs the code with, is not on this host: %v", err)
	}
	return strings.TrimSpace(string(out))
}

type pyRun struct {
	stdout, stderr string
	exit           string
}

func (r pyRun) String() string {
	return fmt.Sprintf("%s, stdout %q, stderr %q", r.exit, r.stdout, r.stderr)
}

// runPython runs cmd, handing it path on descriptor 3 when path is set (as
// the agent hands the zygote its code), and says how it ended.
func runPython(t *testing.T, cmd *exec.Cmd, path string) pyRun {
	t.Helper()
	cmd.Dir = filepath.Dir(cmd.Args[1])
	cmd.Env = []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8", "PYTHONHASHSEED=0"}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	var start *os.File
	if path != "" {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		// Descriptor 4, which the zygote closes once it is ready.
		_, ready, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer ready.Close()
		cmd.ExtraFiles = []*os.File{r, ready}
		start = w
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if start != nil {
		start.WriteString("run\x00" + path)
		start.Close()
	}
	cmd.Wait()
	ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
	exit := fmt.Sprintf("exit %d", ws.ExitStatus())
	if ws.Signaled() {
		exit = "killed by " + ws.Signal().String()
	}
	return pyRun{stdout.String(), stderr.String(), exit}
}
