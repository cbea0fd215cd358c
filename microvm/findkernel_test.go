package microvm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeKernel makes DIR/boot/vmlinuz-REL and a config with every option a
// guest needs built in, as kernel/build.sh installs them.
func fakeKernel(t *testing.T, dir, rel string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, "boot"), 0o755); err != nil {
		t.Fatal(err)
	}
	config := "#\n"
	for _, m := range append(guestModules, netModules...) {
		config += m.option + "=y\n"
	}
	config += "CONFIG_ACPI=y\n"
	if err := os.WriteFile(filepath.Join(dir, "boot", "config-"+rel), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "boot", "vmlinuz-"+rel), []byte("not a kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// A kernel the set-up is still making (NAME.tmp, renamed into place once
// complete) is never chosen, though moat-* kernels are preferred and
// "moat-6.1.tmp" sorts after "moat-6.1"; it is listed as ignored, and the
// error says so when it is all there is.
func TestFindKernelIgnoresUnfinished(t *testing.T) {
	state := t.TempDir()
	kernels := filepath.Join(state, "microvm", "kernels")
	fakeKernel(t, filepath.Join(kernels, "moat-6.1.tmp"), "6.1.999")
	fakeKernel(t, filepath.Join(kernels, ".moat-6.2"), "6.2.999")

	_, err := findKernel(state, "")
	if err == nil || !strings.Contains(err.Error(), "moat-6.1.tmp") || !strings.Contains(err.Error(), "unfinished") {
		t.Fatalf("only unfinished kernels: err = %v, want one that names moat-6.1.tmp as unfinished", err)
	}

	fakeKernel(t, filepath.Join(kernels, "6.1.0-99-cloud-amd64"), "6.1.0-99-cloud-amd64")
	k, err := findKernel(state, "")
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(kernels, "6.1.0-99-cloud-amd64", "boot", "vmlinuz-6.1.0-99-cloud-amd64"); k.Image != want {
		t.Errorf("chose %s, want %s", k.Image, want)
	}
	if strings.Join(k.Ignored, ",") != ".moat-6.2,moat-6.1.tmp" {
		t.Errorf("Ignored = %v", k.Ignored)
	}

	// Once renamed into place it is the one.
	if err := os.Rename(filepath.Join(kernels, "moat-6.1.tmp"), filepath.Join(kernels, "moat-6.1")); err != nil {
		t.Fatal(err)
	}
	if k, err = findKernel(state, ""); err != nil || !strings.Contains(k.Image, "moat-6.1/boot/vmlinuz-6.1.999") {
		t.Errorf("after the rename: %v, %v", k, err)
	}

	// A directory the operator names is theirs: used as it is.
	if k, err = findKernel(state, filepath.Join(kernels, ".moat-6.2")); err != nil || len(k.Ignored) != 0 {
		t.Errorf("named directory: %v, %v", k, err)
	}
}

// Check names the kernel it chose even when a later step fails, and the
// kernels it passed over as unfinished.
func TestCheckSaysWhichKernel(t *testing.T) {
	cfg := requireVMs(t)
	state := t.TempDir()
	kernels := filepath.Join(state, "microvm", "kernels")
	fakeKernel(t, filepath.Join(kernels, "moat-6.1.tmp"), "6.1.999")
	fakeKernel(t, filepath.Join(kernels, "6.1.0-99-cloud-amd64"), "6.1.0-99-cloud-amd64")
	cfg.StateDir = state
	cfg.Agent = filepath.Join(state, "no-such-agent") // fails after the kernel is chosen
	a := Check(t.Context(), cfg)
	if a.Available {
		t.Fatalf("available without an agent: %+v", a)
	}
	details := strings.Join(a.Details, "\n")
	if !strings.Contains(details, "kernel: "+filepath.Join(kernels, "6.1.0-99-cloud-amd64", "boot", "vmlinuz-6.1.0-99-cloud-amd64")) ||
		!strings.Contains(details, "kernel ignored, unfinished: moat-6.1.tmp") {
		t.Errorf("details do not say which kernel: %q (reason %q)", a.Details, a.Reason)
	}
}
