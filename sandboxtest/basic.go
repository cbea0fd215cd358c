package sandboxtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// This file holds the checks of ordinary runs: streams, exit codes, odd
// input, the environment and the working directory.

func testStdout(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "print('hello')")
	if string(res.Stdout) != "hello\n" || len(res.Stderr) != 0 || res.ExitCode != 0 || res.Reason != "" {
		t.Errorf("print('hello'): got %s\nwant stdout \"hello\\n\", empty stderr, exit 0, no reason", describe(res))
	}
}

func testStderr(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "import sys; sys.stderr.write('oops')")
	if len(res.Stdout) != 0 || string(res.Stderr) != "oops" || res.ExitCode != 0 || res.Reason != "" {
		t.Errorf("sys.stderr.write('oops'): got %s\nwant empty stdout, stderr \"oops\", exit 0, no reason", describe(res))
	}
}

func testExitSystemExit(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "raise SystemExit(3)")
	if res.ExitCode != 3 || res.Reason != "" || res.Signal != "" {
		t.Errorf("raise SystemExit(3): got %s\nwant exit 3, no reason, no signal", describe(res))
	}
}

func testExitException(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "x = 1\nraise ValueError('bad' + 'value')")
	if res.ExitCode != 1 || res.Reason != "" || !strings.Contains(string(res.Stderr), "Traceback") ||
		!strings.Contains(string(res.Stderr), "ValueError: badvalue") {
		t.Errorf("an uncaught ValueError: got %s\nwant exit 1, no reason, a traceback ending in \"ValueError: badvalue\" on stderr", describe(res))
	}
}

func testExitZero(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "print(1)")
	if res.ExitCode != 0 || res.Reason != "" || res.Signal != "" || res.Truncated || string(res.Stdout) != "1\n" {
		t.Errorf("print(1): got %s\nwant stdout \"1\\n\", exit 0, no reason, no signal, not truncated", describe(res))
	}
}

func testLevelAndDuration(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	if !slices.Contains(moat.Levels, b.Level()) {
		t.Errorf("Level() = %q, not one of %v", b.Level(), moat.Levels)
	}
	start := time.Now()
	res := b.run(t, "import time; time.sleep(0.2)")
	elapsed := time.Since(start)
	// run has checked Level and Duration against the caller's clock; check
	// here that Duration covers the code's own sleep too.
	if res.Level != b.Level() || res.Duration < 200*time.Millisecond || res.Duration > elapsed {
		t.Errorf("a run sleeping 200ms: Level=%q Duration=%v (caller waited %v); want Level %q and 200ms <= Duration <= %v",
			res.Level, res.Duration, elapsed, b.Level(), elapsed)
	}
}

func testEmptyCode(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	for _, code := range [][]byte{nil, {}} {
		res, err := b.Run(context.Background(), moat.Request{Code: code})
		if !errors.Is(err, moat.ErrInvalid) || res != nil {
			t.Errorf("Run(Code: %#v) = %s, %v; want a nil Result and an error wrapping moat.ErrInvalid", code, describe(res), err)
		}
	}
}

func testNULBytes(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "print(1)\x00\nprint(2)\n")
	if res.ExitCode != 1 || res.Reason != "" || !strings.Contains(string(res.Stderr), "SyntaxError") || len(res.Stdout) != 0 {
		t.Errorf("code holding a NUL byte: got %s\nwant Python's SyntaxError: exit 1, no reason, \"SyntaxError\" on stderr, nothing on stdout", describe(res))
	}
}

func testInvalidUTF8(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "print('\xff\xfe')\n")
	if res.ExitCode != 1 || res.Reason != "" || !strings.Contains(string(res.Stderr), "SyntaxError") || len(res.Stdout) != 0 {
		t.Errorf("code that is not UTF-8: got %s\nwant Python's SyntaxError: exit 1, no reason, \"SyntaxError\" on stderr, nothing on stdout", describe(res))
	}
}

