// Package microvm is moat's strongest isolation level: each run in a virtual
// machine of its own, on its own kernel, behind a hypervisor.
//
// The VMM sits behind a small interface ([VMM], [VM]); QEMU's microvm
// machine type is the one implemented ([QEMU]): direct kernel boot, no
// PCI, virtio-mmio devices only, -nodefaults and -nic none (no network
// device at all), no host directory shared into the guest, QEMU's seccomp
// sandbox on (spawning denied), and QEMU itself running as an unprivileged
// uid of its own per VM, which needs no access to moat's files beyond the
// kernel, the initramfs and the disk: the saved state reaches it as a
// descriptor.
//
// # The guest
//
// The kernel is moat's minimal build (kernel/guest.config on top of
// tinyconfig, from Debian's linux-source-6.1; everything built in, no
// ACPI), which scripts/setup-microvm.sh builds, or else Debian's cloud
// kernel (linux-image-cloud-amd64, extracted into the state directory, never
// installed as the host's kernel). Measured here under TCG, the minimal
// kernel boots a VM to a ready agent about 25% faster (cold run of print(1):
// 1.66s against 2.20s) and restores no slower, so it is preferred when
// present. The initramfs is moat's own: the agent as /init and the modules
// the kernel needs (virtio-mmio, virtio-blk, virtio-console, overlayfs; none
// for the minimal kernel). The root filesystem is the shared image of package
// image as a read-only ext4 disk under a writable tmpfs layer (overlayfs).
//
// The agent (./agent) talks to the host over one virtio-serial port with
// the framed protocol of internal/wire. At boot it starts python3 as an
// unprivileged uid in the guest's run cgroup, chrooted into the root
// filesystem, and lets it wait for its code (a zygote). For a run it
// receives the code, sets the limits, releases python3 on it and streams
// stdout and stderr back, then how the code ended. The code runs as
// `python3 FILE` would (module __main__ with globals of its own, sys.argv,
// sys.path[0], the traceback printed by sys.excepthook, exit statuses), with
// two differences: Python's string hash seed is the template's, the same in
// every run, and a syntax error in source that is not UTF-8 or holds NUL
// bytes is worded as compile() words it.
//
// Nothing of one run reaches the next: each VM is a fresh restore of the
// template (its state read from a descriptor opened read-only, the disk
// attached read-only, every write in the guest's RAM) and is killed after
// its one run. What every run shares is what the template holds: besides
// the hash seed, the guest kernel's address layout (KASLR) and python3's
// (ASLR, its stack canary) are the same in every run, so a run can learn
// them for a later one; only the kernel's random generator is reseeded.
//
// Limits inside the guest: memory and processes by the guest's cgroup v2
// (memory.max, pids.max), CPU time by the cgroup's account and RLIMIT_CPU,
// wall time by the agent (and a host-side backstop that kills the VM), file
// size by RLIMIT_FSIZE, open files by RLIMIT_NOFILE, and the disk by the
// size of the tmpfs that holds every writable place (/work, /tmp, /var/tmp,
// /dev/shm). The guest's RAM is the memory limit plus the disk limit plus
// 192MiB for the guest kernel, the agent and the page cache, at least
// 512MiB, rounded up to 128MiB ([GuestMemoryMiB]): the default limits and
// every smaller memory limit share one template, and the memory limit itself
// is the cgroup's.
//
// # Boot is rare
//
// The first sandbox of a configuration boots a template VM and, once its
// agent is ready, saves it (QMP stop, then migrate to a file). Every run
// starts a new QEMU that restores that file (-incoming), resumes it, and
// sends the code together with the host's clock and fresh randomness, which
// the agent sets and mixes into the kernel's pool (then reseeds it) before
// the code runs. A sandbox keeps one VM restored ahead of its runs
// ([Config.Ready]); each VM serves one run and is killed after it.
// [Config.Cold] boots a fresh VM for every run instead, to measure what the
// template saves. Templates are kept in STATE/microvm/templates under a key
// of everything that changes them (QEMU and its command line, the kernel,
// the initramfs and so the agent, the disk, the guest's memory and vCPUs,
// the accelerator); a new one replaces those it supersedes. QEMU 7.2 cannot
// map the guest memory of a saved VM copy-on-write for an unprivileged
// process (memory-backend-file opens its file read-write; the rom= option
// came in 8.2), so each restore reads the state file (about 100MB, from the
// page cache) instead.
//
// # Acceleration
//
// The first use probes, with a bounded boot (20s), whether KVM can run the
// guest, and caches the answer in the state directory. Where it cannot (a
// nested KVM that boots only kernels built for it, like this machine's PVM),
// the level falls back to QEMU's emulation (TCG) and says so in [Check], in
// each Result's Notes and in [Sandbox.Accel] for the bench;
// [Config.RequireKVM] turns the fallback into [moat.ErrUnavailable]. Under
// TCG every running guest keeps a host CPU busy and a guest whose CPU is
// taken away still counts that time as its code's CPU time, so a sandbox
// runs at most one VM per host CPU at a time and queues the other runs
// ([Config.MaxVMs]).
package microvm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/internal/uidpool"
	"github.com/moatsandbox/moat/microvm/internal/wire"
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
	// Cold boots a fresh VM for every run instead of restoring the
	// template. It exists to measure what the template saves (the
	// microvm-cold bench row). False means restore.
	Cold bool `json:"cold,omitempty"`
	// Ready is how many VMs the sandbox keeps restored from the template
	// ahead of runs, each waiting for its one run, so that a run does not
	// wait for QEMU to start and load the state. They are killed by Close.
	// Zero means 1; a negative number means none (every run restores its
	// VM itself). Cold sandboxes keep none.
	Ready int `json:"ready,omitempty"`
	// MaxVMs is the most VMs the sandbox runs at once; more runs wait for
	// one to end (the wait counts in the Result's Duration, not in the
	// run's wall time, which starts with the code). Zero means the number
	// of host CPUs under TCG, where every running guest keeps a host CPU
	// busy and a guest whose CPU is taken away still counts that time as
	// its code's CPU time (emulation has no steal time); four times that
	// under KVM.
	MaxVMs int `json:"max_vms,omitempty"`
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

