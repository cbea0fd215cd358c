package tool

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/moatsandbox/moat"
)

// fakeSession keeps files in memory, checks names as moat.Session says, and
// answers runs with a fixed result (or error), recording their code.
type fakeSession struct {
	res *moat.Result
	err error

	mu    sync.Mutex
	files map[string][]byte // "dir/" for a directory
	runs  []string
}

func newFakeSession() *fakeSession {
	return &fakeSession{res: &moat.Result{Level: moat.LevelSubprocess}, files: map[string][]byte{}}
}

func (f *fakeSession) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.runs = append(f.runs, string(req.Code))
	if f.err != nil {
		return nil, f.err
	}
	r := *f.res
	return &r, nil
}

func (f *fakeSession) Close() error { return nil }

func checkName(name string) error {
	if !fs.ValidPath(name) || name == "." {
		return fmt.Errorf("fake: file name %q must be a relative slash-separated path: %w", name, moat.ErrInvalid)
	}
	return nil
}

func (f *fakeSession) WriteFile(ctx context.Context, name string, r io.Reader) error {
	if err := checkName(name); err != nil {
		return err
	}
	data, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.files[name+"/"]; ok {
		return fmt.Errorf("fake: write %q: a directory: %w", name, moat.ErrInvalid)
	}
	for d := path.Dir(name); d != "."; d = path.Dir(d) {
		f.files[d+"/"] = nil
	}
	f.files[name] = data
	return nil
}

func (f *fakeSession) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	data, ok := f.files[name]
	if !ok {
		return nil, fmt.Errorf("fake: read %q: %w", name, fs.ErrNotExist)
	}
	return io.NopCloser(strings.NewReader(string(data))), nil
}

func (f *fakeSession) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []moat.FileInfo
	for name, data := range f.files {
		if d, ok := strings.CutSuffix(name, "/"); ok {
			out = append(out, moat.FileInfo{Name: d, IsDir: true, Mode: fs.ModeDir | 0o755})
		} else {
			out = append(out, moat.FileInfo{Name: name, Size: int64(len(data)), Mode: 0o644})
		}
	}
	return out, nil
}

func (f *fakeSession) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	if err := checkName(name); err != nil {
		return moat.FileInfo{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.files[name+"/"]; ok {
		return moat.FileInfo{Name: name, IsDir: true, Mode: fs.ModeDir | 0o755}, nil
	}
	data, ok := f.files[name]
	if !ok {
		return moat.FileInfo{}, fmt.Errorf("fake: stat %q: %w", name, fs.ErrNotExist)
	}
	return moat.FileInfo{Name: name, Size: int64(len(data)), Mode: 0o644}, nil
}

func (f *fakeSession) Mkdir(ctx context.Context, name string) error { return errors.ErrUnsupported }
func (f *fakeSession) Rename(ctx context.Context, from, to string) error {
	return errors.ErrUnsupported
}
func (f *fakeSession) RemoveFile(ctx context.Context, name string) error {
	return errors.ErrUnsupported
}

func (f *fakeSession) file(name string) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	data, ok := f.files[name]
	return string(data), ok
}

func callJSON(r Caller, name, args string) Outcome {
	return r.CallTool(context.Background(), name, json.RawMessage(args))
}

func TestSessionTools(t *testing.T) {
	for _, interp := range []bool{false, true} {
		specs := SessionTools(interp)
		var names []string
		for _, s := range specs {
			names = append(names, s.Name)
			var schema struct {
				Type       string                     `json:"type"`
				Properties map[string]json.RawMessage `json:"properties"`
				Additional *bool                      `json:"additionalProperties"`
			}
			if err := json.Unmarshal(s.InputSchema, &schema); err != nil || schema.Type != "object" || schema.Additional == nil || *schema.Additional {
				t.Errorf("%s: schema %s: want an object without additional properties (%v)", s.Name, s.InputSchema, err)
			}
			if s.Description == "" || s.Title == "" {
				t.Errorf("%s: no description or title", s.Name)
			}
			if s.ReadOnly != (s.Name == ReadFileName || s.Name == ListFilesName) {
				t.Errorf("%s: ReadOnly %v", s.Name, s.ReadOnly)
			}
		}
		if !slices.Equal(names, []string{Name, WriteFileName, ReadFileName, ListFilesName}) {
			t.Errorf("tools %v", names)
		}
		if !reflect.DeepEqual((&SessionRunner{Interpreter: interp}).Tools(), specs) {
			t.Error("SessionRunner.Tools differs from SessionTools")
		}
		// run_python's description says what persists, truly for the mode.
		desc := specs[0].Description
		if !strings.Contains(desc, "files persist") && !strings.Contains(desc, "files of the working directory") {
			t.Errorf("interpreter %v: description does not say that files persist: %s", interp, desc)
		}
		keptVars := strings.Contains(desc, "Variables, imports and definitions from earlier calls are kept")
		notKept := strings.Contains(desc, "variables, imports and definitions are NOT kept")
		if keptVars != interp || notKept == interp {
			t.Errorf("interpreter %v: description misstates whether variables persist: %s", interp, desc)
		}
	}
	if got := (&Runner{}).Tools(); len(got) != 1 || got[0].Name != Name || got[0].Description != Description {
		t.Errorf("Runner.Tools = %+v, want run_python with the one-shot description", got)
	}
}

