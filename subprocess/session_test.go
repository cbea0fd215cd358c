package subprocess_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

func newSession(t *testing.T, l moat.Limits, opts moat.SessionOptions) (*subprocess.Sandbox, *subprocess.Session) {
	t.Helper()
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{Limits: l})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	s, err := sb.NewSession(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	ss := s.(*subprocess.Session)
	t.Cleanup(func() {
		ss.Close()
		if _, err := os.Stat(ss.Dir()); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("session directory %s still there after Close: %v", ss.Dir(), err)
		}
	})
	return sb, ss
}

func srun(t *testing.T, s moat.Session, code string) *moat.Result {
	t.Helper()
	res, err := s.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("Run(%q): %v", code, err)
	}
	return res
}

func out(res *moat.Result) string { return strings.TrimSpace(string(res.Stdout)) }

func writeString(t *testing.T, s moat.Session, name, data string) {
	t.Helper()
	if err := s.WriteFile(context.Background(), name, strings.NewReader(data)); err != nil {
		t.Fatalf("WriteFile(%q): %v", name, err)
	}
}

func readString(s moat.Session, name string) (string, error) {
	rc, err := s.ReadFile(context.Background(), name)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	return string(b), err
}

func TestSessionFilesPersist(t *testing.T) {
	for _, interp := range []bool{false, true} {
		t.Run("interpreter="+strconv.FormatBool(interp), func(t *testing.T) {
			_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: interp})
			if !sessionDirName.MatchString(filepath.Base(s.Dir())) {
				t.Errorf("session dir %s is not named <owner id>-s<id>, which the reaper recognizes", s.Dir())
			}
			res := srun(t, s, "open('a.txt','w').write('from run 1')\nimport os; os.makedirs('d/e'); open('d/e/f','w').write('deep')")
			if res.ExitCode != 0 {
				t.Fatalf("run 1: %+v %s", res, res.Stderr)
			}
			res = srun(t, s, "import os; print(open('a.txt').read(), os.getcwd() == os.environ['HOME'])")
			if got := out(res); got != "from run 1 True" {
				t.Errorf("run 2 saw %q (stderr %s)", got, res.Stderr)
			}
			if got, err := readString(s, "d/e/f"); err != nil || got != "deep" {
				t.Errorf("ReadFile(d/e/f) = %q, %v", got, err)
			}
			writeString(t, s, "up/load.txt", "from host")
			res = srun(t, s, "import os; print(open('up/load.txt').read()); open('up/load.txt','a').write('+code'); print(os.stat('up').st_uid == os.getuid())")
			if got := out(res); got != "from host\nTrue" {
				t.Errorf("the code saw the upload as %q (stderr %s)", got, res.Stderr)
			}
			if got, _ := readString(s, "up/load.txt"); got != "from host+code" {
				t.Errorf("after the code appended: %q", got)
			}
			files, err := s.ListFiles(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			names := map[string]bool{}
			for _, f := range files {
				names[f.Name] = true
				if strings.HasPrefix(path(f.Name), ".moat-") {
					t.Errorf("moat's own file %s listed", f.Name)
				}
			}
			for _, want := range []string{"a.txt", "d", "d/e", "d/e/f", "up", "up/load.txt"} {
				if !names[want] {
					t.Errorf("ListFiles lacks %s: %v", want, files)
				}
			}
			if err := s.RemoveFile(context.Background(), "a.txt"); err != nil {
				t.Fatal(err)
			}
			if _, err := readString(s, "a.txt"); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("after RemoveFile, ReadFile = %v, want not exist", err)
			}
			if err := s.RemoveFile(context.Background(), "d"); err == nil {
				t.Error("RemoveFile removed a directory that is not empty")
			}
		})
	}
}

func path(name string) string { return filepath.Base(name) }

var sessionDirName = regexp.MustCompile(`^[0-9a-f]{16}-s[0-9a-f]+$`)

