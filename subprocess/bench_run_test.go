package subprocess

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkPooledRun times the steps of a one-shot run on a pooled
// instance (Prepare is done before the timer runs, as the pool does it off
// the run's path), against python3 itself running the same file through
// the same bootstrap with nothing of moat around it ("python3-floor").
// Each step is reported as its own metric, in µs per run:
//
//	write-µs     Start: the code file written into the run's directory
//	handoff-µs   Start: the output copiers and the CPU watch started, the
//	             file's name handed to python3
//	report-µs    python3 runs the code and ends; the reaper reports
//	output-µs    the end of the output passed on
//	evidence-µs  the evidence: cgroup, files at the limit, free space
//
// The steps after Start are process.Wait's, taken one by one.
func BenchmarkPooledRun(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("strict hardening needs root")
	}
	code := []byte("print(1)")
	b.Run("moat", func(b *testing.B) {
		sb, err := New(Config{Warm: -1})
		if err != nil {
			b.Fatal(err)
		}
		defer sb.Close()
		var write, handoff, report, output, evidence time.Duration
		var parts [4]time.Duration
		for b.Loop() {
			b.StopTimer()
			inst, err := sb.b.Prepare(context.Background())
			if err != nil {
				b.Fatal(err)
			}
			in := inst.(*instance)
			// Let python3 reach its wait, as a pooled one has.
			waitReading(b, in.h.cmd.Process.Pid, true)
			var stdout, stderr bytes.Buffer
			b.StartTimer()

			t0 := time.Now()
			if err := writeNewFile(in.dir, codeName, code, in.uid, in.gid); err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			p := &process{b: in.b, h: in.h, group: in.group, dir: in.dir, mounted: in.mounted, net: in.net}
			in.h = nil
			p.watch(&stdout, &stderr)
			if err := p.h.sendCode(filepath.Join(in.dir, codeName)); err != nil {
				b.Fatal(err)
			}
			in.started, in.p = true, p
			t2 := time.Now()
			status := readReport(p.h.status)
			if _, ok := parseStatus(status); ok {
				p.reported.Store(true)
			}
			p.stopCPU()
			t3 := time.Now()
			<-p.copied
			<-p.copied
			t4 := time.Now()
			ev, err := p.evidence(nil, status)
			t5 := time.Now()
			p.h.closeFiles()
			if os.Getenv("MOAT_BENCH_PARTS") != "" {
				// The evidence's parts, again, one by one.
				a := time.Now()
				p.group.KillBut(p.h.cmd.Process.Pid)
				c := time.Now()
				p.group.Events()
				d := time.Now()
				fileAtLimit(p.dir, p.b.limits.FileSize, nil)
				e := time.Now()
				diskFull(p.dir)
				f := time.Now()
				parts[0] += c.Sub(a)
				parts[1] += d.Sub(c)
				parts[2] += e.Sub(d)
				parts[3] += f.Sub(e)
			}

			b.StopTimer()
			if err != nil || !ev.Exited || stdout.String() != "1\n" {
				b.Fatalf("%v %+v %q %q", err, ev, stdout.String(), stderr.String())
			}
			write += t1.Sub(t0)
			handoff += t2.Sub(t1)
			report += t3.Sub(t2)
			output += t4.Sub(t3)
			evidence += t5.Sub(t4)
			in.Discard()
			b.StartTimer()
		}
		n := float64(b.N)
		for _, m := range []struct {
			d    time.Duration
			name string
		}{{write, "write-µs"}, {handoff, "handoff-µs"}, {report, "report-µs"}, {output, "output-µs"}, {evidence, "evidence-µs"},
			{parts[0], "killbut-µs"}, {parts[1], "events-µs"}, {parts[2], "files-µs"}, {parts[3], "statfs-µs"}} {
			b.ReportMetric(float64(m.d.Microseconds())/n, m.name)
		}
	})
	b.Run("python3-floor", func(b *testing.B) {
		dir := b.TempDir()
		file := filepath.Join(dir, codeName)
		if err := os.WriteFile(file, code, 0o400); err != nil {
			b.Fatal(err)
		}
		python, err := findPython("")
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			b.StopTimer()
			r, w, err := os.Pipe()
			if err != nil {
				b.Fatal(err)
			}
			var stdout bytes.Buffer
			cmd := exec.Command(python, prestartArgs(file)[1:]...)
			cmd.Env, cmd.Dir, cmd.Stdout, cmd.ExtraFiles = []string{}, dir, &stdout, []*os.File{r}
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			r.Close()
			waitReading(b, cmd.Process.Pid, false)
			b.StartTimer()
			w.Write([]byte(file))
			w.Close()
			err = cmd.Wait()
			b.StopTimer()
			if err != nil || stdout.String() != "1\n" {
				b.Fatalf("%v %q", err, stdout.String())
			}
			b.StartTimer()
		}
	})
}

// waitReading waits until python3 (pid, or pid's only child) is blocked in
// read(2) on its fd 3, the bootstrap's wait for its code.
func waitReading(b *testing.B, pid int, child bool) {
	b.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		p := pid
		if child {
			kids, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + strconv.Itoa(pid) + "/children")
			f := strings.Fields(string(kids))
			if err != nil || len(f) != 1 {
				continue
			}
			p, _ = strconv.Atoi(f[0])
		}
		sc, _ := os.ReadFile("/proc/" + strconv.Itoa(p) + "/syscall")
		if comm, _ := os.ReadFile("/proc/" + strconv.Itoa(p) + "/comm"); strings.HasPrefix(string(comm), "python3") && strings.HasPrefix(string(sc), "0 0x3 ") {
			return
		}
	}
	b.Fatal("python3 did not reach its wait for the code")
}
