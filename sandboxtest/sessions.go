package sandboxtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// SessionsOptions tune [TestSessions] for one level. The zero value runs
// every check.
type SessionsOptions struct {
	// NoInterpreter says the level keeps no live interpreter. Its
	// NewSession must then refuse SessionOptions.Interpreter with an error
	// wrapping moat.ErrUnavailable (never run a fresh interpreter per run in
	// its place), and the checks of the interpreter are not run. Without
	// it, a NewSession that refuses an interpreter fails the suite.
	NoInterpreter bool

	// Leftovers, when set, is the level's own check that nothing of a
	// session outlived it on the host (containers with moat's labels, VMs,
	// cgroups, directories). The suite calls it after each subtest, once
	// every session and sandbox of the subtest is closed, retrying for a
	// few seconds while it returns an error, and fails the subtest with the
	// last one.
	Leftovers func(t *testing.T) error

	// Dirs lists host directories, besides the usual ones, where the level
	// keeps the files of sessions; see Options.Dirs.
	Dirs []string

	// InterpreterFIFOsUnseen says that, in a session with a live
	// interpreter, a named pipe the code makes lives in the instance's
	// kernel only and is no file of the session (the gvisor level's
	// host-backed working directory: its sentry does not make pipes on the
	// host). The file operations must then say it does not exist, at once,
	// instead of describing it and refusing to read it.
	InterpreterFIFOsUnseen bool
}

// TestSessions is the conformance suite of sessions ([moat.Sessioner]), as
// [Run] is of runs: a level calls it with the factory it gives Run,
//
//	func TestSessions(t *testing.T) {
//		sandboxtest.TestSessions(t, newSandbox, sandboxtest.SessionsOptions{})
//	}
//
// and every sandbox the factory builds must implement moat.Sessioner. The
// factory gets the limits a check needs (small ones: a wall time of a few
// seconds, a disk of a few MiB), because a session gets the sandbox's.
//
// Each check runs twice, under "Plain/" (a fresh interpreter per run) and
// "Interpreter/" (SessionOptions.Interpreter), and is a subtest of its own:
//
//   - Files/Persist: what WriteFile writes a run reads; what a run writes
//     ReadFile, Stat and ListFiles see; Mkdir, Rename and RemoveFile act on
//     what the next run sees; ListFiles lists exactly the session's files.
//   - Files/Refused: "..", absolute and empty names, and the links a run
//     plants (escape -> /, pw -> /etc/passwd, tmpl -> /tmp) are refused with
//     moat.ErrInvalid by every operation, change nothing inside or outside
//     the instance, and are listed and stated as links, never followed; a
//     FIFO is refused for reading without blocking.
//   - Limits/WallTime, Limits/Output: a run past the wall time or the output
//     cap ends with its reason, and the next run of the session works and
//     sees the files.
//   - Limits/Disk: the disk limit bounds the session's files together,
//     whether WriteFile or runs wrote them: a write past it is refused and
//     leaves nothing.
//   - Frozen: a process a run leaves behind, appending to a file every
//     10 ms, does not run while no run is in progress: the file's size
//     after an idle pause is exactly its size before.
//   - Isolation: two sessions of one sandbox at once see neither each
//     other's files (by name or by absolute path) nor each other's
//     processes, those left behind and those of a run in progress.
//   - Serialized: two Runs of one session called at once run one after the
//     other.
//   - Close/LeavesNothing, Close/Twice, Close/AfterClose, Close/WhileRunning:
//     after Close no process of the session runs, no file of it is on the
//     host, the level's Leftovers reports nothing; Close may be called
//     again; Run and every file operation then fail with moat.ErrClosed; a
//     Close during a run ends it.
//   - Interpreter/Variables, Interpreter/TimeoutStartsAfresh: variables
//     survive between runs, an exception included; a timeout ends the
//     interpreter, and the next run starts a fresh one with the files kept,
//     both runs saying so in their Notes.
//
// After each subtest the suite checks the level's Leftovers and that the test
// process has no child it did not have before; at the end, that no goroutine
// is left. Like Run, it must not be called from a parallel test.
func TestSessions(t *testing.T, newSandbox Factory, opts SessionsOptions) {
	t.Helper()
	ss := &sessionSuite{opts: opts}
	ss.suite = &suite{newSandbox: newSandbox, opts: Options{Dirs: opts.Dirs}}
	if opts.Leftovers != nil {
		ss.suite.opts.Leftovers = func() []string {
			if err := opts.Leftovers(ss.current); err != nil {
				return []string{err.Error()}
			}
			return nil
		}
	}
	ss.goroutinesBefore = goroutineIDs()
	kids, err := childrenOf(procRoot, os.Getpid())
	if err != nil {
		t.Fatalf("sandboxtest: list the test process's children: %v", err)
	}
	ss.childrenBefore = make(map[int]bool)
	for _, p := range kids {
		ss.childrenBefore[p.PID] = true
	}
	for _, m := range []struct {
		name   string
		interp bool
	}{{"Plain", false}, {"Interpreter", true}} {
		t.Run(m.name, func(t *testing.T) {
			if m.interp && opts.NoInterpreter {
				ss.leaf(t, "Unavailable", func(t *testing.T) { testInterpreterUnavailable(t, ss) })
				return
			}
			for _, c := range sessionCases {
				if c.interpOnly && !m.interp {
					continue
				}
				ss.leaf(t, c.name, func(t *testing.T) { c.fn(t, ss, m.interp) })
			}
		})
	}
	t.Run("NoLeaks", ss.noLeaks)
}

