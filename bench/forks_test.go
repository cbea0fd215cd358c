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

// At the subprocess level (files only) forks of one state each see its
// file and not each other's writes (MeasureForks errs otherwise), and
// every figure but the noisy host growth is measured.
func TestMeasureForksSubprocess(t *testing.T) {
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
		c, err := MeasureForks(context.Background(), sb, interp, 3)
		if err != nil {
			t.Fatalf("interpreter %v: %v", interp, err)
		}
		t.Logf("%+v", c)
		if c.Level != moat.LevelSubprocess || c.Interpreter != interp || c.N != 3 || c.Memory {
			t.Errorf("interpreter %v: %+v", interp, c)
		}
		if c.ForkStart <= 0 || c.FreshStart <= 0 || c.StateDisk < forkFileSize || c.SuspendedFit <= 0 {
			t.Errorf("interpreter %v: a figure not measured: %+v", interp, c)
		}
	}
	left, _ := filepath.Glob(filepath.Join(os.TempDir(), "moat-bench-forks-*"))
	if len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}
}

func TestMeasureForksRefuses(t *testing.T) {
	if _, err := MeasureForks(context.Background(), noSessions{}, false, 3); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("a sandbox without sessions: %v", err)
	}
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Skip(err)
	}
	defer sb.Close()
	if _, err := MeasureForks(context.Background(), sb, false, 0); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("n=0: %v", err)
	}
}
