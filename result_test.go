package moat_test

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/moatsandbox/moat"
)

func TestResultJSON(t *testing.T) {
	r := moat.Result{
		Level:     moat.LevelSubprocess,
		Stdout:    []byte("hi\n"),
		Stderr:    []byte("oops"),
		ExitCode:  137,
		Duration:  1500 * time.Microsecond,
		Reason:    moat.ReasonOutput,
		Truncated: true,
		Signal:    "SIGKILL",
		Notes:     []string{"not root: no cgroup"},
	}
	out, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"level":"subprocess","exit_code":137,"reason":"output","truncated":true,"signal":"SIGKILL",` +
		`"notes":["not root: no cgroup"],"stdout":"hi\n","stderr":"oops","duration_ms":1.5}`
	if string(out) != want {
		t.Errorf("Marshal =\n%s\nwant\n%s", out, want)
	}
	// A pointer prints the same.
	if p, err := json.Marshal(&r); err != nil || string(p) != want {
		t.Errorf("Marshal(&r) = %s, %v; want the same as Marshal(r)", p, err)
	}

	// The zero Result: every key that has no omitempty is there, stdout and
	// stderr as empty strings (never null), no signal, no notes.
	out, err = json.Marshal(moat.Result{})
	if err != nil {
		t.Fatal(err)
	}
	const wantZero = `{"level":"","exit_code":0,"reason":"","truncated":false,"stdout":"","stderr":"","duration_ms":0}`
	if string(out) != wantZero {
		t.Errorf("Marshal(Result{}) =\n%s\nwant\n%s", out, wantZero)
	}
}

// Every field of Result is either printed under its JSON tag or replaced by
// the keys MarshalJSON adds: a field added later cannot vanish from the
// output by accident, nor come out as base64 or nanoseconds.
func TestResultJSONKeys(t *testing.T) {
	r := moat.Result{Signal: "x", Notes: []string{"x"}}
	out, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatal(err)
	}
	var want []string
	typ := reflect.TypeFor[moat.Result]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch name {
		case "":
			t.Errorf("Result.%s has no json tag", f.Name)
		case "-":
			replaced := map[string]string{"Stdout": "stdout", "Stderr": "stderr", "Duration": "duration_ms"}
			if replaced[f.Name] == "" {
				t.Errorf("Result.%s is left out of the JSON and nothing replaces it", f.Name)
				continue
			}
			want = append(want, replaced[f.Name])
		default:
			want = append(want, name)
		}
	}
	var got []string
	for k := range m {
		got = append(got, k)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("JSON keys %v, want %v", got, want)
	}
}

// Output is raw bytes, cut at a byte count; its JSON is valid UTF-8 with
// U+FFFD where the bytes were not, and keeps every valid byte.
func TestResultJSONBytes(t *testing.T) {
	for _, tt := range []struct {
		name      string
		out, want string
	}{
		{"ascii", "hello\n", "hello\n"},
		{"empty", "", ""},
		{"utf-8", "héllo wörld ✓ 🐍", "héllo wörld ✓ 🐍"},
		{"NUL and control bytes", "a\x00b\x01\t\r\n\x7f", "a\x00b\x01\t\r\n\x7f"},
		{"a lone invalid byte", "a\xffb", "a\uFFFDb"},
		{"a run of invalid bytes is one U+FFFD", "a\xff\xfe\xfdb", "a\uFFFDb"},
		{"invalid bytes apart", "\xffa\xff", "\uFFFDa\uFFFD"},
		{"cut inside a two-byte character", "caf\xc3", "caf\uFFFD"},
		{"cut inside a four-byte character", "py \xf0\x9f\x90", "py \uFFFD"},
		{"a cut character then a whole one", "\xe2\x9c" + "✓", "\uFFFD✓"},
		{"a UTF-16 surrogate encoded as UTF-8", "\xed\xa0\x80", "\uFFFD"},
		{"an overlong encoding", "\xc0\xaf", "\uFFFD"},
		{"U+FFFD itself", "\uFFFD", "\uFFFD"},
		{"HTML and JSON metacharacters", `<script>"\</script>&`, `<script>"\</script>&`},
		{"line and paragraph separators", "\u2028\u2029", "\u2028\u2029"},
	} {
		r := moat.Result{Stdout: []byte(tt.out), Stderr: []byte(tt.out)}
		out, err := json.Marshal(r)
		if err != nil {
			t.Errorf("%s: Marshal: %v", tt.name, err)
			continue
		}
		if !utf8.Valid(out) || !json.Valid(out) {
			t.Errorf("%s: Marshal gave invalid UTF-8 or JSON: %q", tt.name, out)
		}
		var back struct{ Stdout, Stderr string }
		if err := json.Unmarshal(out, &back); err != nil {
			t.Errorf("%s: Unmarshal: %v", tt.name, err)
			continue
		}
		if back.Stdout != tt.want || back.Stderr != tt.want {
			t.Errorf("%s: stdout %q, stderr %q; want %q", tt.name, back.Stdout, back.Stderr, tt.want)
		}
		// The Result itself is not changed.
		if string(r.Stdout) != tt.out {
			t.Errorf("%s: Marshal changed Stdout to %q", tt.name, r.Stdout)
		}
	}
}

func TestResultJSONDuration(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		want float64
	}{
		{0, 0},
		{999, 0}, // under a microsecond
		{time.Microsecond, 0.001},
		{1500 * time.Microsecond, 1.5},
		{time.Second, 1000},
		{90 * time.Minute, 5400000},
		{-time.Millisecond, -1},
	} {
		out, err := json.Marshal(moat.Result{Duration: tt.d})
		if err != nil {
			t.Fatal(err)
		}
		var back struct {
			DurationMS float64 `json:"duration_ms"`
		}
		if err := json.Unmarshal(out, &back); err != nil || back.DurationMS != tt.want {
			t.Errorf("Duration %v: duration_ms %v, %v; want %v", tt.d, back.DurationMS, err, tt.want)
		}
	}
}