// sessionSuite is the state of one TestSessions.
type sessionSuite struct {
	*suite
	opts    SessionsOptions
	current *testing.T // the leaf subtest running, for Leftovers
}

func (ss *sessionSuite) leaf(t *testing.T, name string, fn func(*testing.T)) {
	t.Helper()
	t.Run(name, func(t *testing.T) {
		ss.current = t
		t.Cleanup(func() { ss.checkNothingLeft(t) })
		fn(t)
	})
}

type sessionCase struct {
	name       string
	fn         func(t *testing.T, ss *sessionSuite, interp bool)
	interpOnly bool
}

var sessionCases = []sessionCase{
	{"Files/Persist", testSessionFilesPersist, false},
	{"Files/Refused", testSessionFilesRefused, false},
	{"Limits/WallTime", testSessionWallTime, false},
	{"Limits/Output", testSessionOutput, false},
	{"Limits/Disk", testSessionDisk, false},
	{"Frozen", testSessionFrozen, false},
	{"Isolation", testSessionIsolation, false},
	{"Serialized", testSessionSerialized, false},
	{"Close/LeavesNothing", testSessionCloseLeavesNothing, false},
	{"Close/Twice", testSessionCloseTwice, false},
	{"Close/AfterClose", testSessionAfterClose, false},
	{"Close/WhileRunning", testSessionCloseWhileRunning, false},
	{"Variables", testInterpreterVariables, true},
	{"TimeoutStartsAfresh", testInterpreterTimeout, true},
}

// session is a session under test, with the sandbox it belongs to.
type session struct {
	moat.Session
	b *box
}

// session makes a session of a new sandbox with limits; both are closed
// when t ends (the session first; each close must succeed).
func (ss *sessionSuite) session(t *testing.T, limits moat.Limits, interp bool) *session {
	t.Helper()
	return ss.sessionOf(t, ss.sandbox(t, limits), interp)
}

// sessionOf makes another session of b.
func (ss *sessionSuite) sessionOf(t *testing.T, b *box, interp bool) *session {
	t.Helper()
	sr, ok := b.Sandbox.(moat.Sessioner)
	if !ok {
		t.Fatalf("the sandbox (%T) does not implement moat.Sessioner", b.Sandbox)
	}
	s, err := sr.NewSession(context.Background(), moat.SessionOptions{Interpreter: interp})
	switch {
	case err != nil && interp && errors.Is(err, moat.ErrUnavailable):
		t.Fatalf("NewSession with a live interpreter: %v\n(a level that keeps none says so with SessionsOptions.NoInterpreter)", err)
	case err != nil:
		t.Fatalf("NewSession: %v", err)
	case s == nil:
		t.Fatal("NewSession returned a nil session and no error")
	}
	t.Cleanup(func() {
		done := make(chan error, 1)
		go func() { done <- s.Close() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("session Close: %v", err)
			}
		case <-time.After(hangGuard(b.limits) + abandon):
			t.Errorf("session Close did not return within %v; abandoned", hangGuard(b.limits)+abandon)
		}
	})
	return &session{Session: s, b: b}
}

// run runs code in the session as box.run does: under the hang guard, with
// the invariants of every Result checked.
func (s *session) run(t *testing.T, code string) *moat.Result {
	t.Helper()
	return s.runReq(t, context.Background(), moat.Request{Code: []byte(code)})
}

func (s *session) runReq(t *testing.T, ctx context.Context, req moat.Request) *moat.Result {
	t.Helper()
	res, elapsed, err := runGuarded(ctx, s.b.limits, s.Run, req)
	if err != nil {
		t.Fatalf("session Run returned an error, want a Result: %v", err)
	}
	for _, p := range s.b.problems(res, elapsed) {
		t.Error(p)
	}
	if res == nil {
		t.FailNow()
	}
	return res
}

// runOK is run, failing t unless the code exited 0 with no reason; it
// returns the code's stdout, trimmed.
func (s *session) runOK(t *testing.T, what, code string) string {
	t.Helper()
	res := s.run(t, code)
	if res.ExitCode != 0 || res.Reason != "" {
		t.Fatalf("%s: got %s\nwant exit 0, no reason", what, describe(res))
	}
	return strings.TrimSpace(string(res.Stdout))
}

func (s *session) write(t *testing.T, name, data string) {
	t.Helper()
	if err := s.WriteFile(context.Background(), name, strings.NewReader(data)); err != nil {
		t.Fatalf("WriteFile(%q): %v", name, err)
	}
}

// read returns the contents of name, under a guard: a ReadFile that blocks
// (on a FIFO, say) fails instead of hanging the suite.
func (s *session) read(name string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type outcome struct {
		data string
		err  error
	}
	done := make(chan outcome, 1)
	go func() {
		rc, err := s.ReadFile(ctx, name)
		if err != nil {
			done <- outcome{"", err}
			return
		}
		defer rc.Close()
		b, err := io.ReadAll(rc)
		done <- outcome{string(b), err}
	}()
	select {
	case o := <-done:
		return o.data, o.err
	case <-time.After(30*time.Second + abandon):
		return "", fmt.Errorf("ReadFile(%q) still blocked %v after its context ended; abandoned", name, abandon)
	}
}

