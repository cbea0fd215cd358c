package main

import (
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The driver imports neither traceback nor linecache (nor re, which they
// pull in) at its start, which under TCG costs seconds on an interpreter
// session's path; yet every traceback shows the lines of the runs' code:
// the driver's own, one the code prints in the run that first imports
// traceback, and one through a function an earlier run defined.
func TestDriverLazyTraceback(t *testing.T) {
	py := hostPython(t)
	dir := t.TempDir()
	driver := filepath.Join(dir, "driver.py")
	if err := os.WriteFile(driver, []byte(driverSource), 0o444); err != nil {
		t.Fatal(err)
	}
	inR, inW, _ := os.Pipe()
	outR, outW, _ := os.Pipe()
	cmd := exec.Command(py, "-S", driver) // -S: no site, whose .pth files may import anything
	cmd.Dir = dir
	cmd.Env = []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.ExtraFiles = []*os.File{inR, outW}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	inR.Close()
	outW.Close()
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	var h [1]byte
	if _, err := io.ReadFull(outR, h[:]); err != nil || h[0] != 'H' {
		t.Fatalf("ready: %q %v", h, err)
	}
	marker := func(c byte) string { return strings.Repeat(string(c), 32) }
	run := func(m, code string) {
		t.Helper()
		rec := append([]byte("R"+m), binary.BigEndian.AppendUint32(nil, uint32(len(code)))...)
		inW.Write(append(rec, code...))
		var b [34]byte
		if _, err := io.ReadFull(outR, b[:]); err != nil || b[0] != 'X' || string(b[1:33]) != m {
			t.Fatalf("report: %q %v", b, err)
		}
	}
	run(marker('1'), "import sys\nprint(sorted(m for m in ('traceback', 'linecache', 're', 'tokenize') if m in sys.modules))\n"+
		"def deep():\n    raise KeyError('from run one')\n")
	run(marker('2'), "raise ValueError('the driver prints me')\n")
	run(marker('3'), "import traceback\ntry:\n    deep()\nexcept KeyError:\n    traceback.print_exc()\ntry:\n    1/0  # the code's own\nexcept ZeroDivisionError:\n    traceback.print_exc()\n")
	inW.Close()
	cmd.Wait()
	if !strings.HasPrefix(stdout.String(), "[]\n") {
		t.Errorf("stdout %q: want no traceback, linecache, re or tokenize imported before the code's", stdout.String())
	}
	e := stderr.String()
	for _, line := range []string{"raise ValueError('the driver prints me')", "raise KeyError('from run one')", "deep()", "1/0  # the code's own"} {
		if !strings.Contains(e, "    "+line+"\n") {
			t.Errorf("stderr %q: no traceback line %q", e, line)
		}
	}
	if strings.Contains(e, "_moat_driver") || strings.Contains(e, "exec_and_fill") {
		t.Errorf("stderr %q shows the driver's frames", e)
	}
}
