package bench

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

func TestPythonBaselineRuns(t *testing.T) {
	rep, err := Run(context.Background(), Config{Runs: 3, Warmup: -1}, PythonTarget(""))
	if err != nil {
		t.Fatal(err)
	}
	row := rep.Rows[0]
	if row.Name != BaselineName || row.Level != "" || row.Runs != 3 || row.Err != "" {
		t.Fatalf("baseline row = %+v", row)
	}
	if row.Min <= 0 || row.Min > row.Median || row.Median > row.P90 || row.P90 > row.Max {
		t.Errorf("baseline timings not positive and ordered: %+v", row)
	}
	if row.Ratio != 1 {
		t.Errorf("baseline ratio = %v, want 1", row.Ratio)
	}
}

func TestCommandTargetChecksOutput(t *testing.T) {
	tests := []struct {
		name string
		argv []string
		want string // in the error; empty for success
	}{
		{"prints 1", []string{DefaultPython, "-c", Code}, ""},
		{"wrong output", []string{DefaultPython, "-c", "print(2)"}, `got "2\n"`},
		{"non-zero exit", []string{DefaultPython, "-c", "import sys; print(1); sys.exit(3)"}, "exit status 3"},
		{"stderr shown", []string{DefaultPython, "-c", "raise SystemExit('nope')"}, "nope"},
		{"missing binary", []string{"/nonexistent/python3"}, "no such file"},
		// /proc/self/environ, not os.environ: Python adds LC_CTYPE itself.
		{"environment is PATH only", []string{DefaultPython, "-c", "e = open('/proc/self/environ', 'rb').read().split(b'\\0')[:-1]; print(len(e) if [v.split(b'=')[0] for v in e] == [b'PATH'] else e)"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("BENCH_SECRET", "leak")
			err := CommandTarget("cmd", tt.argv...).Run(context.Background())
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("err = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("err = %v, want one containing %q", err, tt.want)
			}
		})
	}
	if err := CommandTarget("empty").Run(context.Background()); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("empty command: err = %v, want ErrInvalid", err)
	}
}

func TestPythonTargetHonoursContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := PythonTarget("").Run(ctx); err == nil {
		t.Error("Run with a cancelled context succeeded")
	}
}

// fakeSandbox returns a fixed result or error and records the requests.
type fakeSandbox struct {
	res  *moat.Result
	err  error
	code []string
}

func (f *fakeSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	f.code = append(f.code, string(req.Code))
	return f.res, f.err
}
func (f *fakeSandbox) Level() moat.Level { return moat.LevelSubprocess }
func (f *fakeSandbox) Close() error      { return nil }

var _ moat.Sandbox = (*fakeSandbox)(nil)

func TestSandboxTargetChecksResult(t *testing.T) {
	good := moat.Result{Level: moat.LevelSubprocess, Stdout: []byte("1\n")}
	tests := []struct {
		name string
		edit func(r *moat.Result)
		err  error
		want string // in the error; empty for success
	}{
		{"ok", func(*moat.Result) {}, nil, ""},
		{"ok with stderr and notes", func(r *moat.Result) { r.Stderr = []byte("warning"); r.Notes = []string{"n"} }, nil, ""},
		{"exit code", func(r *moat.Result) { r.ExitCode = 1 }, nil, "got exit 1"},
		{"stdout", func(r *moat.Result) { r.Stdout = []byte("1") }, nil, `stdout "1"`},
		{"reason", func(r *moat.Result) { r.Reason = moat.ReasonTimeout }, nil, `reason "timeout"`},
		{"sandbox error", func(*moat.Result) {}, moat.ErrUnavailable, "sandbox unavailable"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := good
			tt.edit(&res)
			sb := &fakeSandbox{res: &res, err: tt.err}
			if tt.err != nil {
				sb.res = nil
			}
			target := SandboxTarget("subprocess", sb)
			if target.Level != moat.LevelSubprocess || target.Name != "subprocess" {
				t.Errorf("target = %+v, want name and level subprocess", target)
			}
			err := target.Run(context.Background())
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("err = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("err = %v, want one containing %q", err, tt.want)
			}
			if tt.err != nil && !errors.Is(err, tt.err) {
				t.Errorf("err = %v does not wrap %v", err, tt.err)
			}
			if len(sb.code) != 1 || sb.code[0] != Code {
				t.Errorf("sandbox got requests %q, want one %q", sb.code, Code)
			}
		})
	}
}

func TestRunWithSandboxTarget(t *testing.T) {
	sb := &fakeSandbox{res: &moat.Result{Stdout: []byte("1\n")}}
	rep, err := Run(context.Background(), Config{Runs: 2, Warmup: -1}, PythonTarget(""), SandboxTarget("subprocess", sb))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Rows) != 2 || rep.Rows[1].Level != moat.LevelSubprocess || rep.Rows[1].Runs != 2 || rep.Rows[1].Err != "" {
		t.Errorf("rows = %+v", rep.Rows)
	}
	if len(sb.code) != 2 {
		t.Errorf("sandbox ran %d times, want 2", len(sb.code))
	}
}