// list returns the session's files by name.
func (s *session) list(t *testing.T) map[string]moat.FileInfo {
	t.Helper()
	fis, err := s.ListFiles(context.Background())
	if err != nil {
		t.Fatalf("ListFiles: %v", err)
	}
	m := make(map[string]moat.FileInfo, len(fis))
	for _, fi := range fis {
		if _, dup := m[fi.Name]; dup {
			t.Errorf("ListFiles lists %q twice", fi.Name)
		}
		m[fi.Name] = fi
	}
	return m
}

// wantFiles fails t unless ListFiles lists exactly want.
func (s *session) wantFiles(t *testing.T, what string, want ...string) map[string]moat.FileInfo {
	t.Helper()
	got := s.list(t)
	var names []string
	for n := range got {
		names = append(names, n)
	}
	slices.Sort(names)
	slices.Sort(want)
	if !slices.Equal(names, want) {
		t.Errorf("%s: ListFiles = %q, want exactly %q", what, names, want)
	}
	return got
}

// leaveBehindPy is Python that defines leave(prog, marker): start, in a
// session of its own and with its standard streams on /dev/null, a python3
// running prog with marker as its argument, and return its pid without
// waiting for it.
const leaveBehindPy = `
def leave(prog, marker):
    import os, sys
    exe = sys.executable or 'python3'
    r, w = os.pipe()
    if os.fork() == 0:
        try:
            os.close(r)
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                null = os.open('/dev/null', os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.execvp(exe, [exe, '-c', prog, marker])
        finally:
            os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.close(r)
    os.wait()
    return pid
`

// scanPy is Python that defines seen(marker), how many processes the code
// sees in /proc whose command line holds marker (-1: it cannot list /proc),
// and alive(pid), whether it can see the process pid at all (a signal 0
// that does not fail with ESRCH).
const scanPy = `
def seen(marker):
    import os
    try:
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
    except OSError:
        return -1
    n = 0
    for p in pids:
        try:
            with open('/proc/%s/cmdline' % p, 'rb') as f:
                if marker.encode() in f.read():
                    n += 1
        except OSError:
            pass
    return n

def alive(pid):
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
`

func testSessionFilesPersist(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{}, interp)
	ctx := context.Background()
	data := token("moatup")
	s.write(t, "in/up.txt", data)
	cwd := s.runOK(t, "the run that reads the upload", `
import os
data = open('in/up.txt').read()
os.makedirs('out')
open('out/made.txt', 'w').write(data[::-1])
print(os.getcwd())
`)
	made := reverse(data)
	if got, err := s.read("out/made.txt"); err != nil || got != made {
		t.Errorf("ReadFile of the file a run wrote = %q, %v; want %q", got, err, made)
	}
	fi, err := s.Stat(ctx, "out/made.txt")
	if err != nil || fi.Name != "out/made.txt" || fi.Size != int64(len(made)) || !fi.Mode.IsRegular() || fi.IsDir || fi.ModTime.IsZero() {
		t.Errorf("Stat(out/made.txt) = %+v, %v; want a regular file of %d bytes with its modification time", fi, err, len(made))
	}
	if fi, err := s.Stat(ctx, "out"); err != nil || !fi.IsDir || !fi.Mode.IsDir() {
		t.Errorf("Stat(out) = %+v, %v; want a directory", fi, err)
	}
	files := s.wantFiles(t, "after a run wrote out/made.txt", "in", "in/up.txt", "out", "out/made.txt")
	if fi := files["out/made.txt"]; fi.Size != int64(len(made)) || !fi.Mode.IsRegular() {
		t.Errorf("ListFiles describes out/made.txt as %+v, want a regular file of %d bytes", fi, len(made))
	}
	if fi := files["out"]; !fi.IsDir {
		t.Errorf("ListFiles describes out as %+v, want a directory", fi)
	}

	if err := s.Mkdir(ctx, "d/e"); err != nil {
		t.Fatalf("Mkdir(d/e): %v", err)
	}
	if err := s.Rename(ctx, "out/made.txt", "d/e/moved.txt"); err != nil {
		t.Fatalf("Rename: %v", err)
	}
	s.write(t, "in/up.txt", "replaced")
	got := s.runOK(t, "the run after Mkdir, Rename and WriteFile", `
import os
print(os.getcwd())
print(os.path.isdir('d/e'), os.path.exists('out/made.txt'), open('d/e/moved.txt').read(), open('in/up.txt').read())
`)
	if want := cwd + "\nTrue False " + made + " replaced"; got != want {
		t.Errorf("the next run saw %q, want %q (the same working directory, Mkdir's directory, the file moved by Rename, the file replaced by WriteFile)", got, want)
	}
	for _, n := range []string{"d/e/moved.txt", "in/up.txt", "in"} {
		if err := s.RemoveFile(ctx, n); err != nil {
			t.Errorf("RemoveFile(%q): %v", n, err)
		}
	}
	if got := s.runOK(t, "the run after RemoveFile", `
import os
print(os.path.exists('d/e/moved.txt'), os.path.exists('in'), os.path.isdir('d/e'))
`); got != "False False True" {
		t.Errorf("after RemoveFile the next run saw %q, want \"False False True\"", got)
	}
	s.wantFiles(t, "after the removals", "d", "d/e", "out")
	if _, err := s.read("in/up.txt"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ReadFile of a removed file = %v, want fs.ErrNotExist", err)
	}
	if _, err := s.Stat(ctx, "nothing/here"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stat of a missing file = %v, want fs.ErrNotExist", err)
	}
	if err := s.RemoveFile(ctx, "nothing"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("RemoveFile of a missing file = %v, want fs.ErrNotExist", err)
	}
}

