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
)

// startTestZygote starts zygoteSource under the host's python3 with the
// four descriptors the agent gives it (the start, the ready pipe, the
// driver's records and reports), waits until it is ready and returns it
// with the agent's ends: start, records, reports.
func startTestZygote(t *testing.T, dir string, stdout, stderr io.Writer) (cmd *exec.Cmd, start, records, reports *os.File) {
	t.Helper()
	py := hostPython(t)
	zygote := filepath.Join(dir, "zygote.py")
	if err := os.WriteFile(zygote, []byte(zygoteSource), 0o444); err != nil {
		t.Fatal(err)
	}
	goR, goW, _ := os.Pipe()
	readyR, readyW, _ := os.Pipe()
	recR, recW, _ := os.Pipe()
	repR, repW, _ := os.Pipe()
	cmd = exec.Command(py, zygote)
	cmd.Dir = dir
	cmd.Env = []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.ExtraFiles = []*os.File{goR, readyW, recR, repW}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	for _, f := range []*os.File{goR, readyW, recR, repW} {
		f.Close()
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	readyR.SetReadDeadline(time.Now().Add(time.Minute))
	if _, err := readyR.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("the zygote was not ready: %v", err)
	}
	readyR.Close()
	return cmd, goW, recW, repR
}

// A run's code sees none of the zygote's descriptors, the driver's pipes
// (5 and 6) included: the code cannot write reports to the agent.
func TestZygoteRunClosesDriverPipes(t *testing.T) {
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	cmd, start, records, reports := startTestZygote(t, dir, &stdout, &stderr)
	defer records.Close()
	defer reports.Close()
	code := filepath.Join(dir, "main.py")
	os.WriteFile(code, []byte("import os\nfor fd in 3, 4, 5, 6:\n    try:\n        os.fstat(fd)\n        print(fd, 'open')\n    except OSError as e:\n        print(fd, e.errno)\n"), 0o444)
	start.WriteString("run\x00" + code)
	start.Close()
	cmd.Wait()
	if want := "3 9\n4 9\n5 9\n6 9\n"; stdout.String() != want {
		t.Errorf("the code saw its descriptors as %q (stderr %q), want every one closed (EBADF)", stdout.String(), stderr.String())
	}
	// Its ends of the driver's pipes are closed: the agent's read end
	// sees the end.
	reports.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := reports.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Errorf("the reports pipe: %d bytes, %v; want its end", n, err)
	}
}

// A start of another mode than run or driver runs nothing.
func TestZygoteUnknownMode(t *testing.T) {
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	cmd, start, records, reports := startTestZygote(t, dir, &stdout, &stderr)
	defer records.Close()
	defer reports.Close()
	code := filepath.Join(dir, "main.py")
	os.WriteFile(code, []byte("print('ran')\n"), 0o444)
	start.WriteString("what\x00" + code)
	start.Close()
	cmd.Wait()
	if cmd.ProcessState.ExitCode() != 2 || stdout.Len() != 0 {
		t.Errorf("exit %d, stdout %q: want exit 2 and nothing run", cmd.ProcessState.ExitCode(), stdout.String())
	}
}

// A zygote handed the driver is a session's interpreter (as
// interpFromZygote makes it): it says it is ready on the reports pipe,
// keeps its globals from run to run, reports each run's status and marks
// where each run's output ends, as TestDriver's python3 running the driver
// itself does; the code sees the driver's descriptors 3 and 4 only.
func TestZygoteAsDriver(t *testing.T) {
	dir := t.TempDir()
	driver := filepath.Join(dir, "driver.py")
	if err := os.WriteFile(driver, []byte(driverSource), 0o444); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	cmd, start, inW, outR := startTestZygote(t, dir, &stdout, &stderr)
	start.WriteString("driver\x00" + driver + "\x00MOAT_TEST=from the start")
	start.Close()
	outR.SetReadDeadline(time.Now().Add(time.Minute))
	var h [1]byte
	if _, err := io.ReadFull(outR, h[:]); err != nil || h[0] != 'H' {
		t.Fatalf("ready: %q %v (stderr %q)", h, err, stderr.String())
	}
	run := func(marker, code string) int {
		t.Helper()
		rec := append([]byte("R"+marker), binary.BigEndian.AppendUint32(nil, uint32(len(code)))...)
		inW.Write(append(rec, code...))
		var b [34]byte
		if _, err := io.ReadFull(outR, b[:]); err != nil || b[0] != 'X' || string(b[1:33]) != marker {
			t.Fatalf("report: %q %v (stderr %q)", b, err, stderr.String())
		}
		return int(b[33])
	}
	m1, m2, m3, m4 := strings.Repeat("1", 32), strings.Repeat("2", 32), strings.Repeat("3", 32), strings.Repeat("4", 32)
	if st := run(m1, "x = 41\nimport json, os\nprint('one', os.environ['MOAT_TEST'])"); st != 0 {
		t.Errorf("run 1: status %d", st)
	}
	if st := run(m2, "print(json.dumps(x + 1))\nraise ValueError('bad')"); st != 1 {
		t.Errorf("run 2: status %d, want 1", st)
	}
	if st := run(m3, "for fd in 3, 4, 5, 6:\n    try:\n        os.fstat(fd)\n        print(fd, 'open')\n    except OSError as e:\n        print(fd, e.errno)\n"); st != 0 {
		t.Errorf("run 3: status %d", st)
	}
	if st := run(m4, "import sys\nsys.exit(7)"); st != 7 {
		t.Errorf("run 4: status %d, want 7", st)
	}
	inW.Close()
	cmd.Wait()
	if want := "one from the start\n" + m1 + "42\n" + m2 + "3 open\n4 open\n5 9\n6 9\n" + m3 + m4; stdout.String() != want {
		t.Errorf("stdout %q, want %q", stdout.String(), want)
	}
	if e := stderr.String(); !strings.HasPrefix(e, m1) || !strings.Contains(e, "ValueError: bad") ||
		strings.Contains(e, "_moat_driver") || strings.Contains(e, "_moat_main") {
		t.Errorf("stderr %q: want run 1's marker, then run 2's traceback without the driver's or the zygote's frames", e)
	}
}
