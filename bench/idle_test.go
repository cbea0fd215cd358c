package bench

import (
	"context"
	"errors"
	"testing"

	"github.com/moatsandbox/moat"
)

func TestUsedMemory(t *testing.T) {
	used, err := usedMemory()
	if err != nil {
		t.Fatal(err)
	}
	if used <= 0 {
		t.Fatalf("used memory %d", used)
	}
}

type noSessions struct{ moat.Sandbox }

func (noSessions) Level() moat.Level { return moat.LevelGVisor }

func TestMeasureIdleRefuses(t *testing.T) {
	if _, err := MeasureIdle(context.Background(), noSessions{}, 3, false); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("a sandbox without sessions: %v", err)
	}
}