func reverse(s string) string {
	b := []byte(s)
	slices.Reverse(b)
	return string(b)
}

func testSessionFilesRefused(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{}, interp)
	ctx := context.Background()
	tok := token("moatesc")
	// /etc/passwd may not be there (the subprocess level hides the host's);
	// the python3 running the code is, and readable.
	before := s.runOK(t, "planting links", passwdPy+`
import os, sys
os.symlink('/', 'escape')
os.symlink('/etc/passwd', 'pw')
os.symlink(os.path.realpath(sys.executable), 'py')
os.symlink('/tmp', 'tmpl')
os.mkfifo('fifo')
os.mkdir('dir')
open('f', 'w').write('f')
print(passwd())
print(os.path.realpath(sys.executable).lstrip('/'))
`)
	before, py, _ := strings.Cut(before, "\n")
	readErr := func(name string) error { _, err := s.read(name); return err }
	statErr := func(name string) error { _, err := s.Stat(ctx, name); return err }
	w := func(name string) error { return s.WriteFile(ctx, name, strings.NewReader("moat")) }
	refused := map[string]error{
		"ReadFile(escape/etc/passwd)":    readErr("escape/etc/passwd"),
		"ReadFile(pw)":                   readErr("pw"),
		"ReadFile(py)":                   readErr("py"),
		"ReadFile(escape/" + py + ")":    readErr("escape/" + py),
		"ReadFile(tmpl/" + tok + ")":     readErr("tmpl/" + tok),
		"ReadFile(dir)":                  readErr("dir"),
		"WriteFile(escape/x)":            w("escape/" + tok),
		"WriteFile(escape/tmp/x)":        w("escape/tmp/" + tok),
		"WriteFile(tmpl/x)":              w("tmpl/" + tok),
		"WriteFile(tmpl/x/y)":            w("tmpl/" + tok + "/y"),
		"WriteFile(dir)":                 w("dir"),
		"Mkdir(escape/x)":                s.Mkdir(ctx, "escape/"+tok),
		"Mkdir(tmpl/x)":                  s.Mkdir(ctx, "tmpl/"+tok),
		"Mkdir(f)":                       s.Mkdir(ctx, "f"),
		"Stat(escape/etc/passwd)":        statErr("escape/etc/passwd"),
		"Rename(f, escape/tmp/x)":        s.Rename(ctx, "f", "escape/tmp/"+tok),
		"Rename(f, tmpl/x)":              s.Rename(ctx, "f", "tmpl/"+tok),
		"Rename(escape/etc/passwd, x)":   s.Rename(ctx, "escape/etc/passwd", tok),
		"RemoveFile(escape/etc/passwd)":  s.RemoveFile(ctx, "escape/etc/passwd"),
		"RemoveFile(escape/tmp/x)":       s.RemoveFile(ctx, "escape/tmp/"+tok),
		"RemoveFile(dir), not empty yet": func() error { w("dir/keep"); return s.RemoveFile(ctx, "dir") }(),
	}
	fifoUnseen := interp && ss.opts.InterpreterFIFOsUnseen
	if fifoErr := readErr("fifo"); fifoUnseen {
		if !errors.Is(fifoErr, fs.ErrNotExist) {
			t.Errorf("ReadFile(fifo) = %v, want an error wrapping fs.ErrNotExist (the level's pipes are not the session's files)", fifoErr)
		}
	} else {
		refused["ReadFile(fifo)"] = fifoErr
	}
	for _, name := range []string{"..", "../" + tok, "dir/../../" + tok, "/etc/passwd", "/tmp/" + tok, "", ".", "dir//f"} {
		q := fmt.Sprintf("%q", name)
		refused["WriteFile("+q+")"] = w(name)
		refused["ReadFile("+q+")"] = readErr(name)
		refused["Stat("+q+")"] = statErr(name)
		refused["Mkdir("+q+")"] = s.Mkdir(ctx, name)
		refused["Rename(f, "+q+")"] = s.Rename(ctx, "f", name)
		refused["Rename("+q+", g)"] = s.Rename(ctx, name, "g")
		refused["RemoveFile("+q+")"] = s.RemoveFile(ctx, name)
	}
	var ops []string
	for op := range refused {
		ops = append(ops, op)
	}
	slices.Sort(ops)
	for _, op := range ops {
		if err := refused[op]; !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("%s = %v, want an error wrapping moat.ErrInvalid", op, err)
		}
	}

	// Nothing changed: on the host, in the instance, in the session.
	for _, p := range []string{"/" + tok, "/tmp/" + tok} {
		if _, err := os.Lstat(p); err == nil {
			os.RemoveAll(p)
			t.Errorf("%s was made on the host", p)
		}
	}
	got := s.runOK(t, "looking for what the refused operations could have changed", passwdPy+fmt.Sprintf(`
import os
tok = %q
print(passwd())
print(os.path.lexists('/' + tok), os.path.lexists('/tmp/' + tok), open('f').read(), sorted(os.listdir('dir')))
`, tok))
	if want := before + "\nFalse False f ['keep']"; got != want {
		t.Errorf("after the refused operations the code saw %q, want %q (/etc/passwd unchanged, nothing made in / or /tmp, f unchanged)", got, want)
	}
	want := []string{"dir", "dir/keep", "escape", "f", "fifo", "pw", "py", "tmpl"}
	if fifoUnseen {
		want = slices.DeleteFunc(want, func(n string) bool { return n == "fifo" })
	}
	files := s.wantFiles(t, "after the refused operations", want...)
	for _, n := range []string{"escape", "pw", "py", "tmpl"} {
		if files[n].Mode&fs.ModeSymlink == 0 {
			t.Errorf("ListFiles describes the link %s as %+v, want a symbolic link", n, files[n])
		}
	}
	if !fifoUnseen && files["fifo"].Mode&fs.ModeNamedPipe == 0 {
		t.Errorf("ListFiles describes fifo as %+v, want a named pipe", files["fifo"])
	}
	if fi, err := s.Stat(ctx, "pw"); err != nil || fi.Mode&fs.ModeSymlink == 0 {
		t.Errorf("Stat(pw) = %+v, %v; want the link itself", fi, err)
	}
	// A link is the session's own file: it can go, never what it names.
	if err := s.RemoveFile(ctx, "pw"); err != nil {
		t.Errorf("RemoveFile(pw), a link: %v", err)
	}
	if err := s.Rename(ctx, "tmpl", "tmp-link"); err != nil {
		t.Errorf("Rename(tmpl, tmp-link), a link: %v", err)
	}
	got = s.runOK(t, "after the link's removal", passwdPy+`
import os
print(passwd(), os.path.lexists('pw'), os.readlink('tmp-link'))
`)
	if want := before + " False /tmp"; got != want {
		t.Errorf("after RemoveFile(pw) and Rename(tmpl) the code saw %q, want %q", got, want)
	}
}

