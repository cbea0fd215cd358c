package subprocess_test

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// Tests from a hostile review of the warm paths (pre-started runs, the
// run's end at the helper's report, the teardown after the result).

// slowWriter keeps what it is given; its first Write takes delay, as a
// streaming client that reads slowly does.
type slowWriter struct {
	mu    sync.Mutex
	delay time.Duration
	once  sync.Once
	b     bytes.Buffer
}

func (w *slowWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { time.Sleep(w.delay) })
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *slowWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestKilledRunKeepsItsOutput: a run that the engine kills (here at the
// wall time) keeps everything it wrote before the kill, even when the
// output's reader is slower than the kill. (The helper's files, its output
// pipes among them, were closed as soon as a helper killed before its
// report had exited, while the output was still being passed on: what was
// left in the pipes was lost.)
func TestKilledRunKeepsItsOutput(t *testing.T) {
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{Limits: moat.Limits{WallTime: moat.Duration(time.Second)}})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	code := `import sys, time
sys.stdout.write("first\n"); sys.stdout.flush()
time.sleep(0.1)
sys.stdout.write("second\n"); sys.stdout.flush()
time.sleep(60)
`
	w := &slowWriter{delay: 1500 * time.Millisecond}
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code), Stdout: w})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonTimeout {
		t.Fatalf("reason %q, want %q: the probe is broken (stderr %q)", res.Reason, moat.ReasonTimeout, res.Stderr)
	}
	if got := string(res.Stdout); got != "first\nsecond\n" {
		t.Errorf("Result.Stdout %q, want both lines written before the kill", got)
	}
	if got := w.String(); !strings.HasSuffix(got, "second\n") {
		t.Errorf("the stream got %q, want both lines written before the kill", got)
	}
}

// TestBootstrapTracebackIsTheInterpreters: an exception class that
// redefines __traceback__ or with_traceback gets the traceback python3
// FILE prints, without the bootstrap's frames. (The bootstrap read the
// traceback through the exception's own attributes, so such a class made
// it fail and print its frames and names.)
func TestBootstrapTracebackIsTheInterpreters(t *testing.T) {
	requireRoot(t)
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	for _, code := range []string{
		"class E(Exception):\n    __traceback__ = None\nraise E('x')\n",
		"class E(Exception):\n    def with_traceback(self, tb):\n        return None\nraise E('x')\n",
	} {
		res := run(t, sb, code)
		stderr := string(res.Stderr)
		if res.ExitCode != 1 || strings.Contains(stderr, "_moat_main") || strings.Contains(stderr, "<string>") ||
			!strings.HasSuffix(strings.TrimSpace(stderr), "E: x") || !strings.Contains(stderr, ", in <module>\n    raise E('x')") {
			t.Errorf("%q: exit %d, stderr %q; want exit 1 and python3 FILE's traceback", code, res.ExitCode, stderr)
		}
	}
}