func testBinaryOutput(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "import sys; sys.stdout.buffer.write(b'\\xff\\xfe\\x00'); sys.stderr.buffer.write(b'\\x80')")
	if string(res.Stdout) != "\xff\xfe\x00" || string(res.Stderr) != "\x80" || res.ExitCode != 0 {
		t.Fatalf("writing bytes that are not UTF-8: got %s\nwant stdout exactly \"\\xff\\xfe\\x00\", stderr exactly \"\\x80\", exit 0", describe(res))
	}
	data, err := json.Marshal(res)
	if err != nil || !json.Valid(data) {
		t.Fatalf("json.Marshal(result) = %q, %v; want valid JSON", data, err)
	}
	var got struct{ Stdout, Stderr string }
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatalf("unmarshal %s: %v", data, err)
	}
	// A run of invalid bytes becomes one U+FFFD, as strings.ToValidUTF8
	// does.
	if got.Stdout != "\uFFFD\x00" || got.Stderr != "\uFFFD" {
		t.Errorf("the JSON of the result has stdout %q, stderr %q; want %q and %q", got.Stdout, got.Stderr, "\uFFFD\x00", "\uFFFD")
	}
}

// allowedEnv is what a run's environment may hold: the basics a program
// expects, and Python's own: LC_CTYPE, which Python sets itself when it
// coerces the C locale, and the PYTHON* variables that configure it.
var allowedEnv = []string{"PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "PWD"}

func envAllowed(name string) bool {
	return slices.Contains(allowedEnv, name) || strings.HasPrefix(name, "PYTHON")
}

func testEnvVariables(t *testing.T, s *suite) {
	canary := token("canary")
	t.Setenv("MOAT_TEST_CANARY", canary)
	t.Setenv("ANTHROPIC_API_KEY", canary+"-key")
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "import json, os; print(json.dumps(dict(os.environ)))")
	// The output holds the environment the run got; when the level leaks
	// the host's, it is full of the host's values, so failures name the
	// variables and never print the output.
	if strings.Contains(string(res.Stdout), canary) || strings.Contains(string(res.Stderr), canary) {
		t.Errorf("the run saw the value of the host's MOAT_TEST_CANARY or ANTHROPIC_API_KEY")
	}
	var env map[string]string
	if err := json.Unmarshal(res.Stdout, &env); err != nil {
		t.Fatalf("the run's environment does not parse (%v): exit=%d reason=%q stderr %s", err, res.ExitCode, res.Reason, shorten(res.Stderr))
	}
	var extra []string
	for name := range env {
		if !envAllowed(name) {
			extra = append(extra, name)
		}
	}
	slices.Sort(extra)
	if len(extra) > 0 {
		t.Errorf("the run's environment holds %s; allowed are %v and PYTHON*", strings.Join(extra, ", "), allowedEnv)
	}
}

func testEnvOtherProcesses(t *testing.T, s *suite) {
	canary := token("canary")
	t.Setenv("MOAT_TEST_CANARY", canary)
	b := s.sandbox(t, moat.Limits{})
	// Print the environment of every process the code can read: its own, its
	// parent's (a helper of the level, perhaps), anyone's; when /proc cannot
	// be listed, at least its own, its parent's and init's. The full stream is
	// searched, past the output limit.
	out := &stream{}
	res := b.runReq(t, context.Background(), moat.Request{Stdout: out, Code: []byte(`
import os, sys
try:
    pids = [p for p in os.listdir('/proc') if p.isdigit()]
except OSError:
    pids = ['self', str(os.getppid()), '1']
n = 0
for p in pids:
    try:
        with open('/proc/' + p + '/environ', 'rb') as f:
            env = f.read()
    except OSError:
        continue
    n += 1
    sys.stdout.buffer.write(b'== pid ' + p.encode() + b' ==\n' + env.replace(b'\0', b'\n') + b'\n')
print('read', n, 'environments')
`)})
	// Search what the writer received (past the output limit) and the
	// Result (for a level that does not stream).
	all := string(out.bytes()) + "\n" + string(res.Stdout)
	if res.ExitCode != 0 || !strings.Contains(all, " environments") {
		t.Fatalf("the program reading /proc/*/environ did not finish: exit=%d reason=%q stderr %s", res.ExitCode, res.Reason, shorten(res.Stderr))
	}
	if i := strings.Index(all, canary); i >= 0 {
		header := all[:i]
		if j := strings.LastIndex(header, "== pid "); j >= 0 {
			header, _, _ = strings.Cut(header[j:], "\n")
		}
		t.Errorf("the run read the value of the host's MOAT_TEST_CANARY through /proc (in the block %q)", header)
	}
}

