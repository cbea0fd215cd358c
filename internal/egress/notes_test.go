package egress

import (
	"fmt"
	"strings"
	"testing"
)

func TestNotes(t *testing.T) {
	var tl tally
	if n := tl.notes(); n != nil {
		t.Fatalf("no decisions: %q", n)
	}
	for i := 0; i < 3; i++ {
		tl.add(decision{host: "pypi.test", port: 443, allowed: true})
	}
	tl.add(decision{host: "files.test", port: 443, allowed: true, failed: "unreachable"})
	tl.add(decision{host: "evil.test", port: 443, why: "not allowed"})
	tl.add(decision{host: "evil.test", port: 443, why: "not allowed"})
	tl.add(decision{host: "10.0.0.1", port: 80, why: "an IP address"})
	want := "network: allowed pypi.test:443 (3 connections), files.test:443 (1 connection, 1 failed); denied evil.test:443 (not allowed, 2 times), 10.0.0.1:80 (an IP address)"
	if n := tl.notes(); len(n) != 1 || n[0] != want {
		t.Errorf("notes %q\nwant %q", n, want)
	}
	if n := tl.notes(); n != nil {
		t.Errorf("notes after notes: %q", n)
	}
}

// TestNotesBounded: a sandbox that tries many hosts gets a note of bounded
// length, the rest counted.
func TestNotesBounded(t *testing.T) {
	var tl tally
	for i := 0; i < 1000; i++ {
		tl.add(decision{host: fmt.Sprintf("h%d.%s.test", i, strings.Repeat("x", 60)), port: 443, why: "not allowed"})
	}
	tl.add(decision{host: strings.Repeat("\x1b[31m", 50), port: 1, why: "not allowed"})
	n := tl.notes()
	if len(n) != 1 || !strings.HasSuffix(n[0], fmt.Sprintf("+%d more", 1001-maxNoteEntries)) {
		t.Fatalf("notes %q", n)
	}
	if len(n[0]) > 2000 {
		t.Errorf("a note of %d bytes", len(n[0]))
	}
	var tl2 tally
	tl2.add(decision{host: "a\x1b[31mb\n", port: 1, why: "not allowed"})
	if n := tl2.notes()[0]; strings.ContainsAny(n, "\x1b\n") {
		t.Errorf("a control character in the note: %q", n)
	}
}
