package sandboxtest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	tests := []struct {
		stat      string
		ppid      int
		state     string
		wantError bool
	}{
		{stat: "123 (bash) S 1 123 123 0 -1 4194304", ppid: 1, state: "S"},
		{stat: "42 (a) b (c)) Z 7 0 0 0", ppid: 7, state: "Z"}, // a command name with parentheses and spaces
		{stat: "9 (python3 -c) R 4000000 9 9", ppid: 4000000, state: "R"},
		{stat: "9 bash S 1", wantError: true},
		{stat: "9 (bash) S", wantError: true},
		{stat: "9 (bash) S x", wantError: true},
	}
	for _, tt := range tests {
		ppid, state, err := parseStat([]byte(tt.stat))
		if tt.wantError {
			if err == nil {
				t.Errorf("parseStat(%q) = %d, %q, nil; want an error", tt.stat, ppid, state)
			}
			continue
		}
		if err != nil || ppid != tt.ppid || state != tt.state {
			t.Errorf("parseStat(%q) = %d, %q, %v; want %d, %q", tt.stat, ppid, state, err, tt.ppid, tt.state)
		}
	}
}

// fakeProc writes a /proc-like tree: for each pid, a stat file (unless stat
// is empty, as for a process that ended mid-scan) and a cmdline.
func fakeProc(t *testing.T, procs map[string][2]string) string {
	t.Helper()
	root := t.TempDir()
	for pid, files := range procs {
		dir := filepath.Join(root, pid)
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if files[0] != "" {
			if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(files[0]), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, "cmdline"), []byte(files[1]), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestProcessesFakeProc(t *testing.T) {
	root := fakeProc(t, map[string][2]string{
		"10":   {"10 (python3) S 1 10 10", "python3\x00-c\x00import time\x00MARK42\x00"},
		"11":   {"11 (python3) Z 10 10 10", ""}, // a zombie: no command line
		"12":   {"", "python3\x00MARK42\x00"},   // ended while being read
		"13":   {"13 (sleep) S 10 10 10", "sleep\x0030\x00"},
		"self": {"10 (python3) S 1 10 10", "MARK42"}, // not a pid
	})
	got, err := processesWith(root, "MARK42")
	if err != nil {
		t.Fatal(err)
	}
	want := []process{{PID: 10, PPID: 1, State: "S", Cmdline: "python3 -c import time MARK42"}}
	if !slices.Equal(got, want) {
		t.Errorf("processesWith(MARK42) = %v, want %v", got, want)
	}
	kids, err := childrenOf(root, 10)
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(kids, func(a, b process) int { return a.PID - b.PID })
	if len(kids) != 2 || kids[0].PID != 11 || kids[0].State != "Z" || kids[1].PID != 13 {
		t.Errorf("childrenOf(10) = %v, want the zombie 11 and 13", kids)
	}
	if _, err := processesWith(filepath.Join(root, "absent"), "x"); err == nil {
		t.Error("processesWith on a missing root returned no error")
	}
}

// startMarked starts a shell that waits, without starting any process of
// its own, with marker in its command line, as a child of the test process.
func startMarked(t *testing.T, marker string) *exec.Cmd {
	t.Helper()
	// The builtin read blocks on a pipe the test keeps open.
	cmd := exec.Command("sh", "-c", "read x", marker)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = stdin.Close()
	})
	return cmd
}

func TestProcessesRealProc(t *testing.T) {
	marker := token("moatunit")
	cmd := startMarked(t, marker)
	pid := cmd.Process.Pid

	ps, err := processesWith(procRoot, marker)
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 1 || ps[0].PID != pid || ps[0].PPID != os.Getpid() || !strings.Contains(ps[0].Cmdline, "read x") {
		t.Errorf("processesWith(marker) = %v, want only pid %d, child of %d", ps, pid, os.Getpid())
	}
	kids, err := childrenOf(procRoot, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(kids, func(p process) bool { return p.PID == pid }) {
		t.Errorf("childrenOf(self) = %v, want it to hold %d", kids, pid)
	}

	// Killed but not waited for: a zombie child, without its command line.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	zombie := eventually(2*time.Second, func() []string {
		kids, _ := childrenOf(procRoot, os.Getpid())
		for _, p := range kids {
			if p.PID == pid && p.State == "Z" {
				return nil
			}
		}
		return []string{"not yet"}
	})
	if len(zombie) > 0 {
		t.Errorf("a killed, unwaited child of the test process is not seen as a zombie")
	}
	if left := remainingWith(marker, 100*time.Millisecond); len(left) > 0 {
		t.Errorf("remainingWith after the kill = %v, want none (a zombie has no command line)", left)
	}
	_ = cmd.Wait()
	kids, _ = childrenOf(procRoot, os.Getpid())
	if slices.ContainsFunc(kids, func(p process) bool { return p.PID == pid }) {
		t.Errorf("childrenOf(self) still holds %d after Wait: %v", pid, kids)
	}
}