// passwdPy defines passwd(): a digest of /etc/passwd, or "absent".
const passwdPy = `
def passwd():
    import hashlib
    try:
        with open('/etc/passwd', 'rb') as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return 'absent'
`

func testSessionWallTime(t *testing.T, ss *sessionSuite, interp bool) {
	wall := 5 * time.Second
	s := ss.session(t, moat.Limits{WallTime: moat.Duration(wall)}, interp)
	s.write(t, "uploaded", "u")
	res := s.run(t, `
import time
open('before', 'w').write('b')
print('sleeping', flush=True)
time.sleep(1000)
`)
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a run sleeping past the %v wall time: got %s\nwant reason timeout", wall, describe(res))
	}
	if got := s.runOK(t, "the run after the timeout", "print(open('before').read() + open('uploaded').read())"); got != "bu" {
		t.Errorf("the run after the timeout saw %q, want \"bu\" (the files written before and during the timed-out run)", got)
	}
}

func testSessionOutput(t *testing.T, ss *sessionSuite, interp bool) {
	limit := 64 * moat.KiB
	s := ss.session(t, moat.Limits{Output: limit, WallTime: moat.Duration(30 * time.Second)}, interp)
	res := s.run(t, `
import sys
open('before', 'w').write('b')
while True:
    sys.stdout.write('x' * 65536)
`)
	if res.Reason != moat.ReasonOutput || !res.Truncated || int64(len(res.Stdout)) != int64(limit) {
		t.Errorf("a run printing forever under a %v output cap: got %s\nwant reason output, truncated, exactly the cap kept", limit, describe(res))
	}
	if got := s.runOK(t, "the run after the output cap", "print(open('before').read())"); got != "b" {
		t.Errorf("the run after the output cap saw %q, want \"b\"", got)
	}
}

func testSessionDisk(t *testing.T, ss *sessionSuite, interp bool) {
	disk, file := 8*moat.MiB, 4*moat.MiB
	s := ss.session(t, moat.Limits{Disk: disk, FileSize: file, WallTime: moat.Duration(10 * time.Second)}, interp)
	ctx := context.Background()
	three := int64(3 * moat.MiB)
	if err := s.WriteFile(ctx, "a", bytes.NewReader(make([]byte, three))); err != nil {
		t.Fatalf("WriteFile of 3MiB under a %v disk: %v", disk, err)
	}
	s.runOK(t, "a run writing 3MiB beside 3MiB under an 8MiB disk", "open('b', 'wb').write(b'b' * (3 << 20))")
	// 6MiB are used: 3MiB more pass the disk, whoever writes them.
	err := s.WriteFile(ctx, "c", bytes.NewReader(make([]byte, three)))
	if !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("WriteFile of 3MiB with 6MiB of an 8MiB disk used = %v, want an error wrapping moat.ErrInvalid", err)
	}
	if _, err := s.Stat(ctx, "c"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("after the refused WriteFile, Stat(c) = %v, want fs.ErrNotExist", err)
	}
	res := s.run(t, "open('d', 'wb').write(b'd' * (3 << 20))")
	if res.Reason != moat.ReasonDisk {
		t.Errorf("a run writing 3MiB with 6MiB of an 8MiB disk used: got %s\nwant reason disk", describe(res))
	}
	var total int64
	for _, fi := range s.wantFiles(t, "after the writes past the disk", "a", "b", "d") {
		total += fi.Size
	}
	if total > int64(disk) {
		t.Errorf("the session's files hold %d bytes in all, over its %v disk", total, disk)
	}
	if err := s.RemoveFile(ctx, "d"); err != nil {
		t.Fatal(err)
	}
	if err := s.RemoveFile(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	s.runOK(t, "a run writing 3MiB once space was freed", "open('d', 'wb').write(b'd' * (3 << 20))")
	if err := s.WriteFile(ctx, "c", bytes.NewReader(make([]byte, 1<<20))); err != nil {
		t.Errorf("WriteFile of 1MiB with 6MiB of an 8MiB disk used: %v", err)
	}
}