func TestSessionRunPython(t *testing.T) {
	f := newFakeSession()
	f.res = &moat.Result{Level: moat.LevelSubprocess, Stdout: []byte("42\n"),
		Notes: []string{"interpreter restarted: the previous one was ended by its run's timeout; variables from earlier runs are gone"}}
	r := &SessionRunner{Session: f, Interpreter: true}
	out := callJSON(r, Name, `{"code":"print(x)"}`)
	if out.IsError || out.Tool != Name || out.Code != "print(x)" || out.Result == nil {
		t.Fatalf("outcome %+v", out)
	}
	if !slices.Equal(f.runs, []string{"print(x)"}) {
		t.Errorf("the session ran %q", f.runs)
	}
	if !strings.HasPrefix(out.Text, "note: interpreter restarted: ") || !strings.Contains(out.Text, "variables from earlier runs are gone\nexit code: 0\nstdout:\n42\n") {
		t.Errorf("text %q: want the note, then the result", out.Text)
	}
	// Bad input does not run.
	if out := callJSON(r, Name, `{"code":"print(1)","timeout":9}`); !out.IsError || !strings.HasPrefix(out.Text, "bad input: ") || len(f.runs) != 1 {
		t.Errorf("extra field: %+v, runs %q", out, f.runs)
	}
	// A spent session says what still works.
	f.err = fmt.Errorf("subprocess: session: its CPU budget is used up: %w", moat.ErrSpent)
	out = callJSON(r, Name, `{"code":"print(1)"}`)
	if !out.IsError || !errors.Is(out.Err, moat.ErrSpent) || !strings.Contains(out.Text, "read_file and list_files still work") {
		t.Errorf("spent session: %+v", out)
	}
	// A closed one is a tool error too.
	f.err = fmt.Errorf("subprocess: session: %w", moat.ErrClosed)
	if out := callJSON(r, Name, `{"code":"print(1)"}`); !out.IsError || !errors.Is(out.Err, moat.ErrClosed) || !strings.HasPrefix(out.Text, "error: ") {
		t.Errorf("closed session: %+v", out)
	}
}