// Sandbox is the microvm level. It is safe for concurrent use.
type Sandbox struct {
	cfg    Config
	limits moat.Limits
	vmm    *QEMU
	uids   *uidpool.Pool
	spec   VMSpec // what every VM of this sandbox boots
	accel  string // the accelerator and why, for Check
	note   string // the accelerator, in short, for each Result
	tmpl   string // the template's directory, unless cold
	meta   *templateMeta
	slots  chan struct{} // one per VM that may run at once
	log    *slog.Logger

	// ready holds VMs restored ahead of runs; the filler goroutine keeps it
	// full until stopFill is called, and fillDone when it has returned.
	ready    chan readyVM
	refill   chan struct{}
	stopFill context.CancelFunc
	fillDone chan struct{}

	mu     sync.Mutex
	closed bool
	runs   sync.WaitGroup
}

var _ moat.Sandbox = (*Sandbox)(nil)

func unavailable(reason, remedy string, err error) error {
	return &moat.UnavailableError{Level: moat.LevelMicroVM, Reason: reason, Remedy: remedy, Err: err}
}

const setupRemedy = "run scripts/setup-microvm.sh as root"

// New prepares the level (the kernel, the agent, the initramfs, the disk
// image, the accelerator probe and, unless cfg.Cold, the template, each
// built once and cached), reaps the VMs and files that moat processes no
// longer alive left behind, and returns the sandbox. It returns an error
// wrapping moat.ErrUnavailable when the level cannot run here.
func New(cfg Config) (*Sandbox, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reap(cfg.StateDir, log)
	s, err := prepare(context.Background(), cfg, log)
	if err != nil {
		return nil, err
	}
	if !cfg.Cold {
		start := time.Now()
		dir, meta, err := ensureTemplate(context.Background(), cfg.StateDir, s.vmm, s.spec, time.Duration(cfg.BootTimeout))
		if err != nil {
			return nil, unavailable("cannot boot the template VM", "see the error; "+setupRemedy, err)
		}
		s.tmpl, s.meta = dir, meta
		log.Info("microvm: template", "dir", dir, "boot_ms", meta.BootMS, "save_ms", meta.SaveMS, "bytes", meta.Size, "took", time.Since(start))
		if n := cfg.Ready; n >= 0 {
			if n == 0 {
				n = 1
			}
			s.ready = make(chan readyVM, n)
			s.refill = make(chan struct{}, 1)
			s.fillDone = make(chan struct{})
			ctx, cancel := context.WithCancel(context.Background())
			s.stopFill = cancel
			go s.fill(ctx)
		}
	}
	return s, nil
}