func TestChildrenLeft(t *testing.T) {
	marker := token("moatkids")
	cmd := startMarked(t, marker)
	left := ChildrenLeft(0)
	if !slices.ContainsFunc(left, func(s string) bool { return strings.Contains(s, marker) }) {
		t.Errorf("ChildrenLeft with a live child = %q, want it listed", left)
	}
	if code := CheckNoChildren(0, 0); code != 1 {
		t.Errorf("CheckNoChildren(0) with a live child = %d, want 1", code)
	}
	if code := CheckNoChildren(3, 0); code != 3 {
		t.Errorf("CheckNoChildren(3) = %d, want the tests' own code", code)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	// Killed, not yet waited for: a zombie, which is not counted.
	if left := ChildrenLeft(2 * time.Second); slices.ContainsFunc(left, func(s string) bool { return strings.Contains(s, fmt.Sprintf("pid %d ", cmd.Process.Pid)) }) {
		t.Errorf("ChildrenLeft after the kill = %q, want the child gone", left)
	}
}

func TestRemainingWithKills(t *testing.T) {
	marker := token("moatunit")
	cmd := startMarked(t, marker)
	left := remainingWith(marker, 100*time.Millisecond)
	if len(left) != 1 || !strings.Contains(left[0], marker) {
		t.Fatalf("remainingWith = %v, want the one waiting shell", left)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("the shell exited cleanly, want it killed")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("remainingWith did not kill the process it reported")
	}
}

func TestFindFiles(t *testing.T) {
	root := t.TempDir()
	marker := token("moatunit")
	mk := func(rel string) string {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	shallow := mk(marker)
	deep := mk(filepath.Join("a", "b", "c", "run-"+marker+"-1"))
	mk(filepath.Join("a", "b", "c", "d", "e", "f", "g", marker)) // below maxDepth
	mk(filepath.Join("a", "other"))
	other := t.TempDir()
	if err := os.Symlink(other, filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(other, marker), nil, 0o644); err != nil { // reachable only through the link
		t.Fatal(err)
	}

	found, truncated := findFiles([]string{root, filepath.Join(root, "absent")}, marker, 4, 1000)
	slices.Sort(found)
	want := []string{shallow, deep}
	slices.Sort(want)
	if !slices.Equal(found, want) || truncated {
		t.Errorf("findFiles = %v, %v; want %v, false", found, truncated, want)
	}
	if _, truncated := findFiles([]string{root}, marker, 4, 3); !truncated {
		t.Error("findFiles with a budget of 3 entries did not say it stopped early")
	}
}

func TestFilesLeft(t *testing.T) {
	marker := token("moatunit")
	inTemp := filepath.Join(os.TempDir(), marker+".txt")
	if err := os.WriteFile(inTemp, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(inTemp) })
	elsewhere := filepath.Join(t.TempDir(), "named-"+marker)
	if err := os.WriteFile(elsewhere, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	extra := t.TempDir()
	inExtra := filepath.Join(extra, "x", marker)
	if err := os.MkdirAll(inExtra, 0o755); err != nil {
		t.Fatal(err)
	}

	got := filesLeft(t, []string{extra}, marker, elsewhere, filepath.Join(extra, "absent"))
	slices.Sort(got)
	want := []string{inTemp, elsewhere, inExtra}
	slices.Sort(want)
	// t.TempDir lives under os.TempDir, so the search may find elsewhere
	// too; it must be listed once.
	if !slices.Equal(got, want) {
		t.Errorf("filesLeft = %v, want %v", got, want)
	}
	for _, p := range want {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("filesLeft did not remove %s", p)
		}
	}
	if again := filesLeft(t, []string{extra}, marker); len(again) != 0 {
		t.Errorf("filesLeft after removal = %v, want none", again)
	}
}

func TestParseGoroutines(t *testing.T) {
	dump := `goroutine 7 [running]:
main.main()
	/x/main.go:10 +0x1d

goroutine 18 [chan receive, 2 minutes]:
os/signal.loop()
	/usr/local/go/src/os/signal/signal_unix.go:23 +0x13
created by os/signal.Notify.func1.1 in goroutine 1

not a goroutine

goroutine x [running]:
`
	gs := parseGoroutines([]byte(dump))
	if len(gs) != 2 || gs[0].ID != 7 || gs[1].ID != 18 || !strings.Contains(gs[1].Stack, "os/signal.loop") {
		t.Fatalf("parseGoroutines = %+v, want goroutines 7 and 18", gs)
	}
	if leaked := leakedGoroutines(map[int64]bool{}, gs); len(leaked) != 1 || leaked[0].ID != 7 {
		t.Errorf("leakedGoroutines with nothing before = %+v, want 7 only (18 is signal's, permanent)", leaked)
	}
	if leaked := leakedGoroutines(map[int64]bool{7: true}, gs); len(leaked) != 0 {
		t.Errorf("leakedGoroutines with 7 before = %+v, want none", leaked)
	}
}

func TestLeakedGoroutinesLive(t *testing.T) {
	before := goroutineIDs()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { <-stop })
	leaked := eventually(2*time.Second, func() []string {
		for _, g := range leakedGoroutines(before, allGoroutines()) {
			if strings.Contains(g.Stack, "TestLeakedGoroutinesLive") {
				return nil
			}
		}
		return []string{"not seen"}
	})
	if len(leaked) > 0 {
		t.Error("a goroutine started after the snapshot is not reported")
	}
	close(stop)
	wg.Wait()
	// Done runs before the goroutine has quite gone (it may still be in
	// goexit): it is reported until the runtime drops it.
	if left := eventually(2*time.Second, func() []string {
		var ids []string
		for _, g := range leakedGoroutines(before, allGoroutines()) {
			ids = append(ids, g.Stack)
		}
		return ids
	}); len(left) > 0 {
		t.Errorf("goroutines reported after the only new one returned: %q", left)
	}
}