// appenderPy is the program a run leaves behind in the Frozen check: it
// appends a byte to the file grow every 10 ms.
const appenderPy = `
import os, time
fd = os.open('grow', os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
while True:
    os.write(fd, b'x')
    time.sleep(0.01)
`

func testSessionFrozen(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)}, interp)
	marker := token("moatfrozen")
	s.runOK(t, "the run that leaves an appender behind", leaveBehindPy+fmt.Sprintf(`
import os, time
leave(%q, %q)
while not os.path.exists('grow') or os.path.getsize('grow') < 5:
    time.sleep(0.01)
`, appenderPy, marker))
	size := func() int64 {
		t.Helper()
		fi, err := s.Stat(context.Background(), "grow")
		if err != nil {
			t.Fatalf("Stat(grow): %v", err)
		}
		return fi.Size
	}
	before := size()
	if before < 5 {
		t.Fatalf("grow holds %d bytes after the run that waited for 5", before)
	}
	const idle = 2 * time.Second
	time.Sleep(idle)
	if after := size(); after != before {
		t.Errorf("a process the run left behind ran while no run was in progress: grow went from %d to %d bytes in %v", before, after, idle)
	}
	// The next run works; during it, what was left behind may run again
	// (a frozen interpreter's children) or be gone (killed at the run's end).
	s.runOK(t, "the run after the idle pause", "import time; time.sleep(0.3)")
	later := size()
	time.Sleep(idle)
	if again := size(); again != later {
		t.Errorf("after a second run, grow went from %d to %d bytes in %v while no run was in progress", later, again, idle)
	}
	if err := s.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if left := remainingWith(marker, settle); len(left) > 0 {
		t.Errorf("the process the run left behind outlived the session's Close by %v (killed now):\n\t%s", settle, strings.Join(left, "\n\t"))
	}
}

func testSessionIsolation(t *testing.T, ss *sessionSuite, interp bool) {
	b := ss.sandbox(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)})
	a, other := ss.sessionOf(t, b, interp), ss.sessionOf(t, b, interp)
	name, marker := token("moatmine"), token("moatiso")
	a.write(t, name, "a's")
	sleeper := "import time; time.sleep(1000)"
	// A leaves a sleeper behind, and sees it itself.
	leaveAndLook := leaveBehindPy + scanPy + fmt.Sprintf(`
import json, os, time
def leave_and_look(marker):
    pid = leave(%q, marker)
    for _ in range(100):  # until it has exec'd, where the code can tell
        if seen(marker) > 0:
            break
        try:
            with open('/proc/%%d/cmdline' %% pid, 'rb') as f:
                if marker.encode() in f.read():
                    break
        except OSError:
            pass
        time.sleep(0.01)
    return {'seen': seen(marker), 'alive': alive(pid), 'path': os.path.join(os.getcwd(), %q)}
`, sleeper, name)
	var mine struct {
		Seen  int
		Alive bool
		Path  string
	}
	res := a.run(t, leaveAndLook+fmt.Sprintf("print(json.dumps(leave_and_look(%s)))", split(marker)))
	if err := json.Unmarshal([]byte(lastLine(res.Stdout)), &mine); err != nil || !mine.Alive || mine.Seen == 0 {
		t.Fatalf("session A does not see the sleeper it left behind (%v): %s\nthe checks below would prove nothing", err, describe(res))
	}
	// What B may find: A's processes in its /proc, A's processes by their
	// host pids (when the host sees them), A's file by name or full path.
	look := func(what, marker string, alive bool) {
		t.Helper()
		var pids []int
		wait := time.Duration(0)
		if alive {
			wait = settle // it may be a moment before the host sees it exec'd
		}
		eventually(wait, func() []string {
			ps, _ := processesWith(procRoot, marker)
			pids = pids[:0]
			for _, p := range ps {
				pids = append(pids, p.PID)
			}
			if len(pids) == 0 {
				return []string{"none yet"}
			}
			return nil
		})
		t.Logf("%s: the host sees A's processes %v", what, pids)
		got := other.runOK(t, what, scanPy+fmt.Sprintf(`
import json, os
def readable(p):
    try:
        open(p).read()
        return True
    except OSError:
        return False
print(json.dumps({'seen': seen(%s), 'alive': [p for p in %s if alive(p)], 'named': os.path.lexists(%q), 'path': readable(%q)}))
`, split(marker), pyList(pids), name, mine.Path))
		var saw struct {
			Seen  int
			Alive []int
			Named bool
			Path  bool
		}
		if err := json.Unmarshal([]byte(lastLine([]byte(got))), &saw); err != nil {
			t.Fatalf("%s: the report does not parse (%v): %q", what, err, got)
		}
		if saw.Seen > 0 || len(saw.Alive) > 0 || saw.Named || saw.Path {
			t.Errorf("%s: B saw %d of A's processes in its /proc, A's processes %v (of their host pids %v), A's file by name: %v, at %s: %v; want none of them",
				what, saw.Seen, saw.Alive, pids, saw.Named, mine.Path, saw.Path)
		}
		if saw.Seen < 0 && len(pids) == 0 {
			t.Logf("%s: B cannot list /proc and the host sees none of A's processes: nothing of A's to find", what)
		}
	}
	// Between runs, a frozen interpreter's children live on.
	look("session B between runs of A", marker, interp)

	// While a run of A is in progress, with a sleeper of its own.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan struct{})
	out := &stream{on: map[string]func(){"ready": func() { close(ready) }}}
	done := make(chan *moat.Result, 1)
	marker2 := marker + "x"
	go func() {
		res, _, _ := runGuarded(ctx, b.limits, a.Run, moat.Request{Stdout: out, Code: []byte(leaveAndLook + fmt.Sprintf(`
print(json.dumps(leave_and_look(%s)))
print('re' + 'ady', flush=True)
time.sleep(1000)
`, split(marker2)))})
		done <- res
	}()
	select {
	case <-ready:
	case res := <-done:
		t.Fatalf("session A's run ended before it said ready: %s", describe(res))
	}
	look("session B during a run of A", marker2, true)
	cancel()
	if res := <-done; res == nil || res.Reason != moat.ReasonCanceled {
		t.Errorf("session A's run, cancelled: got %s, want reason canceled", describe(res))
	}
	if got, err := a.read(name); err != nil || got != "a's" {
		t.Errorf("session A's own file after all this: %q, %v", got, err)
	}
	if _, err := other.read(name); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("session B's ReadFile of A's file = %v, want fs.ErrNotExist", err)
	}
}

