package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestSplitRunArgs(t *testing.T) {
	fs := newFlagSet("run")
	addSandboxFlags(fs)
	fs.String("c", "", "")
	fs.Bool("json", false, "")
	for _, tc := range []struct {
		args                    []string
		flags, positional, rest []string
	}{
		{[]string{"s.py", "a", "b"}, nil, []string{"s.py", "a", "b"}, nil},
		{[]string{"s.py", "--json"}, []string{"--json"}, []string{"s.py"}, nil},
		{[]string{"--wall-time", "2s", "s.py", "a", "--json", "--memory=64MiB", "b", "--", "-x", "--json"},
			[]string{"--wall-time", "2s", "--json", "--memory=64MiB"}, []string{"s.py", "a", "b"}, []string{"-x", "--json"}},
		{[]string{"-c", "--", "--", "x"}, []string{"-c", "--"}, nil, []string{"x"}},
		{[]string{"-", "--no-such", "y"}, []string{"--no-such"}, []string{"-", "y"}, nil},
	} {
		flags, pos, rest := splitRunArgs(fs, tc.args)
		if !slices.Equal(flags, tc.flags) || !slices.Equal(pos, tc.positional) || !slices.Equal(rest, tc.rest) {
			t.Errorf("splitRunArgs(%q) = %q, %q, %q; want %q, %q, %q", tc.args, flags, pos, rest, tc.flags, tc.positional, tc.rest)
		}
	}
}

func TestFileFlagRefusesEscapes(t *testing.T) {
	for _, v := range []string{"a:/etc/x", "a:../x", "a:b/../../x", "a:.", ":b", "/abs/..:x/..//y"} {
		var l fileList
		if err := l.Set(v); err == nil {
			t.Errorf("--file %q accepted as %+v", v, l)
		}
	}
	var l fileList
	for _, v := range []string{"/tmp/data.csv", "x.txt:in/y.txt", "a:b:c"} {
		if err := l.Set(v); err != nil {
			t.Errorf("--file %q: %v", v, err)
		}
	}
	want := fileList{{"/tmp/data.csv", "data.csv"}, {"x.txt", "in/y.txt"}, {"a:b", "c"}}
	if !slices.Equal(l, want) {
		t.Errorf("got %+v, want %+v", l, want)
	}
}