// Check says whether a sandbox with cfg can run here and which accelerator
// it uses, without reaping anything. It builds the cached assets and runs
// the accelerator probe if they are not there yet, but boots no template.
func Check(cfg Config) moat.Availability {
	a := moat.Availability{Level: moat.LevelMicroVM}
	if err := cfg.Validate(); err != nil {
		a.Reason = err.Error()
		return a
	}
	cfg = cfg.withDefaults()
	s, err := prepare(context.Background(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		var ue *moat.UnavailableError
		if errors.As(err, &ue) {
			a.Reason, a.Remedy = ue.Reason, ue.Remedy
			if ue.Err != nil {
				a.Reason += ": " + ue.Err.Error()
			}
		} else {
			a.Reason = err.Error()
		}
		return a
	}
	a.Available = true
	a.Reason = s.accel
	a.Details = s.details()
	switch key, err := templateKey(s.vmm, s.spec); {
	case cfg.Cold:
	case err != nil:
		a.Details = append(a.Details, "template: "+err.Error())
	default:
		dir := filepath.Join(cfg.StateDir, "microvm", "templates", key)
		if m, err := readMeta(dir); err == nil {
			a.Details = append(a.Details, fmt.Sprintf("template: %s, made %s (cold boot %d ms, save %d ms, %d bytes)",
				dir, m.Created.Format(time.RFC3339), m.BootMS, m.SaveMS, m.Size))
		} else {
			a.Details = append(a.Details, "template: not made yet (the first sandbox boots and saves it, once)")
		}
	}
	return a
}

// Accel returns the accelerator the sandbox's VMs use.
func (s *Sandbox) Accel() Accel { return s.spec.Accel }

// Level returns moat.LevelMicroVM.
func (s *Sandbox) Level() moat.Level { return moat.LevelMicroVM }

// Limits returns the limits every run gets, defaults filled in.
func (s *Sandbox) Limits() moat.Limits { return s.limits }

func (s *Sandbox) details() []string {
	d := []string{
		"vmm: " + s.vmm.Name() + " (" + s.vmm.Binary + "), machine microvm, no network device",
		"accel: " + s.accel,
		"kernel: " + s.spec.Kernel,
		"disk: " + s.spec.Disk,
		fmt.Sprintf("guest: %d MiB, %d vCPU; at most %d VMs at once", s.spec.MemoryMiB, s.spec.VCPUs, cap(s.slots)),
	}
	if m := s.meta; m != nil {
		d = append(d, fmt.Sprintf("template: %s (cold boot %d ms, save %d ms, %d bytes)", s.tmpl, m.BootMS, m.SaveMS, m.Size))
	} else if s.cfg.Cold {
		d = append(d, "template: none (cold boot per run)")
	}
	return d
}

// prepare finds or builds everything a VM boots from and chooses the
// accelerator.
func prepare(ctx context.Context, cfg Config, log *slog.Logger) (*Sandbox, error) {
	if runtime.GOARCH != "amd64" {
		return nil, unavailable("the microvm level is built for x86-64 hosts only", "", nil)
	}
	if os.Geteuid() != 0 {
		return nil, unavailable(fmt.Sprintf("not root (uid %d): the level runs each QEMU as a uid of its own", os.Geteuid()), "run moat as root", nil)
	}
	s := &Sandbox{cfg: cfg, limits: cfg.Limits.WithDefaults(), log: log}
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
	initrd, err := ensureInitrd(cfg.StateDir, agent, k)
	if err != nil {
		return nil, unavailable("cannot make the initramfs", "", err)
	}
	disk, err := ensureDisk(ctx, cfg.StateDir, cfg.Image)
	if err != nil {
		return nil, unavailable("cannot make the root disk from the shared image", setupRemedy+" (or moat image build)", err)
	}
	s.spec = VMSpec{
		Kernel: k.Image, Initrd: initrd, Disk: disk, NoACPI: k.NoACPI,
		MemoryMiB: GuestMemoryMiB(s.limits), VCPUs: cfg.VCPUs,
	}
	tag, err := vmTagger()
	if err != nil {
		return nil, unavailable("cannot record this process as an owner in "+ownersDir, "", err)
	}
	s.vmm = &QEMU{Binary: cfg.QEMU, Version: version, Tag: tag}

	// The accelerator.
	switch {
	case cfg.Accel == AccelTCG:
		s.spec.Accel = AccelTCG
		s.accel = "tcg (software emulation, chosen by the operator)"
	default:
		probeSpec := s.spec
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
	s.slots = make(chan struct{}, n)
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
func (s *Sandbox) credentials(groups []uint32) func() (int, int, []uint32, func(), error) {
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

// runDir holds moat's runtime files of this level (the uid pool's locks).
const runDir = "/run/moat/microvm"

// ownersDir is where moat processes hold their owner ids (package owner),
// shared with the other levels.
const ownersDir = "/run/moat/owners"

// vmTagger returns the tag of this moat process's QEMU processes,
// "moat-vm:OWNER:RANDOM", OWNER being its owner id: a pid would mean
// nothing to a moat in another PID namespace, which would take a live
// owner's VMs for leftovers.
func vmTagger() (func() string, error) {
	id, err := owner.Self(ownersDir)
	if err != nil {
		return nil, err
	}
	return func() string {
		var b [6]byte
		rand.Read(b[:])
		return tagPrefix + id + ":" + hex.EncodeToString(b[:])
	}, nil
}

const tagPrefix = "moat-vm:"

// vmProcess is a QEMU process of moat, found by its tag.
type vmProcess struct {
	pid   int
	owner string // owner id
}

// listVMs returns the QEMU processes that carry moat's tag.
func listVMs() []vmProcess {
	ents, _ := os.ReadDir("/proc")
	var out []vmProcess
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		for i := 0; i+1 < len(args); i++ {
			if args[i] == "-name" && strings.HasPrefix(args[i+1], tagPrefix) {
				rest := strings.TrimPrefix(args[i+1], tagPrefix)
				out = append(out, vmProcess{pid: pid, owner: strings.SplitN(rest, ":", 2)[0]})
				break
			}
		}
	}
	return out
}

// reap kills the VMs whose moat process is gone and removes the half-made
// files such processes left in the state directory.
func reap(stateDir string, log *slog.Logger) {
	for _, p := range listVMs() {
		if _, ok := owner.Of(p.owner + "-"); !ok || owner.Alive(ownersDir, p.owner) {
			continue
		}
		if err := syscall.Kill(p.pid, syscall.SIGKILL); err == nil {
			log.Info("microvm: reaped a leftover VM", "pid", p.pid, "owner", p.owner)
		}
	}
	for _, sub := range []string{"templates", "agent/*", "initrd", "disks"} {
		tmps, _ := filepath.Glob(filepath.Join(stateDir, "microvm", sub, "*.tmp-*"))
		for _, t := range tmps {
			_, rest, _ := strings.Cut(filepath.Base(t), ".tmp-")
			pid, err := strconv.Atoi(strings.SplitN(rest, "-", 2)[0])
			if err != nil || pid == os.Getpid() || syscall.Kill(pid, 0) == nil {
				continue
			}
			if err := os.RemoveAll(t); err == nil {
				log.Info("microvm: reaped a leftover file", "path", t)
			}
		}
	}
}

// Close makes later runs fail with moat.ErrClosed and waits for runs in
// progress. It is safe to call more than once.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.runs.Wait()
	if s.stopFill != nil {
		s.stopFill()
		<-s.fillDone
		for {
			select {
			case r := <-s.ready:
				r.vm.Kill()
				continue
			default:
			}
			break
		}
	}
	return nil
}

// backstop is how long past the wall time the host waits for the agent's
// report before it kills the VM itself.
const backstop = 15 * time.Second

// Run runs req.Code under python3 in a VM of its own; see moat.Sandbox for
// the contract.
func (s *Sandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	if len(req.Code) == 0 {
		return nil, fmt.Errorf("microvm: empty code: %w", moat.ErrInvalid)
	}
	if len(req.Code) > int(s.limits.Disk) || len(req.Code) > wire.MaxCode {
		return nil, fmt.Errorf("microvm: code of %d bytes is larger than the disk limit %v or the level's cap of %d bytes: %w",
			len(req.Code), s.limits.Disk, wire.MaxCode, moat.ErrInvalid)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("microvm: %w", moat.ErrClosed)
	}
	s.runs.Add(1)
	s.mu.Unlock()
	defer s.runs.Done()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	start := time.Now()
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer s.askRefill()
	vm, how, err := s.startVM(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	defer vm.Kill()
	res, err := s.talk(ctx, vm, req)
	if err != nil {
		return nil, err
	}
	vm.Kill()
	res.Notes = append([]string{s.note, how}, res.Notes...)
	res.Duration = time.Since(start)
	s.log.Debug("microvm: run", "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason, "start", how)
	return res, nil
}

// startVM restores the template, or boots a fresh VM when the sandbox is
// cold, and returns it running with its agent waiting for the code.
func (s *Sandbox) startVM(ctx context.Context) (VM, string, error) {
	start := time.Now()
	if s.cfg.Cold {
		vm, _, err := bootToHello(ctx, s.vmm, s.spec, time.Duration(s.cfg.BootTimeout))
		if err != nil {
			return nil, "", err
		}
		return vm, fmt.Sprintf("vm: cold boot to a ready agent in %d ms", time.Since(start).Milliseconds()), nil
	}
	if r, ok := s.takeReady(); ok {
		return r.vm, fmt.Sprintf("vm: restored from template %s in %d ms, ahead of the run", filepath.Base(s.tmpl)[:12], r.ms), nil
	}
	vm, err := s.restore(ctx)
	if err != nil {
		return nil, "", err
	}
	return vm, fmt.Sprintf("vm: restored from template %s in %d ms", filepath.Base(s.tmpl)[:12], time.Since(start).Milliseconds()), nil
}

// restore starts a VM from the template and lets it run: its agent waits
// for the code.
func (s *Sandbox) restore(ctx context.Context) (VM, error) {
	spec := s.spec
	spec.Restore = filepath.Join(s.tmpl, "state")
	vm, err := s.vmm.Start(ctx, spec)
	if errors.Is(err, fs.ErrNotExist) {
		// A newer template of another sandbox superseded this one and
		// removed it (see pruneTemplates): make it again.
		if _, _, err := ensureTemplate(ctx, s.cfg.StateDir, s.vmm, s.spec, time.Duration(s.cfg.BootTimeout)); err != nil {
			return nil, err
		}
		vm, err = s.vmm.Start(ctx, spec)
	}
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, time.Duration(s.cfg.BootTimeout))
	defer cancel()
	if err := vm.Resume(rctx); err != nil {
		vm.Kill()
		return nil, err
	}
	return vm, nil
}

// readyVM is a VM restored ahead of its run.
type readyVM struct {
	vm VM
	ms int64 // how long its restore took
}

// fill keeps s.ready full until ctx ends, restoring a VM whenever one is
// taken (s.refill).
func (s *Sandbox) fill(ctx context.Context) {
	defer close(s.fillDone)
	for {
		for len(s.ready) < cap(s.ready) {
			start := time.Now()
			vm, err := s.restore(ctx)
			if err != nil {
				if ctx.Err() == nil {
					s.log.Warn("microvm: restore a VM ahead of its run", "err", err)
				}
				break
			}
			select {
			case s.ready <- readyVM{vm, time.Since(start).Milliseconds()}:
			case <-ctx.Done():
				vm.Kill()
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-s.refill:
		}
	}
}

// askRefill asks the filler for another VM. Runs ask when they end, not
// when they start, so that the restore does not compete with the run for
// the CPU.
func (s *Sandbox) askRefill() {
	if s.refill == nil {
		return
	}
	select {
	case s.refill <- struct{}{}:
	default:
	}
}

// takeReady returns a VM restored ahead, if one is there and alive.
func (s *Sandbox) takeReady() (readyVM, bool) {
	if s.ready == nil {
		return readyVM{}, false
	}
	for {
		select {
		case r := <-s.ready:
			select {
			case <-r.vm.Exited():
				r.vm.Kill()
				continue
			default:
				return r, true
			}
		default:
			return readyVM{}, false
		}
	}
}

// guestReasons are the reasons the agent may report; the host adds output
// and canceled itself.
var guestReasons = []moat.Reason{moat.ReasonNone, moat.ReasonTimeout, moat.ReasonMemory, moat.ReasonPids,
	moat.ReasonFileSize, moat.ReasonDisk, moat.ReasonSignal}

// parseExit decodes the agent's exit report. The guest runs hostile code
// and may be compromised, so a report that the agent could not have made is
// an error, not a result.
func parseExit(p []byte) (*wire.Exit, error) {
	var e wire.Exit
	if err := json.Unmarshal(p, &e); err != nil {
		return nil, fmt.Errorf("microvm: the agent's exit report: %w", err)
	}
	if e.ExitCode < 0 || e.ExitCode > 255 || e.Signal < 0 || e.Signal > 64 || !slices.Contains(guestReasons, moat.Reason(e.Reason)) {
		return nil, fmt.Errorf("microvm: the agent's exit report is not one it makes: %s", clip(p, 512))
	}
	return &e, nil
}

// clip returns b as valid UTF-8, cut to at most n bytes, for an error
// message.
func clip(b []byte, n int) string {
	if len(b) > n {
		b = b[:n]
	}
	return strings.ToValidUTF8(string(b), "?")
}

type frame struct {
	kind    wire.Kind
	payload []byte
}

// talk sends the run to the agent and collects what it reports.
func (s *Sandbox) talk(ctx context.Context, vm VM, req moat.Request) (*moat.Result, error) {
	lim := s.limits
	seed := make([]byte, 64)
	rand.Read(seed)
	run := wire.Run{
		Code: req.Code, UnixNano: time.Now().UnixNano(), Seed: seed,
		WallMS: time.Duration(lim.WallTime).Milliseconds(), CPUMS: time.Duration(lim.CPUTime).Milliseconds(),
		Memory: int64(lim.Memory), Pids: int64(lim.Pids), FileSize: int64(lim.FileSize),
		Disk: int64(lim.Disk), OpenFiles: int64(lim.OpenFiles),
	}
	conn := vm.Agent()
	frames := make(chan frame, 16)
	readerDone := make(chan error, 1)
	go func() {
		defer close(frames)
		for {
			k, p, err := wire.Read(conn, wire.MaxReport)
			if err != nil {
				readerDone <- err
				return
			}
			frames <- frame{k, p}
		}
	}()
	// Whatever happens below, the reader ends before talk returns: killing
	// the VM closes the connection.
	defer func() {
		vm.Kill()
		for range frames {
		}
	}()
	sendErr := make(chan error, 1)
	go func() { sendErr <- wire.WriteJSON(conn, wire.KindRun, run) }()

	// The first byte past the output cap ends the run: the loop stops at
	// once and the VM is killed, as at the host's wall-time backstop.
	var outOver bool
	over := func() { outOver = true }
	stdout := capture.New(int64(lim.Output), req.Stdout, over)
	stderr := capture.New(int64(lim.Output), req.Stderr, over)
	timer := time.NewTimer(time.Duration(lim.WallTime) + backstop)
	defer timer.Stop()
	var (
		started  bool
		exit     *wire.Exit
		canceled bool
		hostKill bool
	)
loop:
	for {
		select {
		case f, ok := <-frames:
			if !ok {
				break loop
			}
			switch f.kind {
			case wire.KindStarted:
				started = true
			case wire.KindStdout:
				stdout.Write(f.payload)
				if outOver {
					break loop
				}
			case wire.KindStderr:
				stderr.Write(f.payload)
				if outOver {
					break loop
				}
			case wire.KindExit:
				e, err := parseExit(f.payload)
				if err != nil {
					return nil, err
				}
				exit = e
				break loop
			case wire.KindFail:
				return nil, unavailable("the guest agent failed", "", errors.New(clip(f.payload, 512)))
			}
		case err := <-sendErr:
			if err != nil {
				return nil, fmt.Errorf("microvm: send the code: %w", err)
			}
			sendErr = nil
		case <-ctx.Done():
			canceled = true
			break loop
		case <-timer.C:
			hostKill = true
			break loop
		}
	}
	vm.Kill()
	for range frames { // the output that was on its way
	}
	res := &moat.Result{
		Level:     moat.LevelMicroVM,
		Stdout:    stdout.Bytes(),
		Stderr:    stderr.Bytes(),
		Truncated: stdout.Truncated() || stderr.Truncated(),
	}
	switch {
	case outOver:
		res.ExitCode = 128 + int(syscall.SIGKILL)
		res.Signal = "SIGKILL"
		res.Reason = moat.ReasonOutput
	case exit != nil:
		res.ExitCode = exit.ExitCode
		if exit.Signal > 0 {
			res.Signal = unix.SignalName(syscall.Signal(exit.Signal))
		}
		res.Reason = moat.Reason(exit.Reason)
		if res.Truncated && (res.Reason == moat.ReasonNone || res.Reason == moat.ReasonSignal) {
			res.Reason = moat.ReasonOutput
		}
	case canceled && !started:
		return nil, ctx.Err()
	case canceled, hostKill:
		res.ExitCode = 128 + int(syscall.SIGKILL)
		res.Signal = "SIGKILL"
		res.Reason = moat.ReasonCanceled
		if hostKill {
			res.Reason = moat.ReasonTimeout
			res.Notes = append(res.Notes, "the agent did not report within the wall time; the host killed the VM")
		}
	default:
		err := <-readerDone
		return nil, fmt.Errorf("microvm: the VM ended without a report (%v)", err)
	}
	return res, nil
}
