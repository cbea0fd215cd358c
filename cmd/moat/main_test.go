package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moatsandbox/moat/attack"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root")
		}
		t.Skip("the strict subprocess level needs root (CI runs this as root)")
	}
}

func runMoat(t *testing.T, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	code = dispatch(context.Background(), args, Stdio{In: strings.NewReader(stdin), Out: &out, Err: &errb})
	return out.String(), errb.String(), code
}

func TestBadInputIsOneLineAndExit2(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing.py")
	cases := [][]string{
		{"run", "-c", ""},
		{"run"},
		{"run", missing},
		{"run", "--level", "nope", "-c", "print(1)"},
		{"run", "--memory", "12x", "-c", "print(1)"},
		{"run", "--wall-time", "-3s", "-c", "print(1)"},
		{"run", "--pids", "-1", "-c", "print(1)"},
		{"run", "--hardening", "paranoid", "-c", "print(1)"},
		{"run", "-c", "print(1)", "file.py"},
		{"run", "--no-such-flag"},
		{"bench", "--runs", "-5"},
		{"bench", "--levels", "subprocess", "--forks", "-1"},
		{"bench", "--levels", "subprocess", "--sustained", "--clients", "0"},
		{"bench", "--levels", "subprocess", "--sustained", "--forks", "2"},
		{"bench", "--levels", "subprocess", "--forks", "2", "--suspend", "2"},
		{"session", "--url", "http://127.0.0.1:1", "frobnicate"},
		{"attack", "--attacks", "teleport"},
		{"frobnicate"},
	}
	for _, args := range cases {
		_, stderr, code := runMoat(t, "", args...)
		if code != exitUsage {
			t.Errorf("moat %q: exit %d, want %d (stderr %q)", args, code, exitUsage, stderr)
		}
		if lines := strings.Count(strings.TrimSpace(stderr), "\n"); stderr == "" || lines > 0 {
			t.Errorf("moat %q: stderr %q, want one line", args, stderr)
		}
	}
}

func TestRunJSON(t *testing.T) {
	requireRoot(t)
	stdout, stderr, code := runMoat(t, "", "run", "--json", "-c", "import sys\nsys.stdout.buffer.write(b'\\xff\\x00ok')\nsys.stderr.write('e')\nraise SystemExit(4)")
	if code != 4 {
		t.Fatalf("exit %d, want the code's 4 (stderr %q)", code, stderr)
	}
	if strings.Count(stdout, "\n") != 1 {
		t.Fatalf("want exactly one JSON line, got %q", stdout)
	}
	var got map[string]any
	if err := json.Unmarshal([]byte(stdout), &got); err != nil {
		t.Fatalf("not JSON: %v: %q", err, stdout)
	}
	for _, k := range []string{"level", "stdout", "stderr", "exit_code", "duration_ms", "reason", "truncated"} {
		if _, ok := got[k]; !ok {
			t.Errorf("key %q missing from %s", k, stdout)
		}
	}
	if got["stdout"] != "\uFFFD\x00ok" || got["stderr"] != "e" || got["exit_code"] != 4.0 || got["level"] != "subprocess" {
		t.Errorf("got %v", got)
	}
}