// TestSessionTraversal checks that names and links cannot lead the host side
// outside the session, whatever the code planted.
func TestSessionTraversal(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{})
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, []byte("host secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	// The code runs under Landlock and cannot see outside, but it can
	// still plant links that point there; and a FIFO.
	res := srun(t, s, "import os\n"+
		"os.symlink("+strconv.Quote(outside)+", 'out')\n"+
		"os.symlink("+strconv.Quote(secret)+", 'sec')\n"+
		"os.symlink('/etc', 'etc')\n"+
		"os.symlink('../../..', 'up')\n"+
		"os.mkfifo('fifo')\n"+
		"os.mkdir('in'); open('in/ok','w').write('ok'); os.symlink('in/ok', 'inlink')\n")
	if res.ExitCode != 0 {
		t.Fatalf("planting: %s", res.Stderr)
	}
	ctx := context.Background()
	bad := []string{"", ".", "..", "../x", "/etc/passwd", "a/../../x", "a//b", "./a", "out/secret", "sec", "etc/passwd", "up/etc/passwd", "fifo", "in", "x\x00y"}
	for _, name := range bad {
		if _, err := s.ReadFile(ctx, name); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("ReadFile(%q) = %v, want ErrInvalid", name, err)
		}
	}
	for _, name := range []string{"", "..", "../x", "/tmp/x", "out/new", "out/secret", "etc/moat-evil", "up/tmp/moat-evil"} {
		if err := s.WriteFile(ctx, name, strings.NewReader("evil")); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("WriteFile(%q) = %v, want ErrInvalid", name, err)
		}
	}
	for _, name := range []string{"..", "/etc/passwd", "out/secret"} {
		if err := s.RemoveFile(ctx, name); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("RemoveFile(%q) = %v, want ErrInvalid", name, err)
		}
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "host secret" {
		t.Errorf("the host's file changed: %q, %v", b, err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 1 {
		t.Errorf("something was written outside the session: %v", entries)
	}
	for _, p := range []string{"/etc/moat-evil", "/tmp/moat-evil"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s was created", p)
			os.Remove(p)
		}
	}
	// A link inside the session is fine; replacing a link replaces the
	// link, never its target.
	if got, err := readString(s, "inlink"); err != nil || got != "ok" {
		t.Errorf("ReadFile(inlink) = %q, %v", got, err)
	}
	writeString(t, s, "sec", "replaced")
	if b, _ := os.ReadFile(secret); string(b) != "host secret" {
		t.Errorf("writing over a planted link wrote its target: %q", b)
	}
	if err := s.RemoveFile(ctx, "etc"); err != nil {
		t.Errorf("removing the planted link: %v", err)
	}
	if _, err := os.Stat("/etc/passwd"); err != nil {
		t.Errorf("/etc/passwd: %v", err)
	}
}

func TestSessionDiskLimit(t *testing.T) {
	_, s := newSession(t, moat.Limits{Disk: 2 * moat.MiB, FileSize: moat.MiB}, moat.SessionOptions{})
	ctx := context.Background()
	big := bytes.Repeat([]byte("x"), int(moat.MiB)+1)
	if err := s.WriteFile(ctx, "big", bytes.NewReader(big)); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("a file over the file size limit: %v, want ErrInvalid", err)
	}
	chunk := bytes.Repeat([]byte("y"), int(moat.MiB)-64*1024)
	var err error
	n := 0
	for ; n < 4 && err == nil; n++ {
		err = s.WriteFile(ctx, "f"+strconv.Itoa(n), bytes.NewReader(chunk))
	}
	if !errors.Is(err, moat.ErrInvalid) || n < 2 {
		t.Fatalf("after %d files: %v, want ErrInvalid from the disk limit", n, err)
	}
	files, _ := s.ListFiles(ctx)
	for _, f := range files {
		if f.Name == "big" || f.Name == "f"+strconv.Itoa(n-1) || strings.HasPrefix(f.Name, ".moat") {
			t.Errorf("a refused write left %s", f.Name)
		}
	}
	// The code sees the same limit.
	res := srun(t, s, "open('more','wb').write(b'z'*(1<<20))")
	if res.Reason != moat.ReasonDisk && res.Reason != moat.ReasonFileSize {
		t.Errorf("writing past the disk limit: reason %q, stderr %s", res.Reason, res.Stderr)
	}
}