// moat run s.py a b and moat run s.py --json worked not at all ("one file
// at a time"): flags come anywhere before --, the arguments after the file
// and after -- are the code's.
func TestRunArgvAndFlagsAfterFile(t *testing.T) {
	requireRoot(t)
	s := writeFile(t, t.TempDir(), "s.py", "import sys\nprint(sys.argv)\n")
	stdout, stderr, code := runMoat(t, "", "run", s, "a", "b")
	if code != 0 || stdout != "['s.py', 'a', 'b']\n" {
		t.Errorf("run s.py a b: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	stdout, stderr, code = runMoat(t, "", "run", s, "--json", "a", "--wall-time", "5s", "--", "--json", "-c")
	var res struct{ Stdout string }
	if code != 0 || json.Unmarshal([]byte(stdout), &res) != nil || res.Stdout != "['s.py', 'a', '--json', '-c']\n" {
		t.Errorf("run s.py --json a ... -- --json -c: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	_, stderr, code = runMoat(t, "", "run", s, "-v")
	if code != exitUsage || strings.Count(stderr, "\n") != 1 || !strings.Contains(stderr, "-v") || !strings.Contains(stderr, "goes after --") {
		t.Errorf("run s.py -v: exit %d, stderr %q; want one line saying the code's -v goes after --", code, stderr)
	}
	stdout, _, code = runMoat(t, "", "run", "-c", "import sys; print(sys.argv)", "--", "x")
	if code != 0 || stdout != "['-c', 'x']\n" {
		t.Errorf("run -c CODE -- x: exit %d, stdout %q", code, stdout)
	}
	stdout, _, code = runMoat(t, "import sys; print(sys.argv)", "run", "-", "y")
	if code != 0 || stdout != "['-', 'y']\n" {
		t.Errorf("run - y: exit %d, stdout %q", code, stdout)
	}
}

// A traceback names the user's file and shows its lines, with none of
// the prologue's frames and none of the level's own file for the code.
func TestRunTracebackNamesTheFile(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	s := writeFile(t, dir, "calc.py", "def f():\n    return 1/0\nf()\n")
	for _, args := range [][]string{{"run", s}, {"run", "--stdin", s, s}} {
		_, stderr, code := runMoat(t, "", args...)
		if code != 1 {
			t.Errorf("%q: exit %d, want 1 as python3 gives (stderr %q)", args, code, stderr)
		}
		want := "Traceback (most recent call last):\n  File \"calc.py\", line 3, in <module>\n    f()\n  File \"calc.py\", line 2, in f\n    return 1/0\n"
		if !strings.HasPrefix(stderr, want) || !strings.Contains(stderr, "ZeroDivisionError") {
			t.Errorf("%q: stderr\n%s\nwant it to start\n%s", args, stderr, want)
		}
		for _, bad := range []string{"moat", "_moat_run", "<stdin>", "main.py"} {
			if strings.Contains(stderr, bad) {
				t.Errorf("%q: the traceback holds %q:\n%s", args, bad, stderr)
			}
		}
	}
	_, stderr, _ := runMoat(t, "", "run", writeFile(t, dir, "bad.py", "x = (\n"))
	if !strings.HasPrefix(stderr, "  File \"bad.py\", line 1\n") || !strings.Contains(stderr, "SyntaxError") {
		t.Errorf("syntax error: stderr %q", stderr)
	}
	_, stderr, _ = runMoat(t, "", "run", "-c", "raise KeyError(7)")
	if stderr != "Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\n    raise KeyError(7)\nKeyError: 7\n" {
		t.Errorf("-c: stderr %q", stderr)
	}
}

// The code's stdin, input files and output files, at every level that is
// set up here (CI sets up all of them).
func TestRunStdinFilesAndOutAtEachLevel(t *testing.T) {
	requireRoot(t)
	for _, e := range levelTable() {
		t.Run(string(e.level), func(t *testing.T) {
			if a := e.check(context.Background(), fileConfig{}); !a.Available {
				if os.Getenv("CI") == "true" {
					t.Fatalf("CI sets up every level: %s", a.Reason)
				}
				t.Skipf("%s is not set up here: %s", e.level, a.Reason)
			}
			dir := t.TempDir()
			s := writeFile(t, dir, "s.py", `import os, sys
data = sys.stdin.read()
print(sys.argv[1:], repr(data), open("in/data.txt").read())
open("out.txt", "w").write(data.upper())
os.makedirs("sub/deep")
open("sub/deep/x.bin", "wb").write(b"\0\1")
os.symlink("/etc/passwd", "link")
`)
			data := writeFile(t, dir, "data.txt", "from a file")
			out := filepath.Join(dir, "out")
			stdout, stderr, code := runMoat(t, "piped\nin", "run", "--level", string(e.level), s, "--stdin", "-", "--file", data+":in/data.txt", "--out", out, "arg")
			if code != 0 || stdout != "['arg'] 'piped\\nin' from a file\n" {
				t.Fatalf("exit %d, stdout %q, stderr %q", code, stdout, stderr)
			}
			got := map[string]string{}
			filepath.WalkDir(out, func(p string, d os.DirEntry, err error) error {
				if err == nil && !d.IsDir() {
					b, _ := os.ReadFile(p)
					rel, _ := filepath.Rel(out, p)
					got[rel] = string(b)
				}
				return nil
			})
			want := map[string]string{"out.txt": "PIPED\nIN", "sub/deep/x.bin": "\x00\x01"}
			if len(got) != len(want) || got["out.txt"] != want["out.txt"] || got["sub/deep/x.bin"] != want["sub/deep/x.bin"] {
				t.Errorf("--out holds %q, want %q (no input file, no link, no stdin file)", got, want)
			}
		})
	}
}

func TestRunOutRefusesToOverwrite(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	os.MkdirAll(out, 0o755)
	keep := writeFile(t, out, "a.txt", "mine")
	// A link in DIR is replaced by the file, never written through.
	target := writeFile(t, dir, "target", "not to be touched")
	os.Symlink(target, filepath.Join(out, "b.txt"))
	code := "open('a.txt','w').write('new'); open('b.txt','w').write('new b')"
	stdout, stderr, status := runMoat(t, "", "run", "--json", "--out", out, "-c", code)
	var res struct {
		ExitCode int      `json:"exit_code"`
		OutFiles []string `json:"out_files"`
		Error    struct{ Code, Message string }
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || status != exitUsage || res.Error.Code != "invalid" ||
		!strings.Contains(res.Error.Message, "a.txt, b.txt already in") || len(res.OutFiles) != 0 {
		t.Errorf("without --force: exit %d, stdout %q (%v), stderr %q", status, stdout, err, stderr)
	}
	if b, _ := os.ReadFile(keep); string(b) != "mine" {
		t.Errorf("a.txt replaced without --force: %q", b)
	}
	stdout, stderr, status = runMoat(t, "", "run", "--json", "--force", "--out", out, "-c", code)
	res.OutFiles = nil
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || status != 0 || !slices.Equal(res.OutFiles, []string{"a.txt", "b.txt"}) {
		t.Errorf("with --force: exit %d, stdout %q, stderr %q", status, stdout, stderr)
	}
	if b, _ := os.ReadFile(keep); string(b) != "new" {
		t.Errorf("a.txt not replaced with --force: %q", b)
	}
	if b, _ := os.ReadFile(target); string(b) != "not to be touched" {
		t.Errorf("--out wrote through a link in DIR: the target holds %q", b)
	}
	if fi, err := os.Lstat(filepath.Join(out, "b.txt")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("b.txt is not the run's file: %v %v", fi, err)
	}
}

func TestRunStdinCap(t *testing.T) {
	requireRoot(t)
	big := strings.Repeat("x", 1025)
	_, stderr, code := runMoat(t, big, "run", "--file-size", "1KiB", "--stdin", "-", "-c", "print(1)")
	if code != exitUsage || !strings.Contains(stderr, "--stdin: more than 1KiB") || strings.Count(stderr, "\n") != 1 {
		t.Errorf("exit %d, stderr %q", code, stderr)
	}
	stdout, _, code := runMoat(t, big[:1024], "run", "--file-size", "1KiB", "--stdin", "-", "-c", "import sys; print(len(sys.stdin.read()))")
	if code != 0 || stdout != "1024\n" {
		t.Errorf("at the cap: exit %d, stdout %q", code, stdout)
	}
}

// With --json every error is one JSON object on stdout, with the exit
// status of the plain error.
func TestRunJSONErrors(t *testing.T) {
	dir := t.TempDir()
	cases := [][]string{
		{"run", "--json", "--no-such-flag", "-c", "print(1)"},
		{"run", "--json", filepath.Join(dir, "missing.py")},
		{"run", "--json", "-c", ""},
		{"run", "--json"},
		{"run", "--json", "--pids", "0", "-c", "print(1)"},
		{"run", "--json", "--memory", "12x", "-c", "print(1)"},
		{"run", "--json", "--level", "nope", "-c", "print(1)"},
		{"run", "-c", "print(1)", "--json", "--file", "x:/abs"},
		{"run", "--json", "--stdin", filepath.Join(dir, "missing"), "-c", "print(1)"},
	}
	for _, args := range cases {
		stdout, stderr, code := runMoat(t, "", args...)
		var got struct {
			Error *jsonError `json:"error"`
		}
		if code != exitUsage || strings.Count(stdout, "\n") != 1 || json.Unmarshal([]byte(stdout), &got) != nil || got.Error == nil ||
			got.Error.Code != "invalid" || !strings.HasPrefix(got.Error.Message, "moat: ") {
			t.Errorf("moat %q: exit %d, stdout %q, stderr %q; want exit 2 and one JSON error", args, code, stdout, stderr)
		}
		if stderr != "" {
			t.Errorf("moat %q: stderr %q, want nothing: the error is on stdout", args, stderr)
		}
	}
	if code := jsonErrorFor(Stdio{Out: &strings.Builder{}}, moat.ErrUnavailable); code != exitInternal || errorCode(moat.ErrUnavailable) != "unavailable" {
		t.Errorf("an unavailable level: exit %d, code %q", code, errorCode(moat.ErrUnavailable))
	}
}

// A limit given as zero meant the default without a word; it is refused,
// naming the flag, for every limit flag and every limit key.
func TestRunRefusesZeroLimits(t *testing.T) {
	fs := newFlagSet("run")
	sf := addSandboxFlags(fs)
	n := 0
	for name, key := range flagKeys(fs, &sf.flags) {
		if !strings.HasPrefix(key, "limits.") {
			continue
		}
		n++
		zero := "0"
		_, stderr, code := runMoat(t, "", "run", "--"+name, zero, "-c", "print(1)")
		if code != exitUsage || !strings.Contains(stderr, "--"+name+" ") || !strings.Contains(stderr, "cannot be zero") {
			t.Errorf("--%s 0: exit %d, stderr %q", name, code, stderr)
		}
		val := "0"
		if strings.HasSuffix(key, "_time") {
			val = `"0s"` // a duration is a string
		}
		file := writeConfig(t, `{"limits":{"`+strings.TrimPrefix(key, "limits.")+`":`+val+`}}`)
		_, stderr, code = runMoat(t, "", "run", "--config", file, "-c", "print(1)")
		if code != exitUsage || !strings.Contains(stderr, key+": "+val+": a limit cannot be zero") {
			t.Errorf("%s 0 in the config file: exit %d, stderr %q", key, code, stderr)
		}
	}
	if n != 8 {
		t.Errorf("%d limit flags, want the 8 of moat.Limits", n)
	}
	_, stderr, code := runMoat(t, "", "run", "--timeout", "0s", "-c", "print(1)")
	if code != exitUsage || !strings.Contains(stderr, "--timeout 0s: a limit cannot be zero") {
		t.Errorf("--timeout 0s: exit %d, stderr %q", code, stderr)
	}
}

// A run cut at the output cap says what was cut and at what size, not
// only its reason.
func TestRunSaysWhatWasCut(t *testing.T) {
	requireRoot(t)
	_, stderr, code := runMoat(t, "", "run", "--output", "1KiB", "-c", "import sys\nsys.stderr.write('e')\nprint('x' * 5000)")
	if code != 137 || !strings.Contains(stderr, "moat: output cut at 1KiB on stdout (limits.output, --output)") {
		t.Errorf("exit %d, stderr %q", code, stderr)
	}
}

// A failed run's notes reach plain mode's stderr: at subprocess, a shared
// object the run drops cannot be loaded (its working directory is noexec),
// and the note that says why is printed after the traceback.
func TestRunPlainPrintsAFailedRunsNotes(t *testing.T) {
	requireRoot(t)
	code := `import ctypes, ctypes.util, os, shutil
name = ctypes.util.find_library("z") or "libz.so.1"
path = next(d + "/" + name for d in ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"] if os.path.exists(d + "/" + name))
shutil.copy(path, "dropped.so")
ctypes.CDLL("./dropped.so")`
	_, stderr, exit := runMoat(t, "", "run", "--level", "subprocess", "-c", code)
	if exit != 1 || !strings.Contains(stderr, "failed to map segment") {
		t.Fatalf("exit %d, stderr %q: want the loader's refusal", exit, stderr)
	}
	if !strings.Contains(stderr, "moat: note: a shared object could not be loaded") {
		t.Errorf("stderr %q: no note saying why", stderr)
	}
	_, stderr, exit = runMoat(t, "", "run", "--level", "subprocess", "-c", "print(1)")
	if exit != 0 || strings.Contains(stderr, "moat: note:") {
		t.Errorf("a run that succeeded: exit %d, stderr %q: want no notes", exit, stderr)
	}
}