func TestRunFileAndStdin(t *testing.T) {
	requireRoot(t)
	f := filepath.Join(t.TempDir(), "x.py")
	if err := os.WriteFile(f, []byte("print('from file')"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, _, code := runMoat(t, "", "run", f); code != 0 || out != "from file\n" {
		t.Errorf("file: %q exit %d", out, code)
	}
	if out, _, code := runMoat(t, "print('from stdin')", "run", "-"); code != 0 || out != "from stdin\n" {
		t.Errorf("stdin: %q exit %d", out, code)
	}
}

func TestRunReportsReason(t *testing.T) {
	requireRoot(t)
	stdout, _, _ := runMoat(t, "", "run", "--json", "--wall-time", "1s", "-c", "while True: pass")
	var got struct{ Reason string }
	if err := json.Unmarshal([]byte(stdout), &got); err != nil || got.Reason != "timeout" {
		t.Errorf("reason %q (%v), want timeout", got.Reason, err)
	}
}

// The output cap bounds what moat run prints, not only what it keeps: code
// that prints forever is cut at the cap and its run ended for it.
func TestRunOutputCapBoundsTheTerminal(t *testing.T) {
	requireRoot(t)
	// The terminal: it counts all it gets but keeps only a little, should
	// the cap not hold.
	var stdout headWriter
	var stderr bytes.Buffer
	code := dispatch(context.Background(), []string{"run", "--output", "1KiB", "--wall-time", "10s", "-c", "while True: print(1)"},
		Stdio{In: strings.NewReader(""), Out: &stdout, Err: &stderr})
	if stdout.n > 1024 || !strings.HasPrefix(string(stdout.head), "1\n1\n") {
		t.Errorf("printed %d bytes to stdout (%.40q...), want at most the 1KiB cap of the code's output", stdout.n, stdout.head)
	}
	if code != 137 || !strings.Contains(stderr.String(), "moat: output cut at 1KiB on stdout (limits.output, --output): the run was ended there (exit 137)") {
		t.Errorf("exit %d, stderr %q; want 137 and the run ended for its output", code, stderr.String())
	}
}

// headWriter counts what it is given and keeps the first 4KiB.
type headWriter struct {
	n    int64
	head []byte
}

func (w *headWriter) Write(p []byte) (int, error) {
	w.n += int64(len(p))
	w.head = append(w.head, p[:min(len(p), 4096-len(w.head))]...)
	return len(p), nil
}

func TestConfigFileAndFlagPrecedence(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "moat.json")
	os.WriteFile(cfg, []byte(`{"level":"subprocess","limits":{"memory":"128MiB","wall_time":"3s"}}`), 0o644)
	sf := addSandboxFlagsForTest(t, "--config", cfg, "--memory", "64MiB")
	fc, err := sf.resolve()
	if err != nil {
		t.Fatal(err)
	}
	if fc.Limits.Memory.String() != "64MiB" || fc.Limits.WallTime.String() != "3s" {
		t.Errorf("limits %+v: the flag must override the file, the file the defaults", fc.Limits)
	}
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"limits":{"memroy":"1GiB"}}`), 0o644)
	if _, err := addSandboxFlagsForTest(t, "--config", bad).resolve(); err == nil {
		t.Error("a misspelt key in the config file must be an error")
	}
}

func TestDoctorJSON(t *testing.T) {
	stdout, _, code := runMoat(t, "", "doctor", "--json")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	var got struct {
		Levels []struct {
			Level     string `json:"level"`
			Available bool   `json:"available"`
			Reason    string `json:"reason"`
			Remedy    string `json:"remedy"`
		} `json:"levels"`
	}
	if err := json.Unmarshal([]byte(stdout), &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Levels) != 4 {
		t.Fatalf("want a line per level, got %+v", got.Levels)
	}
	for _, l := range got.Levels {
		if !l.Available && l.Reason == "" {
			t.Errorf("%s is unavailable without a reason", l.Level)
		}
	}
	if os.Geteuid() == 0 && !got.Levels[0].Available {
		t.Errorf("subprocess must be available as root here: %+v", got.Levels[0])
	}
}

func TestAttackJSONSubprocess(t *testing.T) {
	requireRoot(t)
	stdout, stderr, code := runMoat(t, "", "attack", "--levels", "subprocess", "--json", "--wall-time", "2s")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var got struct {
		Results []struct {
			Level, Attack, How string
			Blocked            bool
		} `json:"results"`
	}
	if err := json.Unmarshal([]byte(stdout), &got); err != nil {
		t.Fatal(err)
	}
	if want := len(attack.All) + len(attack.EgressAttacks); len(got.Results) != want {
		t.Fatalf("want %d results (the egress probes too), got %d", want, len(got.Results))
	}
	egressed := 0
	for _, r := range got.Results {
		if attack.IsEgress(attack.Name(r.Attack)) {
			egressed++
		}
		if !r.Blocked || r.How == "" {
			t.Errorf("%s at %s: blocked=%v how=%q", r.Attack, r.Level, r.Blocked, r.How)
		}
	}
	if egressed != len(attack.EgressAttacks) {
		t.Errorf("%d egress probes in the results, want %d", egressed, len(attack.EgressAttacks))
	}
}

func addSandboxFlagsForTest(t *testing.T, args ...string) *sandboxFlags {
	t.Helper()
	fs := newFlagSet("test")
	sf := addSandboxFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return sf
}