func TestSessionsAreSeparate(t *testing.T) {
	sb, a := newSession(t, moat.Limits{}, moat.SessionOptions{})
	b, err := sb.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	writeString(t, a, "mine", "a's")
	res := srun(t, b, "import os\ntry:\n  print(os.listdir("+strconv.Quote(a.Dir())+"))\nexcept OSError as e: print('denied')\nprint(os.path.exists('mine'))")
	if got := out(res); got != "denied\nFalse" {
		t.Errorf("session b saw a's files: %q %s", got, res.Stderr)
	}
}

func TestInterpreterKeepsState(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: true})
	srun(t, s, "x = 41\ndef f(): return x + 1\nimport json")
	if res := srun(t, s, "print(f(), json.dumps([x]))"); out(res) != "42 [41]" {
		t.Errorf("state lost: %q %s", res.Stdout, res.Stderr)
	}
	res := srun(t, s, "y = 1\nraise ValueError('bad')")
	if res.ExitCode != 1 || !strings.Contains(string(res.Stderr), "ValueError: bad") || !strings.Contains(string(res.Stderr), "raise ValueError") {
		t.Errorf("exception: exit %d stderr %q", res.ExitCode, res.Stderr)
	}
	if strings.Contains(string(res.Stderr), "_moat_driver") {
		t.Errorf("the traceback shows the driver: %s", res.Stderr)
	}
	if res := srun(t, s, "import sys; print(y); sys.exit(3)"); res.ExitCode != 3 || out(res) != "1" {
		t.Errorf("sys.exit(3): exit %d out %q", res.ExitCode, res.Stdout)
	}
	if res := srun(t, s, "print(x"); res.ExitCode != 1 || !strings.Contains(string(res.Stderr), "SyntaxError") {
		t.Errorf("syntax error: exit %d stderr %q", res.ExitCode, res.Stderr)
	}
	// Output written below Python's streams, by children too, is the run's.
	res = srun(t, s, "import os, sys; os.write(1, b'fd1\\n'); os.system('echo child; echo err >&2'); sys.stderr.write('py2\\n')")
	if out(res) != "fd1\nchild" || !strings.Contains(string(res.Stderr), "err") || !strings.Contains(string(res.Stderr), "py2") {
		t.Errorf("fd-level output: stdout %q stderr %q", res.Stdout, res.Stderr)
	}
	if res := srun(t, s, "print(x)"); out(res) != "41" {
		t.Errorf("state lost after a system() call: %q %s", res.Stdout, res.Stderr)
	}
	// The driver's control channel is not the code's stdin.
	if res := srun(t, s, "import sys; print(repr(sys.stdin.read()))"); out(res) != "''" {
		t.Errorf("stdin: %q %s", res.Stdout, res.Stderr)
	}
}

