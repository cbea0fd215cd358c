package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// kvmDevice is the host's KVM device.
const kvmDevice = "/dev/kvm"

// probeTimeout bounds the boot probe under KVM. A guest that KVM can run
// is ready in well under a second; a stock kernel on a nested hypervisor
// that only boots kernels built for it (PVM) hangs in early boot.
const probeTimeout = 20 * time.Second

// accelProbe is what the boot probe found, cached in
// STATE/microvm/accel/KEY.json.
type accelProbe struct {
	KVM     bool      `json:"kvm"`
	Reason  string    `json:"reason"` // why not, or how fast it booted
	Checked time.Time `json:"checked"`
}

// probeKVM says whether spec's guest boots under KVM here, booting it once
// (as root: the probe runs moat's own agent, never user code) and caching
// the answer under a key of the VMM, the kernel, the initramfs and the
// host's kernel.
func probeKVM(ctx context.Context, stateDir string, vmm *QEMU, spec VMSpec) accelProbe {
	if _, err := os.Stat(kvmDevice); err != nil {
		return accelProbe{Reason: kvmDevice + " does not exist (no hardware virtualization, or the kvm module is not loaded)"}
	}
	f, err := os.OpenFile(kvmDevice, os.O_RDWR, 0)
	if err != nil {
		return accelProbe{Reason: "cannot open " + kvmDevice + ": " + err.Error()}
	}
	f.Close()
	var uts unix.Utsname
	unix.Uname(&uts)
	h := sha256.New()
	fmt.Fprintf(h, "probe v1\nvmm=%s\nhost=%s\ncmdline=%s\n", vmm.Name(), unix.ByteSliceToString(uts.Release[:]), spec.Cmdline)
	if err := fileKey(h, spec.Kernel, spec.Initrd, spec.Disk); err != nil {
		return accelProbe{Reason: err.Error()}
	}
	cache := filepath.Join(stateDir, "microvm", "accel", hex.EncodeToString(h.Sum(nil))[:16]+".json")
	if b, err := os.ReadFile(cache); err == nil {
		var p accelProbe
		if json.Unmarshal(b, &p) == nil {
			return p
		}
	}
	var p accelProbe
	unlock, err := lockFile(cache + ".lock")
	if err == nil {
		defer unlock()
		if b, err := os.ReadFile(cache); err == nil && json.Unmarshal(b, &p) == nil {
			return p
		}
	}
	root := *vmm
	root.Credentials = nil
	spec.Accel = AccelKVM
	start := time.Now()
	vm, _, err := bootToHello(ctx, &root, spec, probeTimeout)
	if err != nil {
		p = accelProbe{Reason: fmt.Sprintf("the guest kernel did not boot under KVM (%v); a nested KVM that boots only kernels built for it (PVM) does this", err)}
	} else {
		vm.Kill()
		p = accelProbe{KVM: true, Reason: fmt.Sprintf("booted under KVM in %v", time.Since(start).Round(time.Millisecond))}
	}
	if ctx.Err() != nil {
		return p // interrupted: do not cache
	}
	p.Checked = time.Now().UTC()
	if b, err := json.Marshal(p); err == nil {
		os.MkdirAll(filepath.Dir(cache), 0o755)
		os.WriteFile(cache, b, 0o644)
	}
	return p
}

// kvmGroup returns the group that may use /dev/kvm, or an error saying why
// an unprivileged VMM cannot.
func kvmGroup() (uint32, error) {
	st, err := os.Stat(kvmDevice)
	if err != nil {
		return 0, err
	}
	sys := st.Sys().(*syscall.Stat_t)
	if st.Mode().Perm()&0o006 == 0o006 {
		return sys.Gid, nil
	}
	if st.Mode().Perm()&0o060 != 0o060 || sys.Gid == 0 {
		return 0, fmt.Errorf("%s is mode %v, group %d: the unprivileged uid QEMU runs as cannot use it (give it a kvm group with mode 0660)", kvmDevice, st.Mode().Perm(), sys.Gid)
	}
	return sys.Gid, nil
}
