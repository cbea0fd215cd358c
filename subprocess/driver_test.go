package subprocess

import (
	"context"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

// TestDriverImportsLittle: an idle interpreter has not imported what the
// driver needs only for a traceback (interpreter_driver.py).
func TestDriverImportsLittle(t *testing.T) {
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
	code := "import sys\nprint([m for m in ('linecache', 'traceback', 'struct', 'tokenize', 're') if m in sys.modules])"
	res, err := s.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(res.Stdout)); got != "[]" {
		t.Errorf("an idle interpreter has imported %s (stderr %q)", got, res.Stderr)
	}
	// Positive control: the check sees a module once it is imported.
	res, err = s.Run(context.Background(), moat.Request{Code: []byte("import struct\n" + code)})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(res.Stdout)); got != "['struct']" {
		t.Errorf("after import struct: %s (stderr %q)", got, res.Stderr)
	}
}

// TestTracebackSourceAcrossRuns: with linecache loaded late (by the code,
// in a later run), a traceback the code prints itself still shows the
// lines of every run, the earlier ones' and its own.
func TestTracebackSourceAcrossRuns(t *testing.T) {
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
	for _, code := range []string{
		"def f():\n    raise ValueError('from run one')\n",
		"import importlib\ntb = importlib.import_module('traceback')\ntry:\n    f()  # the second run's line\nexcept ValueError:\n    tb.print_exc()\n",
	} {
		res, err := s.Run(context.Background(), moat.Request{Code: []byte(code)})
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode != 0 {
			t.Fatalf("%q: exit %d %s", code, res.ExitCode, res.Stderr)
		}
		if strings.HasPrefix(code, "import") {
			for _, want := range []string{"raise ValueError('from run one')", "f()  # the second run's line"} {
				if !strings.Contains(string(res.Stderr), want) {
					t.Errorf("the traceback lacks %q:\n%s", want, res.Stderr)
				}
			}
		}
	}
}
