package container_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/sandboxtest"
)

// needRunc skips t when the runc driver cannot be tested here (not root,
// or the shared image is not built), except in CI, where it must be.
func needRunc(t testing.TB) {
	t.Helper()
	if err := prepareEngine(); err != nil && os.Getenv("CI") != "true" {
		t.Skipf("skipping the runc driver: %v", err)
	}
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("the runc driver needs root, and CI must test it")
		}
		t.Skip("the runc driver needs root")
	}
}

func runcFactory(t *testing.T, l moat.Limits) moat.Sandbox {
	sb, err := moatcontainer.New(moatcontainer.Config{Limits: l, Driver: moatcontainer.DriverRunc})
	if err != nil {
		t.Fatalf("container.New with the runc driver: %v", err)
	}
	return sb
}

func runcLeftovers() []string {
	return append(leftovers(), moatcontainer.RuncLeftovers()...)
}

func TestRuncSmoke(t *testing.T) {
	needRunc(t)
	sb := runcFactory(t, moat.Limits{})
	defer sb.Close()
	t.Log(sb.(moat.Describer).Describe())
	for i := 0; i < 3; i++ {
		start := time.Now()
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%v %q %q %d %v", time.Since(start), res.Stdout, res.Stderr, res.ExitCode, res.Notes)
		if strings.TrimSpace(string(res.Stdout)) != "1" {
			t.Fatalf("%+v", res)
		}
	}
}

func TestRuncConformance(t *testing.T) {
	needRunc(t)
	sandboxtest.Run(t, runcFactory, sandboxtest.Options{Leftovers: runcLeftovers})
}
