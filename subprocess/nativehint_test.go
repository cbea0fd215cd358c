package subprocess_test

import (
	"context"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// loadDroppedSO copies one of the host's shared objects into the run's
// working directory and loads it from there: what code that drops or
// uploads native code does. The working directory is noexec, so the
// loader refuses; the traceback goes to stderr.
const loadDroppedSO = `
import ctypes, ctypes.util, shutil
name = ctypes.util.find_library("z") or "libz.so.1"
path = next(d + "/" + name for d in ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"]
            if __import__("os").path.exists(d + "/" + name))
ctypes.CDLL(path)  # the host's own copy loads
shutil.copy(path, "dropped.so")
ctypes.CDLL("./dropped.so")
`

// TestNoexecNote checks that a run whose shared object the loader refuses
// to map (the working directory is noexec) gets a note saying why, in a
// one-shot run, a session's run and a live interpreter's run; and that a
// run that fails otherwise gets none. The note is a hint: the run's exit
// and reason are what they would be without it.
func TestNoexecNote(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	sb, err := subprocess.New(subprocess.Config{Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	check := func(what string, res *moat.Result, err error, want bool) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if !strings.Contains(string(res.Stderr), "failed to map segment from shared object") && want {
			t.Fatalf("%s: the loader did not refuse the dropped .so: exit %d, stderr %q", what, res.ExitCode, res.Stderr)
		}
		has := strings.Contains(strings.Join(res.Notes, "\n"), "mounted noexec")
		if has != want {
			t.Errorf("%s: notes %q: want the noexec note %v", what, res.Notes, want)
		}
		if want && (res.ExitCode != 1 || res.Reason != "") {
			t.Errorf("%s: exit %d, reason %q: want the traceback's exit 1 and no reason", what, res.ExitCode, res.Reason)
		}
	}
	res, err := sb.Run(ctx, moat.Request{Code: []byte(loadDroppedSO)})
	check("one-shot run", res, err, true)
	res, err = sb.Run(ctx, moat.Request{Code: []byte("import sys; sys.exit('no such thing: ' + 'x')")})
	check("a run failing otherwise", res, err, false)

	for _, interp := range []bool{false, true} {
		s, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: interp})
		if err != nil {
			t.Fatal(err)
		}
		res, err := s.Run(ctx, moat.Request{Code: []byte(loadDroppedSO)})
		check("session run (interpreter "+map[bool]string{false: "off", true: "on"}[interp]+")", res, err, true)
		res, err = s.Run(ctx, moat.Request{Code: []byte("print(1)")})
		check("the session's next run", res, err, false)
		s.Close()
	}
}
