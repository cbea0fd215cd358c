package microvm

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/engine"
)

// Config configures a microvm sandbox. The zero value is usable once
// scripts/setup-microvm.sh has run.
type Config struct {
	// Limits bound each run. Zero fields mean moat's defaults.
	Limits moat.Limits `json:"limits"`
	// StateDir is moat's state directory, where the kernel, the disk
	// image, the agent and the templates are kept. Zero means
	// image.DefaultStateDir() (/var/lib/moat for root).
	StateDir string `json:"state_dir,omitempty"`
	// Image chooses the shared root filesystem. Zero means the default
	// image in StateDir.
	Image image.Config `json:"image"`
	// QEMU is the qemu-system-x86_64 binary. Zero means
	// /usr/bin/qemu-system-x86_64.
	QEMU string `json:"qemu,omitempty"`
	// KernelDir is an extracted Debian linux-image package (boot/vmlinuz-REL
	// and lib/modules/REL). Zero means the newest under
	// STATE/microvm/kernels.
	KernelDir string `json:"kernel_dir,omitempty"`
	// Agent is a static build of ./agent. Zero means build it from this
	// package's source (cached), or use the one setup-microvm.sh installed.
	Agent string `json:"agent,omitempty"`
	// VCPUs is the number of virtual CPUs of each VM. Zero means 1.
	VCPUs int `json:"vcpus,omitempty"`
	// Accel forces an accelerator: "kvm" or "tcg". Zero means probe and
	// use KVM where it boots the guest, TCG otherwise.
	Accel Accel `json:"accel,omitempty"`
	// RequireKVM makes the level unavailable, instead of falling back to
	// emulation, where KVM cannot boot the guest.
	RequireKVM bool `json:"require_kvm,omitempty"`
	// CopyMemory gives every VM its own copy of the saved memory it is
	// restored from, even where QEMU could map it copy-on-write (8.2+):
	// no page is then shared between VMs, which closes the side channels
	// of shared memory (cache timing, Rowhammer on shared pages) at the
	// cost of a copy per VM. False means share where QEMU can.
	CopyMemory bool `json:"copy_memory,omitempty"`
	// Cold boots a fresh VM for every run instead of restoring the
	// template. It exists to measure what the template saves (the
	// microvm-cold bench row). False means restore.
	Cold bool `json:"cold,omitempty"`
	// Warm is how many VMs the sandbox keeps restored from the template
	// ahead of runs (the engine's pool, engine.Config.Warm), each waiting
	// for its one run, so that a run does not wait for QEMU to start and
	// load the state. They are killed by Close. Zero means 1; -1 means none
	// (every run restores its VM itself); at most 16. Cold sandboxes keep
	// none.
	Warm int `json:"warm,omitempty"`
	// WarmMax is how many VMs the pool may grow to under a burst of runs
	// (and sessions) that found none ready, one more per such run,
	// shrinking back to Warm after engine.BurstDecay without one
	// (engine.Config.WarmMax); each holds the guest's memory. Zero means
	// Warm: no growth. At most 16.
	WarmMax int `json:"warm_max,omitempty"`
	// MaxVMs is the most runs (one-shot or of a session) the sandbox runs
	// at once; more runs wait for one to end (the wait counts in the
	// Result's Duration, not in the run's wall time, which starts with the
	// code). A session's VM, paused between its runs, takes no place. Zero
	// means the number of host CPUs under TCG, where every running guest
	// keeps a host CPU busy and a guest whose CPU is taken away still
	// counts that time as its code's CPU time (emulation has no steal
	// time); four times that under KVM.
	MaxVMs int `json:"max_vms,omitempty"`
	// SessionCPUTime is the most CPU time one session's runs may use in
	// all, counted on the host as the CPU time of the session VM's QEMU
	// process from the start of each run to its end (a figure the guest
	// cannot change, which holds the guest kernel's and the agent's share
	// and, under TCG, the emulation's). The run that reaches it ends with
	// moat.ReasonTimeout; the session's later runs then fail with an error
	// wrapping moat.ErrSpent (its files stay readable until Close). Zero
	// means ten times Limits.CPUTime (100s with the default limits).
	SessionCPUTime moat.Duration `json:"session_cpu_time,omitempty"`
	// BootTimeout bounds one boot of a VM to the agent's hello. Zero means
	// 90s.
	BootTimeout moat.Duration `json:"boot_timeout,omitempty"`
	// UIDFirst and UIDCount are the uids (and gids of the same number)
	// QEMU processes run as, one per VM at a time. Zero means 2100200000
	// and 4096. No user of the host should own a uid in this range.
	UIDFirst int `json:"uid_first,omitempty"`
	UIDCount int `json:"uid_count,omitempty"`
	// Logger receives set-up facts at info level and a line per run at
	// debug level. Nil means discard.
	Logger *slog.Logger `json:"-"`
	// Egress, when not nil, gives each VM (each one-shot run, each
	// session) a network whose only way out is this proxy: one virtio-net
	// device on QEMU's user network with restrict=on and a single guestfwd,
	// 10.0.2.100:3128, whose connections moat serves with a run of the
	// proxy (one per VM); the code gets the proxy's environment and CA
	// bundle (/etc/moat/ca.pem). Such VMs restore a template of their own,
	// booted with the device. Nil means no network, as before: -nic none,
	// no network device in the guest.
	Egress *egress.Proxy `json:"-"`
}

