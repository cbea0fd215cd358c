package microvm

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/moatsandbox/moat/internal/uidpool"
)

// noSaveArg on the guest's command line tells the agent that the VM is
// never saved (a cold sandbox's): it skips the python3 start at boot that
// fills the page cache for a template's copies, since the Refresh starts
// the run's python3 anyway.
const noSaveArg = "moat.nosave"

// kernelCmdline is the guest's command line. Under TCG the guest's TSC
// ticks at the host's rate, tscKHz, which the guest is told: it sometimes
// fails to calibrate it against the emulated PIT, and a wrong rate makes
// its clock run fast or slow.
func kernelCmdline(a Accel, tscKHz int64) string {
	c := "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init random.trust_cpu=on"
	if a == AccelTCG {
		c += fmt.Sprintf(" tsc_early_khz=%d tsc=reliable", tscKHz)
	}
	return c
}

// prepare finds or builds everything a VM boots from and chooses the
// accelerator.
func prepare(ctx context.Context, cfg Config, log *slog.Logger) (*backend, error) {
	if runtime.GOARCH != "amd64" {
		return nil, unavailable("the microvm level is built for x86-64 hosts only", "", nil)
	}
	if os.Geteuid() != 0 {
		return nil, unavailable(fmt.Sprintf("not root (uid %d): the level runs each QEMU as a uid of its own", os.Geteuid()), "run moat as root", nil)
	}
	s := &backend{cfg: cfg, limits: cfg.Limits.WithDefaults(), log: log}
	version, err := qemuVersion(ctx, cfg.QEMU)
	if err != nil {
		return nil, unavailable("QEMU is not installed", setupRemedy+" (apt-get install qemu-system-x86)", err)
	}
	uids, err := uidpool.New(cfg.UIDFirst, cfg.UIDCount, uidpool.HostDir)
	if err != nil {
		return nil, unavailable("cannot set up the uid pool for QEMU", "", err)
	}
	s.uids = uids
	k, err := findKernel(cfg.StateDir, cfg.KernelDir)
	if err != nil {
		return nil, unavailable("no guest kernel", setupRemedy+" (it extracts linux-image-cloud-amd64 into the state directory)", err)
	}
	agent, err := ensureAgent(ctx, cfg.StateDir, cfg.Agent)
	if err != nil {
		return nil, unavailable("no guest agent", setupRemedy, err)
	}
	if cfg.Egress != nil && k.NetErr != nil {
		return nil, unavailable("the guest kernel cannot have the egress proxy's network device", setupRemedy+" (it builds the minimal kernel with virtio-net)", k.NetErr)
	}
	if cfg.Egress != nil {
		if _, err := os.Stat(killBinary); err != nil {
			return nil, unavailable("no kill(1) to end what a VM's user network leaves", "apt-get install procps", err)
		}
	}
	s.agent = agent
	// The accelerator probe boots the initramfs of a VM without network,
	// whose answer (cached) holds for both.
	probeInitrd, err := ensureInitrd(cfg.StateDir, agent, k, false)
	if err != nil {
		return nil, unavailable("cannot make the initramfs", "", err)
	}
	initrd := probeInitrd
	if cfg.Egress != nil {
		if initrd, err = ensureInitrd(cfg.StateDir, agent, k, true); err != nil {
			return nil, unavailable("cannot make the initramfs", "", err)
		}
	}
	disk, err := ensureDisk(ctx, cfg.StateDir, cfg.Image)
	if err != nil {
		return nil, unavailable("cannot make the root disk from the shared image", setupRemedy+" (or moat image build)", err)
	}
	s.spec = VMSpec{
		Kernel: k.Image, Initrd: initrd, Disk: disk, NoACPI: k.NoACPI,
		MemoryMiB: GuestMemoryMiB(s.limits), VCPUs: cfg.VCPUs,
	}
	if cfg.Egress != nil {
		// The template's: its guest connects nowhere. Each VM gets a
		// socket of its own (newNet).
		s.spec.Net = &NetSpec{Pipe: agent}
	}
	tag, err := vmTagger()
	if err != nil {
		return nil, unavailable("cannot record this process as an owner in "+ownersDir, "", err)
	}
	s.vmm = &QEMU{Binary: cfg.QEMU, Version: version, Tag: tag}
	s.vmm.SharedRAM, s.noSharedRAM = ramSharing(ctx, cfg.QEMU)
	if cfg.CopyMemory {
		s.vmm.SharedRAM, s.noSharedRAM = false, "microvm.copy_memory is set"
	}

	// The accelerator.
	switch {
	case cfg.Accel == AccelTCG:
		s.spec.Accel = AccelTCG
		s.accel = "tcg (software emulation, chosen by the operator)"
	default:
		probeSpec := s.spec
		probeSpec.Net, probeSpec.Initrd = nil, probeInitrd
		probeSpec.Cmdline = kernelCmdline(AccelKVM, 0)
		p := probeKVM(ctx, cfg.StateDir, s.vmm, probeSpec)
		var gid uint32
		if p.KVM {
			gid, err = kvmGroup()
			if err != nil {
				p = accelProbe{Reason: "the guest boots under KVM, but " + err.Error()}
			}
		}
		switch {
		case p.KVM:
			s.spec.Accel = AccelKVM
			s.accel = "kvm (" + p.Reason + ")"
			s.vmm.Credentials = s.credentials([]uint32{gid})
		case cfg.RequireKVM || cfg.Accel == AccelKVM:
			return nil, unavailable("KVM cannot run the guest: "+p.Reason, "run on a host whose KVM boots this guest kernel, or drop require_kvm to accept emulation (about 40x slower)", nil)
		default:
			s.spec.Accel = AccelTCG
			s.accel = "tcg (software emulation, about 40x slower than KVM: " + p.Reason + ")"
		}
	}
	if s.vmm.Credentials == nil {
		s.vmm.Credentials = s.credentials(nil)
	}
	s.spec.Cmdline = kernelCmdline(s.spec.Accel, hostTSCkHz(cfg.StateDir))
	n := cfg.MaxVMs
	if n == 0 {
		n = runtime.NumCPU()
		if s.spec.Accel == AccelKVM {
			n *= 4
		}
	}
	s.maxVMs = n
	s.note = "accel: " + string(s.spec.Accel)
	if s.spec.Accel == AccelTCG && cfg.Accel == "" {
		s.note += " (software emulation: KVM cannot boot the guest here; moat doctor says why)"
		log.Warn("microvm: falling back to emulation", "accel", s.accel)
	} else {
		log.Info("microvm: accelerator", "accel", s.accel)
	}
	return s, nil
}

// credentials gives each VM a uid of its own from the pool.
func (s *backend) credentials(groups []uint32) func() (int, int, []uint32, func(), error) {
	return func() (int, int, []uint32, func(), error) {
		l, err := s.uids.Acquire()
		if err != nil {
			return 0, 0, nil, nil, fmt.Errorf("microvm: %w", err)
		}
		return l.UID, l.UID, groups, l.Release, nil
	}
}

// qemuVersion runs qemu --version and returns "7.2.22".
func qemuVersion(ctx context.Context, bin string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--version")
	cmd.Env = []string{}
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("microvm: %s --version: %w", bin, err)
	}
	f := strings.Fields(string(out))
	for i, w := range f {
		if w == "version" && i+1 < len(f) {
			return f[i+1], nil
		}
	}
	return "", fmt.Errorf("microvm: %s --version said %q", bin, bytes.TrimSpace(out))
}