func TestWriteFile(t *testing.T) {
	f := newFakeSession()
	r := &SessionRunner{Session: f, MaxFile: 16}
	bin := []byte{0, 1, 2, 0xff, 'x'}
	tests := []struct {
		name, args string
		file, want string // the file written and its contents, "" for a tool error
		text       string // a piece of the text
	}{
		{"text", `{"path":"a.txt","content":"héllo\n"}`, "a.txt", "héllo\n", "wrote a.txt (7 bytes)"},
		{"explicit text", `{"path":"b.txt","content":"x","encoding":"text"}`, "b.txt", "x", "wrote b.txt (1 byte)"},
		{"empty", `{"path":"empty","content":""}`, "empty", "", "wrote empty (0 bytes)"},
		{"base64", fmt.Sprintf(`{"path":"d/bin","content":%q,"encoding":"base64"}`, base64.StdEncoding.EncodeToString(bin)), "d/bin", string(bin), "wrote d/bin (5 bytes)"},
		{"base64 unpadded, wrapped", `{"path":"c","content":"aGVs\nbG8","encoding":"base64"}`, "c", "hello", "wrote c"},
		{"dot slash", `{"path":"./e.txt","content":"e"}`, "e.txt", "e", "wrote e.txt"},
		{"at the cap", `{"path":"cap","content":"0123456789abcdef"}`, "cap", "0123456789abcdef", "wrote cap (16 bytes)"},
		{"over the cap", `{"path":"big","content":"0123456789abcdefg"}`, "", "", `bad input: "content" is 17 bytes, over the cap of 16 bytes`},
		{"base64 over the cap", fmt.Sprintf(`{"path":"big","content":%q,"encoding":"base64"}`, base64.StdEncoding.EncodeToString(make([]byte, 17))), "", "", "over the cap of 16"},
		{"bad base64", `{"path":"x","content":"not base64!","encoding":"base64"}`, "", "", `bad input: "content" is not valid base64`},
		{"bad encoding", `{"path":"x","content":"x","encoding":"hex"}`, "", "", `"encoding" must be "text" or "base64", not "hex"`},
		{"no content", `{"path":"x"}`, "", "", `missing the required field "content"`},
		{"no path", `{"content":"x"}`, "", "", `missing the required field "path"`},
		{"empty path", `{"path":"","content":"x"}`, "", "", `"path" is empty`},
		{"path a number", `{"path":7,"content":"x"}`, "", "", `"path" must be a string, not a number`},
		{"content an object", `{"path":"x","content":{"a":1}}`, "", "", `"content" must be a string, not an object`},
		{"extra field", `{"path":"x","content":"x","mode":"0777"}`, "", "", `unknown field "mode": write_file takes "path", "content"`},
		{"not an object", `["x"]`, "", "", "must be a JSON object"},
		{"escape", `{"path":"../x","content":"x"}`, "", "", `error: tool: "../x": fake: file name "../x"`},
		{"absolute", `{"path":"/etc/passwd","content":"x"}`, "", "", `"/etc/passwd"`},
		{"onto a directory", `{"path":"d","content":"x"}`, "", "", "a directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := len(f.files)
			out := callJSON(r, WriteFileName, tt.args)
			if !strings.Contains(out.Text, tt.text) {
				t.Errorf("text %q does not contain %q", out.Text, tt.text)
			}
			if tt.file == "" {
				if !out.IsError || !errors.Is(out.Err, moat.ErrInvalid) || len(f.files) != before {
					t.Errorf("%+v: want a tool error wrapping ErrInvalid and nothing written", out)
				}
				return
			}
			if out.IsError {
				t.Fatalf("tool error %q", out.Text)
			}
			if got, ok := f.file(tt.file); !ok || got != tt.want {
				t.Errorf("file %s = %q (%v), want %q", tt.file, got, ok, tt.want)
			}
		})
	}
}