func TestInterpreterTimeoutStartsAfresh(t *testing.T) {
	_, s := newSession(t, moat.Limits{WallTime: moat.Duration(time.Second)}, moat.SessionOptions{Interpreter: true})
	srun(t, s, "x = 1\nopen('kept','w').write('yes')")
	res := srun(t, s, "import subprocess; subprocess.Popen(['sleep','100']); print('looping', flush=True)\nwhile True: pass")
	if res.Reason != moat.ReasonTimeout || out(res) != "looping" {
		t.Errorf("loop: reason %q out %q", res.Reason, res.Stdout)
	}
	res = srun(t, s, "print('x' in globals(), open('kept').read())")
	if out(res) != "False yes" {
		t.Errorf("after the timeout: %q %s (want a fresh interpreter with the files kept)", res.Stdout, res.Stderr)
	}
	// os._exit ends the interpreter too: its status is the run's.
	if res := srun(t, s, "import os; os._exit(7)"); res.ExitCode != 7 {
		t.Errorf("os._exit(7): exit %d", res.ExitCode)
	}
	if res := srun(t, s, "print(2)"); out(res) != "2" {
		t.Errorf("after os._exit: %q %s", res.Stdout, res.Stderr)
	}
}

// TestInterpreterFrozenBetweenRuns checks that what the code leaves running
// is stopped while no run is going on.
func TestInterpreterFrozenBetweenRuns(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: true})
	res := srun(t, s, "import threading, subprocess, os\n"+
		"def spin():\n  while True: pass\n"+
		"threading.Thread(target=spin, daemon=True).start()\n"+
		"subprocess.Popen(['sleep', '100'])\n"+
		"print(os.getuid())")
	uid, err := strconv.Atoi(out(res))
	if err != nil {
		t.Fatalf("uid: %q %s", res.Stdout, res.Stderr)
	}
	procs := processesOf(uid)
	if len(procs) < 2 {
		t.Fatalf("want the interpreter and sleep, found %v", procs)
	}
	for pid, state := range procs {
		if state != "T" {
			t.Errorf("process %s is in state %s between runs, want T (stopped)", pid, state)
		}
	}
	// It resumes for the next run.
	if res := srun(t, s, "import threading; print(threading.active_count())"); out(res) != "2" {
		t.Errorf("after resuming: %q %s", res.Stdout, res.Stderr)
	}
	s.Close()
	if procs := processesOf(uid); len(procs) != 0 {
		t.Errorf("processes left after Close: %v", procs)
	}
}

// processesOf returns the state of every thread of every process of uid.
func processesOf(uid int) map[string]string {
	out := map[string]string{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		tasks, _ := os.ReadDir("/proc/" + e.Name() + "/task")
		for _, task := range tasks {
			status, err := os.ReadFile("/proc/" + e.Name() + "/task/" + task.Name() + "/status")
			if err != nil {
				continue
			}
			var state string
			owner := -1
			for _, line := range strings.Split(string(status), "\n") {
				if f := strings.Fields(line); len(f) >= 2 {
					switch f[0] {
					case "State:":
						state = f[1]
					case "Uid:":
						owner, _ = strconv.Atoi(f[1])
					}
				}
			}
			if owner == uid && state != "Z" {
				out[e.Name()+"/"+task.Name()] = state
			}
		}
	}
	return out
}

func TestInterpreterStreamsAndCancels(t *testing.T) {
	_, s := newSession(t, moat.Limits{WallTime: moat.Duration(20 * time.Second)}, moat.SessionOptions{Interpreter: true})
	srun(t, s, "v = 'kept'")
	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var res *moat.Result
	var err error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		res, err = s.Run(ctx, moat.Request{Code: []byte("import time\nprint('first', flush=True)\ntime.sleep(60)"), Stdout: pw})
		pw.Close()
	}()
	buf := make([]byte, 6)
	if _, rerr := io.ReadFull(pr, buf); rerr != nil || string(buf) != "first\n" {
		t.Fatalf("streamed %q, %v", buf, rerr)
	}
	cancel()
	go io.Copy(io.Discard, pr)
	wg.Wait()
	if err != nil || res.Reason != moat.ReasonCanceled {
		t.Fatalf("cancelled run: %+v, %v", res, err)
	}
	if res := srun(t, s, "print('v' in globals())"); out(res) != "False" {
		t.Errorf("after a cancelled run: %q", res.Stdout)
	}
}

