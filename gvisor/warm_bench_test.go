package gvisor_test

import (
	"context"
	"testing"

	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/sandboxtest"
)

// BenchmarkWarm times the warm path: a run that finds its gVisor sandbox
// booted, its python3 waiting for the code:
//
//	go test -run '^$' -bench Warm -benchtime 10x ./gvisor
func BenchmarkWarm(b *testing.B) {
	cfg := gvisor.Config{}
	if a := gvisor.Check(context.Background(), cfg); !a.Available {
		b.Skipf("the gvisor level cannot run here: %s", a.Reason)
	}
	sb, err := gvisor.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	sandboxtest.BenchmarkWarm(b, sb)
}
