package container_test

import (
	"errors"
	"io"
	"log/slog"
	"testing"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/sandboxtest"
)

// TestRuncRecycled runs the shared recycling suite with the runc driver.
func TestRuncRecycled(t *testing.T) {
	needRunc(t)
	sandboxtest.RunRecycled(t, func(t *testing.T, l moat.Limits, logs io.Writer) moat.Sandbox {
		sb, err := moatcontainer.New(moatcontainer.Config{Limits: l, Driver: moatcontainer.DriverRunc, Recycle: true,
			Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		if err != nil {
			t.Fatalf("container.New with the runc driver, recycling: %v", err)
		}
		return sb
	}, sandboxtest.Options{Leftovers: runcLeftovers})
}

// TestRecycleNeedsRunc checks that recycling with the Docker driver is
// refused, not silently off.
func TestRecycleNeedsRunc(t *testing.T) {
	_, err := moatcontainer.New(moatcontainer.Config{Recycle: true})
	if err == nil || !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("container.New with recycle and the Docker driver: %v, want moat.ErrInvalid", err)
	}
}
