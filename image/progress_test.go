package image

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var plainLine = regexp.MustCompile(`^image: \[ *\d+\.\ds\] \S`)

// TestProgressPlain checks the plain mode, for logs and pipes: every event
// is a whole line with the elapsed time, nothing rewrites a line, and a bar
// prints only when its step passes a quarter.
func TestProgressPlain(t *testing.T) {
	var b bytes.Buffer
	p := NewProgress(&b, false)
	p.Say("step 1/3 debootstrap: fetching")
	p.Status("debootstrap: I: Retrieving %s", "InRelease")
	for i := int64(0); i <= 200; i++ {
		p.Bar("docker import", i<<20, 200<<20)
	}
	p.Clear()
	p.Say("done: %s", HumanSize(200<<20))
	out := b.String()
	if strings.ContainsAny(out, "\r\x1b") {
		t.Errorf("plain progress rewrites lines: %q", out)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	for _, l := range lines {
		if !plainLine.MatchString(l) {
			t.Errorf("line %q does not start with the elapsed time", l)
		}
	}
	var bars []string
	for _, l := range lines {
		if strings.Contains(l, "docker import:") {
			bars = append(bars, l[strings.Index(l, "] ")+2:])
		}
	}
	want := []string{
		"docker import:   0% (0 B of 200.0 MiB)", "docker import:  25% (50.0 MiB of 200.0 MiB)",
		"docker import:  50% (100.0 MiB of 200.0 MiB)", "docker import:  75% (150.0 MiB of 200.0 MiB)",
		"docker import: 100% (200.0 MiB of 200.0 MiB)",
	}
	if strings.Join(bars, "\n") != strings.Join(want, "\n") {
		t.Errorf("plain bar lines:\n%s\nwant\n%s", strings.Join(bars, "\n"), strings.Join(want, "\n"))
	}
	if len(lines) != 2+1+len(want) {
		t.Errorf("%d lines, want %d:\n%s", len(lines), 3+len(want), out)
	}
	var nilP *Progress
	nilP.Say("x")
	nilP.Status("x")
	nilP.Bar("x", 1, 2)
	nilP.Clear()
	NewProgress(nil, true).Say("x")
}

// TestProgressTerminal checks that on a terminal the lines within a step
// rewrite one status line, cut to fit, and that a step line or Clear
// replaces it.
func TestProgressTerminal(t *testing.T) {
	var b bytes.Buffer
	p := NewProgress(&b, true)
	p.Status("debootstrap: I: %s", strings.Repeat("x", 200))
	if s := b.String(); !strings.HasPrefix(s, "\r\x1b[K") || strings.Contains(s, "\n") || len([]rune(s)) > 104 {
		t.Errorf("status line %q: want one rewritten line of at most 100 characters", s)
	}
	b.Reset()
	p.Bar("docker import", 50, 100)
	if s := b.String(); !strings.HasPrefix(s, "\r\x1b[K") || !strings.Contains(s, "[###############...............]  50%") {
		t.Errorf("bar %q", s)
	}
	b.Reset()
	p.Say("step done")
	if s := b.String(); !strings.HasPrefix(s, "\r\x1b[K") || !strings.HasSuffix(s, "step done\n") {
		t.Errorf("a step line after a status line: %q", s)
	}
	b.Reset()
	p.Clear()
	if b.Len() != 0 {
		t.Errorf("Clear with no status line shown wrote %q", b.String())
	}
	p.Status("x")
	b.Reset()
	p.Clear()
	if b.String() != "\r\x1b[K" {
		t.Errorf("Clear wrote %q", b.String())
	}
}

// TestDebootstrapProgressPlain runs a stand-in for debootstrap through the
// function that shows its output, in plain mode: each of its lines, trimmed,
// becomes a line of the step with the elapsed time.
func TestDebootstrapProgressPlain(t *testing.T) {
	var b bytes.Buffer
	p := NewProgress(&b, false)
	root := t.TempDir()
	err := runDebootstrap(context.Background(), p, root, "/bin/sh", "-c", `printf 'I: Retrieving InRelease \n'; printf 'I: Extracting libc6...\n' >&2; echo; echo 'I: Base system installed successfully.'`)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"debootstrap: I: Retrieving InRelease", "debootstrap: I: Extracting libc6...", "debootstrap: I: Base system installed successfully."}
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	if len(lines) != len(want) {
		t.Fatalf("lines %q, want %q", lines, want)
	}
	for i, l := range lines {
		if !plainLine.MatchString(l) || !strings.HasSuffix(l, "] "+want[i]) {
			t.Errorf("line %q, want the elapsed time and %q", l, want[i])
		}
	}
	if strings.ContainsAny(b.String(), "\r\x1b") {
		t.Errorf("plain output rewrites lines: %q", b.String())
	}
	if err := runDebootstrap(context.Background(), p, root, "/bin/sh", "-c", "exit 3"); err == nil {
		t.Error("a failing debootstrap is no error")
	}
}

// TestTreeSize checks that the size shown during debootstrap leaves out
// what debootstrap mounts in the tree.
func TestTreeSize(t *testing.T) {
	root := t.TempDir()
	for name, size := range map[string]int{"usr/bin/python3": 100, "etc/hostname": 9, "proc/1/status": 5000, "sys/x": 7000, "dev/null": 0} {
		p := filepath.Join(root, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		os.WriteFile(p, make([]byte, size), 0o644)
	}
	// The root, usr, usr/bin, etc and their two files; nothing of proc,
	// sys and dev.
	if size, files := treeSize(root); size != 109 || files != 6 {
		t.Errorf("treeSize = %d bytes, %d entries; want 109, 6", size, files)
	}
}