func TestReadFile(t *testing.T) {
	f := newFakeSession()
	const limit = 64
	r := &SessionRunner{Session: f, MaxOutput: limit}
	long := strings.Repeat("é", 40) // 80 bytes: the cut at 64 falls between runes or not
	f.files["t.txt"] = []byte("hello\nworld\n")
	f.files["empty"] = nil
	f.files["d/"] = nil
	f.files["long.txt"] = []byte("x" + long)
	f.files["bin"] = []byte{0x89, 'P', 'N', 'G', 0, 1, 2}
	f.files["bigbin"] = make([]byte, 1000)
	f.files["latin1"] = []byte("caf\xe9\n")

	out := callJSON(r, ReadFileName, `{"path":"t.txt"}`)
	if out.IsError || out.Text != "t.txt: 12 bytes of text:\nhello\nworld\n" {
		t.Errorf("t.txt: %q", out.Text)
	}
	if out := callJSON(r, ReadFileName, `{"path":"./empty"}`); out.IsError || out.Text != "empty: empty (0 bytes)" {
		t.Errorf("empty: %q", out.Text)
	}
	out = callJSON(r, ReadFileName, `{"path":"long.txt"}`)
	if out.IsError || !utf8.ValidString(out.Text) || !strings.Contains(out.Text, "81 bytes of text; the first 63 are shown") ||
		!strings.Contains(out.Text, "x"+strings.Repeat("é", 31)+"\n[... the rest is cut") {
		t.Errorf("long.txt: %q", out.Text)
	}
	for _, name := range []string{"bin", "latin1"} {
		out := callJSON(r, ReadFileName, fmt.Sprintf(`{"path":%q}`, name))
		want := base64.StdEncoding.EncodeToString(f.files[name])
		if out.IsError || !strings.Contains(out.Text, "binary, shown as base64:\n"+want) {
			t.Errorf("%s: %q, want it as base64 %s", name, out.Text, want)
		}
	}
	out = callJSON(r, ReadFileName, `{"path":"bigbin"}`)
	_, b64, _ := strings.Cut(out.Text, ":\n")
	raw, err := base64.StdEncoding.DecodeString(b64)
	if out.IsError || err != nil || len(raw) != limit/4*3 || len(b64) > limit || !strings.Contains(out.Text, "1000 bytes, binary") || !strings.Contains(out.Text, "the rest is cut") {
		t.Errorf("bigbin: %q (%d bytes decoded, %v)", out.Text, len(raw), err)
	}

	for _, c := range []struct {
		args, want string
		is         error
	}{
		{`{"path":"nope.txt"}`, `error: tool: no file "nope.txt" in the working directory (list_files shows what is there)`, fs.ErrNotExist},
		{`{"path":"d"}`, `bad input: "d" is a directory, not a file: list_files shows what is in it`, moat.ErrInvalid},
		{`{"path":"../../etc/passwd"}`, `"../../etc/passwd"`, moat.ErrInvalid},
		{`{}`, `missing the required field "path"`, moat.ErrInvalid},
		{`{"path":"t.txt","encoding":"base64"}`, `unknown field "encoding": read_file takes only "path"`, moat.ErrInvalid},
	} {
		out := callJSON(r, ReadFileName, c.args)
		if !out.IsError || !errors.Is(out.Err, c.is) || !strings.Contains(out.Text, c.want) {
			t.Errorf("%s: %+v, want a tool error %q matching %v", c.args, out, c.want, c.is)
		}
	}
}

func TestListFiles(t *testing.T) {
	f := newFakeSession()
	r := &SessionRunner{Session: f, MaxOutput: 80}
	for _, args := range []string{`{}`, ``, `null`} {
		if out := callJSON(r, ListFilesName, args); out.IsError || out.Text != "the working directory is empty" {
			t.Errorf("%q on nothing: %q", args, out.Text)
		}
	}
	f.files["b.txt"] = []byte("bb")
	f.files["a/"] = nil
	f.files["a/x.py"] = []byte("x")
	out := callJSON(r, ListFilesName, `{}`)
	if want := "3 entries in the working directory:\na/\na/x.py  1 byte\nb.txt  2 bytes"; out.IsError || out.Text != want {
		t.Errorf("list: %q, want %q", out.Text, want)
	}
	if out := callJSON(r, ListFilesName, `{"path":"a"}`); !out.IsError || !strings.Contains(out.Text, `unknown field "path": list_files takes no input`) {
		t.Errorf("list with a path: %q", out.Text)
	}
	for i := range 20 {
		f.files[fmt.Sprintf("f%02d", i)] = nil
	}
	out = callJSON(r, ListFilesName, `{}`)
	if out.IsError || len(out.Text) > 80+80 || !strings.Contains(out.Text, "more not shown; list them with run_python") {
		t.Errorf("long list (%d bytes): %q", len(out.Text), out.Text)
	}
}

func TestUnknownTool(t *testing.T) {
	out := callJSON(&SessionRunner{Session: newFakeSession()}, "bash", `{}`)
	if !out.IsError || out.Tool != "bash" || !strings.Contains(out.Text, `unknown tool "bash"; the tools are run_python, write_file, read_file, list_files`) {
		t.Errorf("session: %+v", out)
	}
	sb := &fakeSandbox{res: &moat.Result{}}
	out = callJSON(&Runner{Sandbox: sb}, WriteFileName, `{"path":"x","content":"y"}`)
	if !out.IsError || !strings.Contains(out.Text, `unknown tool "write_file"; the only tool is run_python`) || len(sb.runs) != 0 {
		t.Errorf("one-shot: %+v", out)
	}
	if out := callJSON(&Runner{Sandbox: &fakeSandbox{res: &moat.Result{Stdout: []byte("1\n")}}}, Name, `{"code":"print(1)"}`); out.IsError || out.Tool != Name {
		t.Errorf("one-shot run_python: %+v", out)
	}
}
