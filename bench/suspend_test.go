package bench

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// At the subprocess level (files only) a suspend measurement has the shape
// the README's table shows: every time measured, the 10 MiB file on disk,
// the memory not kept.
func TestMeasureSuspendSubprocess(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the subprocess level's strict hardening needs root (CI is root)")
	}
	old := settle
	settle = 10 * time.Millisecond
	defer func() { settle = old }()
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	for _, interp := range []bool{false, true} {
		c, err := MeasureSuspend(context.Background(), sb, interp, 2)
		if err != nil {
			t.Fatalf("interpreter %v: %v", interp, err)
		}
		t.Logf("%+v", c)
		if c.Level != moat.LevelSubprocess || c.Interpreter != interp || c.Runs != 2 || c.Memory {
			t.Errorf("interpreter %v: %+v", interp, c)
		}
		if c.Suspend <= 0 || c.Resume <= 0 || c.Fresh <= 0 || c.Ratio <= 0 {
			t.Errorf("interpreter %v: a time not measured: %+v", interp, c)
		}
		if c.StateBytes < SuspendFileSize || c.DiskBytes < SuspendFileSize {
			t.Errorf("interpreter %v: state %d bytes, %d on disk, want at least the %d-byte file", interp, c.StateBytes, c.DiskBytes, SuspendFileSize)
		}
	}
	left, _ := filepath.Glob(filepath.Join(os.TempDir(), "moat-bench-suspend-*"))
	if len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}
}

func TestMeasureSuspendRefuses(t *testing.T) {
	if _, err := MeasureSuspend(context.Background(), noSessions{}, false, 3); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("a sandbox without sessions: %v", err)
	}
}

func TestDiskUsageAndMedian(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(dir+"/a", make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(dir+"/a", dir+"/b"); err != nil {
		t.Fatal(err)
	}
	n, err := diskUsage(dir)
	if err != nil {
		t.Fatal(err)
	}
	if n < 1<<20 || n >= 2<<20 {
		t.Errorf("du of one 1 MiB file linked twice: %d", n)
	}
	if got := medianInt([]int64{5, 1, 3}); got != 3 {
		t.Errorf("median of 5 1 3: %d", got)
	}
	if got := medianInt([]int64{4, 1, 3, 2}); got != 2 {
		t.Errorf("median of 4 1 3 2: %d", got)
	}
}