func TestSessionClose(t *testing.T) {
	sb, s := newSession(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)}, moat.SessionOptions{})
	done := make(chan error, 1)
	go func() {
		_, err := s.Run(context.Background(), moat.Request{Code: []byte("import time; time.sleep(60)")})
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end the run")
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := s.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("Run after Close: %v", err)
	}
	if err := s.WriteFile(context.Background(), "x", strings.NewReader("")); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("WriteFile after Close: %v", err)
	}
	if _, err := os.Stat(s.Dir()); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("session directory left behind: %v", err)
	}
	_ = sb
}

// TestSessionFileAtLimitIsOnlyItsRunsReason: a file that reached the size
// limit in one run is that run's reason, not every later run's.
func TestSessionFileAtLimitIsOnlyItsRunsReason(t *testing.T) {
	_, s := newSession(t, moat.Limits{FileSize: moat.MiB}, moat.SessionOptions{})
	res := srun(t, s, "try:\n  open('big','wb').write(b'x' * (2 << 20))\nexcept OSError as e: print(e.errno)")
	if res.Reason != moat.ReasonFileSize {
		t.Fatalf("first run: reason %q, want filesize", res.Reason)
	}
	res = srun(t, s, "import os; print(os.path.getsize('big'))")
	if res.Reason != "" || out(res) != "1048576" {
		t.Errorf("second run: reason %q, stdout %q; want no reason and the 1 MiB file still there", res.Reason, out(res))
	}
}

// countingWriter counts what a Request writer receives.
type countingWriter struct {
	mu sync.Mutex
	n  int
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.n += len(p)
	return len(p), nil
}

// TestInterpreterOutputCapEndsTheRun checks that a live interpreter's run is
// held to the output cap like a one-shot run: the writer gets at most the cap,
// the run ends for it long before its wall time, and the next run starts a
// fresh interpreter, with the files still there.
func TestInterpreterOutputCapEndsTheRun(t *testing.T) {
	limit, wall := moat.KiB, 10*time.Second
	_, s := newSession(t, moat.Limits{Output: limit, WallTime: moat.Duration(wall)}, moat.SessionOptions{Interpreter: true})
	srun(t, s, "x = 1\nopen('kept','w').write('yes')")
	for _, code := range []string{
		"while True: print('x' * 1000)",
		// Past the cap, then the code ends by itself: the run is still
		// ended for its output, and the interpreter with it.
		"import sys\nsys.stdout.write('y' * 4096)",
	} {
		w := &countingWriter{}
		start := time.Now()
		res, err := s.Run(context.Background(), moat.Request{Code: []byte(code), Stdout: w})
		elapsed := time.Since(start)
		if err != nil {
			t.Fatalf("Run(%q): %v", code, err)
		}
		if res.Reason != moat.ReasonOutput || !res.Truncated || res.ExitCode != 137 || res.Signal != "SIGKILL" {
			t.Errorf("%q under a %v output limit: reason %q truncated %v exit %d signal %q; want output, true, 137, SIGKILL",
				code, limit, res.Reason, res.Truncated, res.ExitCode, res.Signal)
		}
		w.mu.Lock()
		n := w.n
		w.mu.Unlock()
		if n > int(limit) || n != len(res.Stdout) {
			t.Errorf("%q: the writer received %d bytes, Result.Stdout %d; want the same, at most %d", code, n, len(res.Stdout), int64(limit))
		}
		if ratio := float64(elapsed) / float64(wall); ratio >= 0.5 {
			t.Errorf("%q: Run took %v, %.2f of the %v wall time; want under 0.5", code, elapsed, ratio, wall)
		}
		if res := srun(t, s, "print('x' in globals(), open('kept').read())"); out(res) != "False yes" || res.Reason != "" {
			t.Errorf("after %q: %q %s reason %q (want a fresh interpreter with the files kept)", code, res.Stdout, res.Stderr, res.Reason)
		}
		srun(t, s, "x = 1")
	}
}
