package main

import (
	"encoding/hex"
	"os/exec"
	"path"
	"strings"
	"testing"
)

// Every byte string reaches Python as itself: the code, its name and its
// argv are put in the prologue as bytes literals.
func TestPyBytesRoundTrip(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Fatal("python3 is what moat runs; setup.sh installs it")
	}
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	cases := [][]byte{nil, []byte(`'''"""\\'\`), []byte("line\nline\r\n\x00é"), all}
	var prog strings.Builder
	prog.WriteString("import sys\n")
	for _, c := range cases {
		prog.WriteString("print(" + pyBytes(c) + ".hex())\n")
	}
	out, err := exec.Command(python, "-I", "-c", prog.String()).CombinedOutput()
	if err != nil {
		t.Fatalf("python3: %v: %s", err, out)
	}
	got := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
	for i, c := range cases {
		if i >= len(got) || got[i] != hex.EncodeToString(c) {
			t.Errorf("case %d: python read %q, want %x", i, got[min(i, len(got)-1)], c)
		}
	}
}

// A --file destination that is accepted stays in the working directory.
func FuzzFileFlag(f *testing.F) {
	for _, s := range []string{"a", "a:b", "a:/b", "a:../b", "a:b/../../c", "x:y:z", ":", "a:./b/", "a:b/.."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var l fileList
		if l.Set(s) != nil {
			return
		}
		dst := path.Clean(l[0].dst)
		if strings.HasPrefix(dst, "/") || dst == ".." || strings.HasPrefix(dst, "../") || dst == "." || l[0].src == "" {
			t.Errorf("--file %q accepted as %+v", s, l[0])
		}
	})
}
