package tool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/moatsandbox/moat"
)

// fakeSandbox returns a fixed result (or error) and records the code it was
// given.
type fakeSandbox struct {
	res *moat.Result
	err error

	mu   sync.Mutex
	runs []string
}

func (f *fakeSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	f.mu.Lock()
	f.runs = append(f.runs, string(req.Code))
	f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	r := *f.res
	return &r, nil
}
func (f *fakeSandbox) Level() moat.Level { return moat.LevelSubprocess }
func (f *fakeSandbox) Close() error      { return nil }

func TestInputSchema(t *testing.T) {
	var s struct {
		Type       string                     `json:"type"`
		Properties map[string]json.RawMessage `json:"properties"`
		Required   []string                   `json:"required"`
		Additional *bool                      `json:"additionalProperties"`
	}
	if err := json.Unmarshal(InputSchema(), &s); err != nil {
		t.Fatalf("schema does not parse: %v", err)
	}
	if s.Type != "object" {
		t.Errorf("type = %q, want object", s.Type)
	}
	if len(s.Properties) != 1 || s.Properties["code"] == nil {
		t.Errorf("properties = %v, want only code", s.Properties)
	}
	var code struct{ Type string }
	if err := json.Unmarshal(s.Properties["code"], &code); err != nil || code.Type != "string" {
		t.Errorf("code property = %s, want type string", s.Properties["code"])
	}
	if len(s.Required) != 1 || s.Required[0] != "code" {
		t.Errorf("required = %v, want [code]", s.Required)
	}
	if s.Additional == nil || *s.Additional {
		t.Errorf("additionalProperties = %v, want false", s.Additional)
	}
}