// pyList prints ints as a Python list.
func pyList(xs []int) string {
	var b strings.Builder
	b.WriteString("[")
	for i, x := range xs {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprint(&b, x)
	}
	b.WriteString("]")
	return b.String()
}

func testSessionSerialized(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)}, interp)
	code := `
import os, time
fd = os.open('lock', os.O_WRONLY | os.O_CREAT | os.O_EXCL)
time.sleep(0.5)
os.close(fd)
os.remove('lock')
print('alone')
`
	var wg sync.WaitGroup
	results := make([]*moat.Result, 3)
	errs := make([]error, 3)
	for i := range results {
		wg.Go(func() {
			results[i], _, errs[i] = runGuarded(context.Background(), s.b.limits, s.Run, moat.Request{Code: []byte(code)})
		})
	}
	wg.Wait()
	for i, res := range results {
		if errs[i] != nil || res == nil || res.ExitCode != 0 || strings.TrimSpace(string(res.Stdout)) != "alone" {
			t.Errorf("run %d of 3 called at once on one session: got %s, %v\nwant each alone (exit 0, \"alone\"): runs of a session are serialized", i, describe(res), errs[i])
		}
	}
}

func testSessionCloseLeavesNothing(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)}, interp)
	name, marker := token("moatsessfile"), token("moatsessproc")
	s.write(t, name, "x")
	s.write(t, "sub/"+name, "x")
	s.runOK(t, "a run leaving a sleeper and a file behind", leaveBehindPy+fmt.Sprintf(`
open(%q, 'w').write('y')
leave('import time; time.sleep(1000)', %q)
`, name+"-run", marker))
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if left := remainingWith(marker, settle); len(left) > 0 {
		t.Errorf("processes of the session outlived its Close by %v (killed now):\n\t%s", settle, strings.Join(left, "\n\t"))
	}
	if left := filesLeft(t, ss.opts.Dirs, name); len(left) > 0 {
		t.Errorf("files of the session remain on the host after its Close:\n\t%s", strings.Join(left, "\n\t"))
	}
}

func testSessionCloseTwice(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{}, interp)
	s.runOK(t, "a run", "print(1)")
	if err := s.Close(); err != nil {
		t.Fatalf("the first Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("the second Close = %v, want nil", err)
	}
	// The suite's cleanup closes it a third time, and checks that too.
}

func testSessionAfterClose(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{}, interp)
	s.write(t, "f", "x")
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	ctx := context.Background()
	res, err := s.Run(ctx, moat.Request{Code: []byte("print(1)")})
	if !errors.Is(err, moat.ErrClosed) || res != nil {
		t.Errorf("Run after Close = %s, %v; want a nil Result and an error wrapping moat.ErrClosed", describe(res), err)
	}
	for op, err := range map[string]error{
		"WriteFile":  s.WriteFile(ctx, "g", strings.NewReader("x")),
		"ReadFile":   func() error { _, err := s.read("f"); return err }(),
		"ListFiles":  func() error { _, err := s.ListFiles(ctx); return err }(),
		"Stat":       func() error { _, err := s.Stat(ctx, "f"); return err }(),
		"Mkdir":      s.Mkdir(ctx, "d"),
		"Rename":     s.Rename(ctx, "f", "h"),
		"RemoveFile": s.RemoveFile(ctx, "f"),
	} {
		if !errors.Is(err, moat.ErrClosed) {
			t.Errorf("%s after Close = %v, want an error wrapping moat.ErrClosed", op, err)
		}
	}
}