func TestStream(t *testing.T) {
	var fired []string
	w := &stream{on: map[string]func(){
		"ready": func() { fired = append(fired, "ready") },
		"done":  func() { fired = append(fired, "done") },
	}}
	for _, p := range []string{"re", "ad", "y\nready again\n", "do", "ne"} {
		if n, err := w.Write([]byte(p)); n != len(p) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", p, n, err)
		}
	}
	if got := string(w.bytes()); got != "ready\nready again\ndone" {
		t.Errorf("bytes = %q", got)
	}
	if !slices.Equal(fired, []string{"ready", "done"}) {
		t.Errorf("fired %v, want each once, in order", fired)
	}
	if w.overlaps.Load() != 0 {
		t.Errorf("overlaps = %d after sequential writes", w.overlaps.Load())
	}

	// Writes from many goroutines at once must be noticed.
	slow := &stream{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 2000 {
				_, _ = slow.Write(bytes.Repeat([]byte("x"), 512))
			}
		})
	}
	wg.Wait()
	if slow.overlaps.Load() == 0 {
		t.Error("concurrent writes were not noticed")
	}
}

func TestSplitHidesMarker(t *testing.T) {
	for _, s := range []string{"memory-allocated", "ab", "abc"} {
		expr := split(s)
		if strings.Contains(expr, s) {
			t.Errorf("split(%q) = %s, which holds the marker", s, expr)
		}
		out, err := exec.Command("python3", "-c", "import sys; sys.stdout.write("+expr+")").Output()
		if err != nil || string(out) != s {
			t.Errorf("python3 evaluates split(%q) = %s to %q, %v; want %q", s, expr, out, err, s)
		}
	}
}

func TestEnvAllowed(t *testing.T) {
	for name, want := range map[string]bool{
		"PATH": true, "HOME": true, "LC_CTYPE": true, "PYTHONHASHSEED": true,
		"MOAT_TEST_CANARY": false, "ANTHROPIC_API_KEY": false, "LD_PRELOAD": false, "path": false,
	} {
		if got := envAllowed(name); got != want {
			t.Errorf("envAllowed(%q) = %v, want %v", name, got, want)
		}
	}
}