func TestParseInput(t *testing.T) {
	big := strings.Repeat("x", 101)
	tests := []struct {
		name     string
		args     string
		max      int
		wantCode string
		wantErr  string // a piece of the message, "" for success
	}{
		{"ok", `{"code":"print(1)"}`, 0, "print(1)", ""},
		{"unicode and NUL", `{"code":"print('é\u0000')"}`, 0, "print('é\x00')", ""},
		{"at the cap", fmt.Sprintf(`{"code":%q}`, big[:100]), 100, big[:100], ""},
		{"over the cap", fmt.Sprintf(`{"code":%q}`, big), 100, "", "101 bytes, over the cap of 100"},
		{"nothing", ``, 0, "", `missing the required field "code"`},
		{"null", `null`, 0, "", `missing the required field "code"`},
		{"empty object", `{}`, 0, "", `missing the required field "code"`},
		{"not an object", `["print(1)"]`, 0, "", "must be a JSON object"},
		{"a bare string", `"print(1)"`, 0, "", "must be a JSON object"},
		{"broken JSON", `{"code":`, 0, "", "must be a JSON object"},
		{"number", `{"code":42}`, 0, "", `"code" must be a string, not a number`},
		{"null code", `{"code":null}`, 0, "", `not null`},
		{"array code", `{"code":["print(1)"]}`, 0, "", `not an array`},
		{"object code", `{"code":{"src":"x"}}`, 0, "", `not an object`},
		{"bool code", `{"code":true}`, 0, "", `not a boolean`},
		{"empty code", `{"code":""}`, 0, "", `"code" is empty`},
		{"extra field", `{"code":"print(1)","level":"none"}`, 0, "", `unknown field "level"`},
		{"extra fields", `{"code":"print(1)","timeout":99,"memory":"8GiB"}`, 0, "", `unknown fields "memory", "timeout"`},
		{"wrong case", `{"Code":"print(1)"}`, 0, "", `unknown field "Code"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, err := ParseInput(json.RawMessage(tt.args), tt.max)
			if tt.wantErr == "" {
				if err != nil || code != tt.wantCode {
					t.Fatalf("ParseInput = %q, %v; want %q, nil", code, err, tt.wantCode)
				}
				return
			}
			if err == nil {
				t.Fatalf("ParseInput = %q, nil; want an error containing %q", code, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q does not contain %q", err, tt.wantErr)
			}
			if !errors.Is(err, moat.ErrInvalid) {
				t.Errorf("error %v does not match moat.ErrInvalid", err)
			}
		})
	}
}

func TestCallRunsCode(t *testing.T) {
	sb := &fakeSandbox{res: &moat.Result{Level: moat.LevelSubprocess, Stdout: []byte("42\n")}}
	r := &Runner{Sandbox: sb}
	out := r.Call(context.Background(), json.RawMessage(`{"code":"print(6*7)"}`))
	if out.IsError || out.Err != nil {
		t.Fatalf("Call: IsError=%v Err=%v", out.IsError, out.Err)
	}
	if out.Code != "print(6*7)" || len(sb.runs) != 1 || sb.runs[0] != "print(6*7)" {
		t.Errorf("code = %q, sandbox got %q", out.Code, sb.runs)
	}
	want := "exit code: 0\nstdout:\n42\nstderr: (empty)"
	if out.Text != want {
		t.Errorf("Text = %q, want %q", out.Text, want)
	}
}

func TestCallBadInputDoesNotRun(t *testing.T) {
	sb := &fakeSandbox{res: &moat.Result{}}
	r := &Runner{Sandbox: sb, MaxCode: 10}
	for _, args := range []string{`{}`, `{"code":1}`, `{"code":"print(1)","x":1}`, `{"code":"print(12345678)"}`} {
		out := r.Call(context.Background(), json.RawMessage(args))
		if !out.IsError || out.Err == nil || out.Result != nil {
			t.Errorf("%s: IsError=%v Err=%v Result=%v, want a tool error", args, out.IsError, out.Err, out.Result)
		}
		if !strings.HasPrefix(out.Text, "bad input: ") {
			t.Errorf("%s: Text = %q, want it to start with 'bad input: '", args, out.Text)
		}
	}
	if len(sb.runs) != 0 {
		t.Errorf("the sandbox ran %q on bad input", sb.runs)
	}
}

func TestCallSandboxError(t *testing.T) {
	sb := &fakeSandbox{err: &moat.UnavailableError{Level: moat.LevelSubprocess, Reason: "landlock is missing"}}
	out := (&Runner{Sandbox: sb}).Call(context.Background(), json.RawMessage(`{"code":"print(1)"}`))
	if !out.IsError || !errors.Is(out.Err, moat.ErrUnavailable) {
		t.Fatalf("IsError=%v Err=%v, want a tool error wrapping ErrUnavailable", out.IsError, out.Err)
	}
	if !strings.HasPrefix(out.Text, "error: ") || !strings.Contains(out.Text, "landlock is missing") {
		t.Errorf("Text = %q, want the sandbox's reason", out.Text)
	}
}

func TestFormat(t *testing.T) {
	tests := []struct {
		name string
		res  moat.Result
		want []string // pieces that must appear, in order
		not  []string // pieces that must not appear
	}{
		{"clean exit", moat.Result{Stdout: []byte("hi\n")},
			[]string{"exit code: 0\n", "stdout:\nhi\n", "stderr: (empty)"}, []string{"reason", "cut"}},
		{"traceback", moat.Result{ExitCode: 1, Stderr: []byte("Traceback\nZeroDivisionError")},
			[]string{"exit code: 1\n", "stdout: (empty)\n", "stderr:\nTraceback\nZeroDivisionError"}, []string{"reason"}},
		{"timeout", moat.Result{ExitCode: 137, Reason: moat.ReasonTimeout, Signal: "killed"},
			[]string{"exit code: 137\n", "reason: timeout (the run passed its time limit", "signal: killed\n"}, nil},
		{"memory", moat.Result{ExitCode: 137, Reason: moat.ReasonMemory},
			[]string{"reason: memory (the run hit its memory limit)"}, nil},
		{"output cap", moat.Result{Reason: moat.ReasonOutput, Truncated: true, Stdout: []byte("y\n")},
			[]string{"reason: output (", "stdout:\ny\n"}, []string{"note:"}},
		{"truncated without reason", moat.Result{Truncated: true, Stdout: []byte("y\n")},
			[]string{"note: the output passed the sandbox's output cap"}, nil},
		{"not utf-8", moat.Result{Stdout: []byte("a\xffb\n")},
			[]string{"stdout:\na\uFFFDb\n"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Format(&tt.res, 0)
			rest := got
			for _, w := range tt.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Fatalf("Format = %q\nwant %q (in order)", got, w)
				}
				rest = rest[i+len(w):]
			}
			for _, n := range tt.not {
				if strings.Contains(got, n) {
					t.Errorf("Format = %q, should not contain %q", got, n)
				}
			}
			if !utf8.ValidString(got) {
				t.Errorf("Format = %q is not valid UTF-8", got)
			}
		})
	}
}

func TestFormatCutsLongOutput(t *testing.T) {
	// A long stdout of numbered lines, with multi-byte runes to split, and
	// a traceback at the end of stderr.
	var sb strings.Builder
	for i := range 5000 {
		fmt.Fprintf(&sb, "line %d é€😀\n", i)
	}
	stdout := sb.String()
	stderr := strings.Repeat("noise\n", 2000) + "Traceback (most recent call last):\nValueError: the end\n"
	const max = 1000
	got := Format(&moat.Result{ExitCode: 1, Stdout: []byte(stdout), Stderr: []byte(stderr)}, max)

	if !utf8.ValidString(got) {
		t.Fatal("cut output is not valid UTF-8")
	}
	if len(got) > 2*max+600 {
		t.Errorf("Format is %d bytes for max %d per stream", len(got), max)
	}
	for _, w := range []string{
		fmt.Sprintf("stdout (%d bytes; the middle", len(stdout)),
		"line 0 é€😀\n",
		"bytes cut ...]",
		"line 4999 é€😀\n",
		fmt.Sprintf("stderr (%d bytes;", len(stderr)),
		"ValueError: the end",
	} {
		if !strings.Contains(got, w) {
			t.Errorf("Format does not contain %q:\n%s", w, got)
		}
	}
	if strings.Contains(got, "line 2500 ") {
		t.Error("the middle of stdout was not cut")
	}
}

func TestCutKeepsRunes(t *testing.T) {
	s := strings.Repeat("😀", 100) // 4 bytes each
	for max := 1; max < 40; max++ {
		head, tail := cut(s, max)
		if !utf8.ValidString(head) || !utf8.ValidString(tail) {
			t.Fatalf("max %d: cut %q | %q splits a rune", max, head, tail)
		}
		if len(head)+len(tail) > max {
			t.Fatalf("max %d: kept %d bytes", max, len(head)+len(tail))
		}
	}
}

func FuzzParseInput(f *testing.F) {
	for _, s := range []string{`{"code":"print(1)"}`, `{}`, `null`, `{"code":1}`, `{"code":"x","y":2}`, `[`, `{"code":"\u0000"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		code, err := ParseInput(data, 64)
		if err != nil {
			if code != "" {
				t.Fatalf("code %q with error %v", code, err)
			}
			if !errors.Is(err, moat.ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		if code == "" || len(code) > 64 {
			t.Fatalf("accepted code of %d bytes", len(code))
		}
		var m map[string]any
		if json.Unmarshal(data, &m) != nil || len(m) != 1 {
			t.Fatalf("accepted %q, which is not an object with one field", data)
		}
	})
}