func testSessionCloseWhileRunning(t *testing.T, ss *sessionSuite, interp bool) {
	s := ss.session(t, moat.Limits{WallTime: moat.Duration(cancelWall)}, interp)
	marker := token("moatsessclose")
	out := &stream{}
	started := make(chan struct{})
	out.on = map[string]func(){"sleeping": func() { close(started) }}
	type outcome struct {
		res *moat.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, _, err := runGuarded(context.Background(), s.b.limits, s.Run, moat.Request{Stdout: out, Code: []byte(leaveBehindPy + fmt.Sprintf(`
import time
leave('import time; time.sleep(1000)', %q)
print('sleep' + 'ing', flush=True)
time.sleep(1000)
`, marker))})
		done <- outcome{res, err}
	}()
	select {
	case <-started:
	case o := <-done:
		t.Fatalf("the run ended before it said \"sleeping\": %s, %v", describe(o.res), o.err)
	}
	closed := time.Now()
	if err := s.Close(); err != nil {
		t.Errorf("Close during a run: %v", err)
	}
	o := <-done
	if d := time.Since(closed); d > cancelWall/4 {
		t.Errorf("the run returned %v after Close, want well under its %v wall time", d, cancelWall)
	}
	if o.err != nil && errors.Is(o.err, errHung) {
		t.Errorf("the run in progress when Close was called hung: %v", o.err)
	}
	if left := remainingWith(marker, settle); len(left) > 0 {
		t.Errorf("processes of the run outlived the session's Close by %v (killed now):\n\t%s", settle, strings.Join(left, "\n\t"))
	}
}

func testInterpreterVariables(t *testing.T, ss *sessionSuite, _ bool) {
	s := ss.session(t, moat.Limits{}, true)
	s.runOK(t, "defining", "x = 41\ndef f(): return x + 1\nimport json")
	if got := s.runOK(t, "using the definitions", "print(f(), json.dumps([x]))"); got != "42 [41]" {
		t.Errorf("the next run printed %q, want \"42 [41]\": the variables did not survive", got)
	}
	res := s.run(t, "y = 1\nraise ValueError('b' + 'ad')")
	if res.ExitCode != 1 || !strings.Contains(string(res.Stderr), "ValueError: bad") {
		t.Errorf("an uncaught exception: got %s\nwant exit 1 and its traceback", describe(res))
	}
	if got := s.runOK(t, "after the exception", "print(x, y)"); got != "41 1" {
		t.Errorf("after an exception the next run printed %q, want \"41 1\"", got)
	}
}

func testInterpreterTimeout(t *testing.T, ss *sessionSuite, _ bool) {
	wall := 5 * time.Second
	s := ss.session(t, moat.Limits{WallTime: moat.Duration(wall)}, true)
	s.runOK(t, "defining", "x = 1\nopen('kept', 'w').write('yes')")
	res := s.run(t, "while True: pass")
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a loop past the %v wall time: got %s\nwant reason timeout", wall, describe(res))
	}
	if !mentionsInterpreter(res.Notes) {
		t.Errorf("the run that timed out has notes %q, want one saying the interpreter ended", res.Notes)
	}
	res = s.run(t, "print('x' in globals(), open('kept').read())")
	if got := strings.TrimSpace(string(res.Stdout)); got != "False yes" || res.ExitCode != 0 {
		t.Errorf("the run after the timeout: got %s\nwant \"False yes\": a fresh interpreter, the files kept", describe(res))
	}
	if !mentionsInterpreter(res.Notes) {
		t.Errorf("the run after the timeout has notes %q, want one saying a fresh interpreter started", res.Notes)
	}
	if res := s.run(t, "y = 2"); mentionsInterpreter(res.Notes) {
		t.Errorf("a run of the fresh interpreter has notes %q, want none about the interpreter", res.Notes)
	}
}

func mentionsInterpreter(notes []string) bool {
	return slices.ContainsFunc(notes, func(n string) bool { return strings.Contains(strings.ToLower(n), "interpreter") })
}

func testInterpreterUnavailable(t *testing.T, ss *sessionSuite) {
	b := ss.sandbox(t, moat.Limits{})
	sr, ok := b.Sandbox.(moat.Sessioner)
	if !ok {
		t.Fatalf("the sandbox (%T) does not implement moat.Sessioner", b.Sandbox)
	}
	s, err := sr.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err == nil {
		s.Close()
		t.Fatal("the level says it keeps no interpreter (SessionsOptions.NoInterpreter), yet NewSession with Interpreter succeeded")
	}
	if !errors.Is(err, moat.ErrUnavailable) {
		t.Errorf("NewSession with Interpreter at a level without one = %v, want an error wrapping moat.ErrUnavailable", err)
	}
}