func testStdin(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{WallTime: moat.Duration(5 * time.Second)})
	res := b.run(t, "import sys; print(repr(sys.stdin.read()))")
	if string(res.Stdout) != "''\n" || res.Reason != "" || res.ExitCode != 0 {
		t.Errorf("sys.stdin.read(): got %s\nwant stdout \"''\\n\" at once (stdin empty and at its end), no reason, exit 0", describe(res))
	}
}

func testWorkDirWritable(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "open('f', 'w').write('x'); print(open('f').read())")
	if string(res.Stdout) != "x\n" || res.ExitCode != 0 {
		t.Errorf("writing a file in the working directory: got %s\nwant stdout \"x\\n\", exit 0", describe(res))
	}
}

func testWorkDirFresh(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	name := token("moatfresh")
	first := b.run(t, fmt.Sprintf("import os; open(%q, 'w').write('x'); print(os.getcwd())", name))
	if first.ExitCode != 0 {
		t.Fatalf("the first run could not write %s: %s", name, describe(first))
	}
	dir := strings.TrimSpace(string(first.Stdout))
	second := b.run(t, fmt.Sprintf("import os; print(os.path.exists(%q), os.path.exists(%q))", name, filepath.Join(dir, name)))
	if string(second.Stdout) != "False False\n" {
		t.Errorf("a second run of the same sandbox sees the file %s the first wrote (in %s): %s", name, dir, describe(second))
	}
}

func testWorkDirNoTrace(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	name := token("moattrace")
	// Write a uniquely named file wherever the code can: its working
	// directory, the temporary directories, its home.
	res := b.run(t, fmt.Sprintf(`
import json, os
written = []
for d in [os.getcwd(), '/tmp', '/var/tmp', '/dev/shm', os.path.expanduser('~')]:
    p = os.path.join(d, %q)
    try:
        with open(p, 'w') as f:
            f.write('x')
        written.append(p)
    except OSError:
        pass
st = os.stat('.')
print(json.dumps({'cwd': os.getcwd(), 'dev': st.st_dev, 'ino': st.st_ino, 'written': written}))
`, name))
	var got struct {
		Cwd      string
		Dev, Ino uint64
		Written  []string
	}
	if err := json.Unmarshal([]byte(lastLine(res.Stdout)), &got); err != nil {
		t.Fatalf("the run's report does not parse (%v): %s", err, describe(res))
	}
	if !slices.Contains(got.Written, filepath.Join(got.Cwd, name)) {
		t.Fatalf("the run could not write %s in its working directory %s: %s", name, got.Cwd, describe(res))
	}
	// The paths are the sandbox's; on a container or VM level they name
	// nothing on the host, and a file found there is a file that leaked.
	if left := filesLeft(t, s.opts.Dirs, name, got.Written...); len(left) > 0 {
		t.Errorf("files the run wrote (it wrote %v) remain on the host after Run returned:\n\t%s", got.Written, strings.Join(left, "\n\t"))
	}
	// The same path may exist on the host by chance (/work, /tmp); the same
	// directory, device and inode alike, is the run's own left behind.
	if fi, err := os.Stat(got.Cwd); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Dev == got.Dev && st.Ino == got.Ino {
			t.Errorf("the run's working directory %s (device %d, inode %d) remains on the host after Run returned", got.Cwd, got.Dev, got.Ino)
		}
	}
}
