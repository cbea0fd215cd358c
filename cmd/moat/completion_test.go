package main

import (
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/moatsandbox/moat/internal/version"
)

func TestVersion(t *testing.T) {
	want := "moat " + version.String() + "\n"
	for _, args := range [][]string{{"--version"}, {"version"}} {
		stdout, stderr, code := runMoat(t, "", args...)
		if code != 0 || stdout != want || stderr != "" {
			t.Errorf("moat %q: exit %d, stdout %q, stderr %q; want %q", args, code, stdout, stderr, want)
		}
	}
	if _, _, code := runMoat(t, "", "version", "extra"); code != exitUsage {
		t.Errorf("moat version extra: exit %d, want 2", code)
	}
}

// helpFlags are the flags moat CMD -h lists, deprecated spellings aside,
// as the completion scripts spell them.
func helpFlags(t *testing.T, args ...string) (flags, deprecated []string) {
	t.Helper()
	stdout, _, code := runMoat(t, "", append(args, "-h")...)
	if code != 0 {
		t.Fatalf("moat %q -h: exit %d", args, code)
	}
	lines := strings.Split(stdout, "\n")
	for i, line := range lines {
		if !strings.HasPrefix(line, "  -") {
			continue
		}
		name := strings.Fields(line)[0][1:]
		if len(name) > 1 {
			name = "-" + name
		}
		name = "-" + name
		if strings.Contains(line+lines[min(i+1, len(lines)-1)], deprecatedPrefix) {
			deprecated = append(deprecated, name)
		} else {
			flags = append(flags, name)
		}
	}
	return flags, deprecated
}

// Both scripts complete every command, and each command's flags: those of
// its real flag set, as -h lists them.
func TestCompletionHasEveryCommandAndFlag(t *testing.T) {
	for _, shell := range []string{"bash", "zsh"} {
		script, stderr, code := runMoat(t, "", "completion", shell)
		if code != 0 || script == "" {
			t.Fatalf("completion %s: exit %d, stderr %q", shell, code, stderr)
		}
		// branch is the line of the script that lists cmd's flags.
		branch := func(cmd string) []string {
			for _, line := range strings.Split(script, "\n") {
				if l := strings.TrimSpace(line); strings.HasPrefix(l, cmd+") flags=") {
					return strings.Fields(strings.NewReplacer(`"`, " ", "(", " ", ")", " ", ";", " ").Replace(strings.TrimPrefix(l, cmd+") flags=")))
				}
			}
			t.Errorf("%s: no flags for %s", shell, cmd)
			return nil
		}
		for _, c := range commands() {
			if !strings.Contains(script, c.name) {
				t.Errorf("%s: command %s missing", shell, c.name)
			}
			var want, old []string
			switch c.name {
			case "completion":
				continue
			case "image":
				for _, sub := range []string{"build", "status"} {
					w, o := helpFlags(t, "image", sub)
					want, old = append(want, w...), append(old, o...)
				}
			default:
				want, old = helpFlags(t, c.name)
			}
			got := branch(c.name)
			for _, f := range want {
				if !slices.Contains(got, f) {
					t.Errorf("%s: %s %s is not completed", shell, c.name, f)
				}
			}
			for _, f := range old {
				if slices.Contains(got, f) {
					t.Errorf("%s: %s completes %s, a deprecated spelling", shell, c.name, f)
				}
			}
		}
		for _, f := range []string{"--stdin", "--file", "--out", "--json", "-c", "--wall-time"} {
			if !slices.Contains(branch("run"), f) {
				t.Errorf("%s: run %s is not completed", shell, f)
			}
		}
	}
	if _, _, code := runMoat(t, "", "completion", "fish"); code != exitUsage {
		t.Errorf("completion fish: exit %d, want 2", code)
	}
}

// The bash script completes, run by bash itself.
func TestBashCompletionCompletes(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash here")
	}
	script, _, _ := runMoat(t, "", "completion", "bash")
	for _, tc := range []struct{ words, want string }{
		{"moat ses", "session"},
		{"moat --vers", "--version"},
		{"moat run --st", "--stdin"},
		{"moat run s.py --fo", "--force"},
		{"moat run --level gv", "gvisor"},
		{"moat session cr", "create"},
		{"moat session --json sn", "snapshot snapshots"},
		{"moat image st", "status"},
		{"moat completion z", "zsh"},
	} {
		words := strings.Fields(tc.words)
		cmd := exec.Command(bash, "--norc", "-c", script+`
COMP_WORDS=(`+tc.words+`)
COMP_CWORD=`+strconv.Itoa(len(words)-1)+`
_moat
echo "${COMPREPLY[*]}"`)
		out, err := cmd.CombinedOutput()
		if got := strings.TrimSpace(string(out)); err != nil || got != tc.want {
			t.Errorf("%q: completed %q (%v), want %q", tc.words, got, err, tc.want)
		}
	}
}

// The zsh script parses, and completes when zsh runs it with the
// completion system's functions stubbed (they print what they are given).
func TestZshCompletionCompletes(t *testing.T) {
	zsh, err := exec.LookPath("zsh")
	if err != nil {
		t.Skip("no zsh here (apt-get install zsh)")
	}
	script, _, _ := runMoat(t, "", "completion", "zsh")
	if out, err := exec.Command(zsh, "-n", "-c", script).CombinedOutput(); err != nil {
		t.Fatalf("zsh -n: %v: %s", err, out)
	}
	for _, tc := range []struct{ words, want string }{
		{"moat ses", "session:"},
		{"moat run --st", "--stdin"},
		{"moat run --level gv", "gvisor"},
		{"moat session cr", "create"},
		{"moat session create x", "FILES"},
		{"moat completion z", "zsh"},
	} {
		words := strings.Fields(tc.words)
		stubs := `compdef() { :; }; compadd() { [[ $1 == -- ]] && shift; print -l -- "$@"; }
_describe() { print -l -- "${(@P)${4}}"; }; _files() { print FILES; }
`
		prog := stubs + script + "\nwords=(" + tc.words + "); CURRENT=" + strconv.Itoa(len(words)) + "; PREFIX=" + words[len(words)-1] + "; _moat\n"
		out, err := exec.Command(zsh, "-f", "-c", prog).CombinedOutput()
		if err != nil || !slices.ContainsFunc(strings.Split(string(out), "\n"), func(l string) bool { return strings.HasPrefix(l, tc.want) }) {
			t.Errorf("%q: offered %q (%v), want %q among them", tc.words, out, err, tc.want)
		}
	}
}