// Validate reports whether c is usable; the error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	if err := c.Limits.Validate(); err != nil {
		return err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("microvm: "+format+": %w", append(args, moat.ErrInvalid)...)
	}
	switch c.Accel {
	case "", AccelKVM, AccelTCG:
	default:
		return bad("accel %q is not kvm or tcg", c.Accel)
	}
	if c.RequireKVM && c.Accel == AccelTCG {
		return bad("require_kvm contradicts accel tcg")
	}
	if c.VCPUs < 0 || c.VCPUs > 64 {
		return bad("vcpus %d out of range 0..64", c.VCPUs)
	}
	if c.MaxVMs < 0 {
		return bad("max vms %d is negative", c.MaxVMs)
	}
	if err := engine.ValidateWarm(moat.LevelMicroVM, c.Warm); err != nil {
		return err
	}
	if err := engine.ValidateWarmMax(moat.LevelMicroVM, c.Warm, c.WarmMax); err != nil {
		return err
	}
	if c.SessionCPUTime < 0 {
		return bad("session cpu time %v is negative", c.SessionCPUTime)
	}
	if c.BootTimeout < 0 {
		return bad("boot timeout %v is negative", c.BootTimeout)
	}
	if c.UIDFirst < 0 || c.UIDCount < 0 || (c.UIDFirst != 0 && c.UIDFirst < 1000) {
		return bad("uid range %d+%d must lie above the system's users", c.UIDFirst, c.UIDCount)
	}
	for _, p := range []string{c.StateDir, c.QEMU, c.KernelDir, c.Agent} {
		if p != "" && !filepath.IsAbs(p) {
			return bad("path %q is not absolute", p)
		}
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.StateDir == "" {
		c.StateDir = image.DefaultStateDir()
	}
	if c.Image.StateDir == "" {
		c.Image.StateDir = c.StateDir
	}
	if c.QEMU == "" {
		c.QEMU = "/usr/bin/qemu-system-x86_64"
	}
	if c.VCPUs == 0 {
		c.VCPUs = 1
	}
	if c.BootTimeout == 0 {
		c.BootTimeout = moat.Duration(90 * time.Second)
	}
	if c.UIDFirst == 0 {
		c.UIDFirst = 2100200000
	}
	if c.UIDCount == 0 {
		c.UIDCount = 4096
	}
	if c.SessionCPUTime == 0 {
		c.SessionCPUTime = 10 * c.Limits.WithDefaults().CPUTime
	}
	return c
}

// guestOverheadMiB is what the guest needs besides the run's memory and
// disk: its kernel, the agent, the page cache of the root filesystem.
const guestOverheadMiB = 192

// GuestMemoryMiB returns the RAM a VM gets for limits l (defaults filled
// in): the memory limit plus the disk limit (the writable layer is a tmpfs
// in the guest's memory) plus 192MiB, at least 512MiB, rounded up to
// 128MiB.
func GuestMemoryMiB(l moat.Limits) int {
	l = l.WithDefaults()
	mib := int((l.Memory+l.Disk+moat.MiB-1)/moat.MiB) + guestOverheadMiB
	mib = max(mib, 512)
	return (mib + 127) / 128 * 128
}
