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
	"time"

	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// The splitter forwards a run's output up to its marker, wherever reads cut
// it, and nothing between runs.
func TestSplitter(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	s := &splitter{out: rec, kind: wire.KindStdout, f: r, eof: make(chan struct{})}
	go s.loop()
	marker := []byte("0123456789abcdef0123456789abcdef")
	got := func() string {
		var b []byte
		for _, f := range rec.take() {
			if f.k != wire.KindStdout {
				t.Fatalf("a %s frame", f.k)
			}
			b = append(b, f.p...)
		}
		return string(b)
	}

	w.Write([]byte("before any run\n"))
	time.Sleep(20 * time.Millisecond)
	s.arm(marker)
	// Output that cannot begin the marker goes at once, not at the run's
	// end.
	w.Write([]byte("ready\n"))
	deadline := time.Now().Add(5 * time.Second)
	for g := got(); g != "ready\n"; g += got() {
		if time.Now().After(deadline) {
			t.Fatalf("output held back: %q so far", g)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The marker cut in three reads.
	w.Write([]byte("out of run 1, "))
	time.Sleep(20 * time.Millisecond)
	w.Write(append([]byte("then "), marker[:10]...))
	time.Sleep(20 * time.Millisecond)
	w.Write(marker[10:20])
	time.Sleep(20 * time.Millisecond)
	w.Write(append(marker[20:], "after the marker"...))
	s.wait(5 * time.Second)
	if g := got(); g != "out of run 1, then " {
		t.Errorf("run 1 forwarded %q", g)
	}
	w.Write([]byte("between runs"))
	time.Sleep(20 * time.Millisecond)
	s.arm([]byte("fedcba9876543210fedcba9876543210"))
	big := bytes.Repeat([]byte("y"), 3*wire.MaxReport)
	w.Write(big)
	w.Close() // the interpreter died: what came is the run's
	s.wait(5 * time.Second)
	if g := got(); g != string(big) {
		t.Errorf("run 2 forwarded %d bytes, want %d", len(g), len(big))
	}
}

// The driver keeps its globals from run to run, reports each run's status
// and marks where each run's output ends, under the host's python3.
func TestDriver(t *testing.T) {
	py := hostPython(t)
	dir := t.TempDir()
	driver := filepath.Join(dir, "driver.py")
	if err := os.WriteFile(driver, []byte(driverSource), 0o444); err != nil {
		t.Fatal(err)
	}
	inR, inW, _ := os.Pipe()
	outR, outW, _ := os.Pipe()
	cmd := exec.Command(py, driver)
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
	run := func(marker, code string) int {
		t.Helper()
		rec := append([]byte("R"+marker), binary.BigEndian.AppendUint32(nil, uint32(len(code)))...)
		inW.Write(append(rec, code...))
		var b [34]byte
		if _, err := io.ReadFull(outR, b[:]); err != nil || b[0] != 'X' || string(b[1:33]) != marker {
			t.Fatalf("report: %q %v", b, err)
		}
		return int(b[33])
	}
	m1, m2, m3 := strings.Repeat("1", 32), strings.Repeat("2", 32), strings.Repeat("3", 32)
	if st := run(m1, "x = 41\nimport json\nprint('one')"); st != 0 {
		t.Errorf("run 1: status %d", st)
	}
	if st := run(m2, "print(json.dumps(x + 1))\nraise ValueError('bad')"); st != 1 {
		t.Errorf("run 2: status %d, want 1", st)
	}
	if st := run(m3, "import sys\nsys.exit(7)"); st != 7 {
		t.Errorf("run 3: status %d, want 7", st)
	}
	inW.Close()
	cmd.Wait()
	if want := "one\n" + m1 + "42\n" + m2 + m3; stdout.String() != want {
		t.Errorf("stdout %q, want %q", stdout.String(), want)
	}
	if e := stderr.String(); !strings.HasPrefix(e, m1) || !strings.Contains(e, "ValueError: bad") || strings.Contains(e, "_moat_driver") {
		t.Errorf("stderr %q: want run 1's marker, then run 2's traceback without the driver's frame", e)
	}
}
