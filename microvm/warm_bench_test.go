package microvm

import (
	"os"
	"testing"

	"github.com/moatsandbox/moat/sandboxtest"
)

// BenchmarkWarm times the warm path: a run that finds its VM restored from
// the template and refreshed, its python3 started. It says in its name
// which accelerator ran (KVM or TCG, as the sandbox's Describe does):
//
//	go test -run '^$' -bench Warm -benchtime 10x ./microvm
func BenchmarkWarm(b *testing.B) {
	cfg := Config{}.withDefaults()
	if _, err := os.Stat(cfg.QEMU); err != nil || os.Geteuid() != 0 {
		b.Skip("the microvm level cannot run here (root, QEMU and the guest kernel: scripts/setup-microvm.sh)")
	}
	if _, err := findKernel(cfg.StateDir, ""); err != nil {
		b.Skip(err)
	}
	sb, err := New(Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	b.Logf("%s", sb.Describe())
	sandboxtest.BenchmarkWarm(b, sb)
}
