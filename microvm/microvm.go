// Package microvm is moat's strongest isolation level: each run in a virtual
// machine of its own, on its own kernel, behind a hypervisor.
//
// The VMM sits behind a small interface ([VMM], [VM]); QEMU's microvm
// machine type is the one implemented ([QEMU]): direct kernel boot, no
// PCI, virtio-mmio devices only, -nodefaults and -nic none (no network
// device at all, unless [Config.Egress]: see # Network), no host directory
// shared into the guest, QEMU's seccomp sandbox on (spawning denied), and
// QEMU itself running as an unprivileged
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
// the framed protocol of internal/wire. Once the VM is restored it starts
// python3 as an unprivileged uid in a run cgroup of the guest, chrooted
// into the root filesystem, and lets it wait for its code (a zygote). For
// a run it receives the code, sets the limits, releases python3 on it and
// streams stdout and stderr back, then the evidence of how the code ended:
// python3's wait status and flags for the CPU time, an OOM kill, a refused
// fork, a file at the size limit and a full disk. The host takes that
// report as evidence only within what the agent can send (a compromised
// guest can send anything: a report outside it fails the run as the
// sandbox's failure) and the one run engine (internal/engine) judges the
// reason from it, together with its own wall timer, output cap and
// cancellation, which kill the VM. The code runs as
// `python3 FILE` would (module __main__ with globals of its own, sys.argv,
// sys.path[0], the traceback printed by sys.excepthook, exit statuses), with
// one difference: a syntax error in source that is not UTF-8 or holds NUL
// bytes is worded as compile() words it.
//
// Nothing of one run reaches the next: each VM is a fresh restore of the
// template (its state read from a descriptor opened read-only, the disk
// attached read-only, every write in the guest's RAM) and is killed after
// its one run. As soon as a VM is restored (ahead of its run, in the
// engine's pool) the host sends the agent a Refresh: the agent sets the
// clock, reseeds the kernel's random generator and only then starts the
// run's python3 (the template holds none), so that what python3 draws when
// it starts — Python's string hash secret, its address layout (ASLR), its
// stack canary — is each run's own (code never runs in a python3 that
// started before the VM's latest refresh; TestHashSeedOneShot). What every
// run still shares is what the template holds: the guest kernel's address
// layout (KASLR) and the agent's are the same in every run, so a run can
// learn them for a later one.
//
// Limits inside the guest: memory and processes by the guest's cgroup v2
// (memory.max, pids.max), CPU time by the cgroup's account and RLIMIT_CPU,
// wall time by the host (the engine kills the VM), file size by
// RLIMIT_FSIZE, open files by RLIMIT_NOFILE, and the disk by the size of
// the tmpfs that holds every writable place (/work, /tmp, /var/tmp,
// /dev/shm); the code itself is on a tmpfs of its own. The guest's RAM is the memory limit plus the disk limit plus
// 192MiB for the guest kernel, the agent and the page cache, at least
// 512MiB, rounded up to 128MiB ([GuestMemoryMiB]): the default limits and
// every smaller memory limit share one template, and the memory limit itself
// is the cgroup's.
//
// # Boot is rare
//
// The first sandbox of a configuration boots a template VM and, once its
// agent is ready, saves it (QMP stop, then migrate to a file); the
// template holds no python3, only the page cache one filled. Every run
// starts a new QEMU that restores that file (-incoming), resumes it, and
// sends a Refresh, the host's clock and fresh randomness, which the agent
// sets and mixes into the kernel's pool (then reseeds it) before it starts
// the run's python3; then the code, with the clock and randomness again. A
// sandbox keeps one VM restored and refreshed ahead of its runs
// ([Config.Warm], the engine's pool), so that the python3 start is off the
// run's path; each VM serves one run and is killed after it.
// [Config.Cold] boots a fresh VM for every run instead, to measure what the
// template saves. Templates are kept in STATE/microvm/templates under a key
// of everything that changes them (QEMU and its command line, the kernel,
// the initramfs and so the agent, the disk, the guest's memory and vCPUs,
// the accelerator, whether memory is shared); a new one replaces those it
// supersedes. With a QEMU whose memory-backend-file takes readonly=on (8.2
// and later: setup-microvm.sh installs 10.0 from bookworm-backports) the
// template's memory is a file of its own, root's and 0444 once saved, and
// its stream holds the devices alone (x-ignore-shared): every restore maps
// the file private and read-only, copy-on-write, so the restored VMs
// share the pages none of them writes and a restore reads no memory out of
// a stream (see ram.go; moat doctor says "guest memory: shared
// copy-on-write from the template"). QEMU 7.2 cannot (its memory-backend-
// file opens its file read-write), so there each restore reads the state
// file (about 100MB, from the page cache) into memory of its own ("copied
// per VM").
//
// # Network
//
// With [Config.Egress] each VM gets one virtio-net device on QEMU's user
// network (libslirp) with restrict=on, ipv6=off and a single guestfwd,
// 10.0.2.100:3128, whose cmd: form runs, for each connection of the guest
// to that address, the agent's binary as a pipe (`agent egress-pipe
// SOCKET`, its stdio the connection) to a unix socket moat listens on for
// that VM alone (mode 0600, owned by the VM's uid); moat serves each
// connection it accepts (at most 64 at once) with the VM's egress run
// (one per one-shot VM, one per session, closed at its end). restrict=on
// drops the rest: DNS to 10.0.2.3, all other UDP, TCP to any other address
// or port, the host's 10.0.2.2 (TestNetworkOneShot checks each, and that
// nothing reaches the host's loopback; slirp itself still answers ARP,
// DHCP and a TFTP error inside QEMU). The agent gives eth0 10.0.2.15/24
// and no default route before the code runs, the code the proxy run's
// environment (HTTP(S)_PROXY=http://10.0.2.100:3128, the CA variables,
// the secrets' placeholders; children inherit it) and the proxy's CA
// bundle read-only at /etc/moat/ca.pem. To run the pipe, QEMU of such a
// VM has spawning and the set*id calls allowed in its seccomp sandbox
// (libslirp's child calls setsid, then execve); QEMU keeps no_new_privs
// and no capabilities, and every process of the VM's uid is killed (kill
// -9 -1 as that uid) before the uid is released. A VM's devices are part
// of its saved state: such sandboxes restore a template of their own,
// booted with the device (see template.go). The guest kernel needs
// virtio-net (moat's minimal kernel has it built in; the cloud kernel's
// modules go into that template's initramfs); without it, New fails with
// moat.ErrUnavailable.
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
//
// # Sessions
//
// [Sandbox.NewSession] takes one VM for the session's life: one of the
// engine's pool when one is ready (restored and refreshed ahead of a
// one-shot run, no run has used it; its replacement is restored once the
// session is made), else one it restores from the template itself. A pooled
// VM that ended while it waited is discarded and a fresh one restored. Either
// way the session's Session frame sets the clock, reseeds the kernel's
// random generator, sizes the writable layer to the disk limit and opens
// the working directory, and the python3 that waits for the first run (or
// the interpreter) started in this VM alone, after a refresh of its own
// (TestSessionFromPool). Its agent serves the session's runs one at a time
// and keeps the working directory (/work, on the writable layer) between
// them. Each run
// is python3 in a cgroup of its own, as the run's uid, with the run's
// limits; when python3 ends, the agent kills every process of that cgroup,
// so nothing of a run outlives it. The agent then starts the next run's
// python3 and says so, and the host pauses the VM (QMP stop) until the next
// run or file operation (cont): between runs nothing of the session runs.
// The session as a whole has the disk limit (the writable layer, sized
// once) and, since a run leaves nothing behind, never more memory or
// processes than one run's limits; its runs together have
// [Config.SessionCPUTime] of CPU, counted on the host from the VM's QEMU
// process. A run that times out ends the run (the host asks the agent to
// kill it, and kills the VM only when the agent does not answer), not the
// session.
//
// The file operations (moat.Files) are frames of the wire protocol that the
// agent carries out inside the guest on the working directory, resolving
// every name beneath it with openat2 and never following a symbolic link;
// contents travel in chunks (wire.MaxData from the guest). The host checks
// what the guest answers: sizes within the disk and file size limits, data
// no longer than the size announced, names that are clean relative paths,
// error numbers, modes. Close kills the VM; a session VM carries the same
// tag as a one-shot one, so the reaper of a later moat kills it when the
// moat that made it died (-9 included), and QEMU also dies with its
// parent (Pdeathsig).
//
// With moat.SessionOptions.Interpreter, the agent keeps one python3 alive
// for the session (a driver that runs each run's code with exec() in one
// globals dictionary), as the run's uid in a cgroup of its own whose memory
// and process limits cover all it holds; each run's CPU time is the
// cgroup's since the run began. At a run's end every other process of that
// cgroup is killed, and the VM pauses. A run that is killed (a limit, the
// wall time, the output cap, a cancellation) or that ends the interpreter
// (os._exit) ends it: the next run gets a fresh one, with the files kept,
// and both runs say so in their Result's Notes. The code shares the
// interpreter's process: it can change what later runs of its session do
// and the exit status they report, never the limits, which the agent reads
// from the cgroup.
//
// A session suspends with its memory (moat.Suspender, through
// engine.StateSaver; see suspend.go): its paused VM is migrated to a file
// as a template is (QMP stop, migrate), which holds all of the session (its
// files are on the guest's tmpfs, a live interpreter is a guest process),
// then killed and its uid released, so that a suspended session holds no
// process and no host memory. A resume (or each of many forks of one
// state) is a new QEMU, as a uid of its own, restored from that file (read
// only, as a descriptor; with shared memory, the state's own sealed RAM
// file, which the forks of one state map copy-on-write and share) and
// refreshed: the agent sets the guest's clock and
// reseeds the kernel's random generator before anything else. Only the
// machine that saved a state restores it (the template's key: QEMU, its
// command line, the kernel, the agent, the disk, memory and vCPUs); another
// is refused with moat.ErrInvalid. What a live interpreter holds stays as
// saved, in every fork alike: Python's string hash seed, which cannot
// change under a running interpreter, and the random module's state
// (os.urandom and secrets read the kernel's, reseeded) — the one declared
// exception to a fresh hash seed per fork (TestHashSeedForks). A plain
// session's next python3, and an interpreter that has run no code yet, are
// replaced in each fork by the Refresh. A session with a network is
// refused (moat.ErrInvalid) for now.
package microvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/uidpool"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// Sandbox is the microvm level: the run engine over a backend that
// restores (or boots) a VM per run. It is safe for concurrent use.
type Sandbox struct {
	*engine.Sandbox // Run, Level, Limits, NewSession, Close
	b               *backend
}

var (
	_ moat.Sandbox   = (*Sandbox)(nil)
	_ moat.Sessioner = (*Sandbox)(nil)
)

// backend is the engine's backend: what every VM of a sandbox boots, and
// how.
type backend struct {
	cfg    Config
	limits moat.Limits
	vmm    *QEMU
	uids   *uidpool.Pool
	spec   VMSpec // what every VM of this sandbox boots
	accel  string // the accelerator and why, for Check
	note   string // the accelerator, in short, for each Result
	tmpl   string // the template's directory, unless cold
	meta   *templateMeta
	// noSharedRAM says why VMs do not share saved memory (ramSharing).
	noSharedRAM string
	// tmplFiles: the template's files as their digests were checked.
	tmplFiles *templateFiles
	maxVMs    int
	agent     string // the guest agent's binary, also the egress pipe
	log       *slog.Logger
	// takeReady is the engine's Sandbox.TakeReady, set once the engine is
	// made: a new session's VM comes from the pool when one is ready.
	takeReady func() (engine.Instance, bool)
}

var (
	_ engine.Backend        = (*backend)(nil)
	_ engine.SessionBackend = (*backend)(nil)
)

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
	b, err := prepare(context.Background(), cfg, log)
	if err != nil {
		return nil, err
	}
	warm, warmMax := cfg.Warm, cfg.WarmMax
	if cfg.Cold {
		warm, warmMax = -1, 0
	} else {
		start := time.Now()
		dir, meta, err := ensureTemplate(context.Background(), cfg.StateDir, b.vmm, b.spec, time.Duration(cfg.BootTimeout))
		if err != nil {
			return nil, unavailable("cannot boot the template VM", "see the error; "+setupRemedy, err)
		}
		if err := b.useTemplate(dir, meta); err != nil {
			return nil, unavailable("the template is damaged: remove "+dir+" to make it again", "", err)
		}
		log.Info("microvm: template", "dir", dir, "boot_ms", meta.BootMS, "save_ms", meta.SaveMS, "bytes", meta.Size, "took", time.Since(start))
	}
	e, err := engine.New(engine.Config{
		Level:   moat.LevelMicroVM,
		Limits:  cfg.Limits,
		Warm:    warm,
		WarmMax: warmMax,
		// Under TCG a restore keeps a host CPU busy: it waits for the
		// run's end rather than competing with it.
		RefillAfterRun: b.spec.Accel == AccelTCG,
		MaxRuns:        b.maxVMs,
		MaxCode:        wire.MaxCode - b.egressReserve(),
		Notes:          []string{b.note},
		Logger:         log,
	}, b)
	if err != nil {
		return nil, err
	}
	b.takeReady = e.TakeReady
	return &Sandbox{Sandbox: e, b: b}, nil
}

// Check says whether a sandbox with cfg can run here and which accelerator
// it uses, without reaping anything. It builds the cached assets and runs
// the accelerator probe if they are not there yet, but boots no template.
func Check(ctx context.Context, cfg Config) (a moat.Availability) {
	a = moat.Availability{Level: moat.LevelMicroVM}
	if err := cfg.Validate(); err != nil {
		a.Reason = err.Error()
		return a
	}
	cfg = cfg.withDefaults()
	b, err := prepare(ctx, cfg, slog.New(slog.DiscardHandler))
	// Which kernel, also when a later step failed, and which were passed
	// over as unfinished.
	var kernelNotes []string
	if k, kerr := findKernel(cfg.StateDir, cfg.KernelDir); kerr == nil {
		if err != nil {
			kernelNotes = append(kernelNotes, "kernel: "+k.Image)
		}
		for _, name := range k.Ignored {
			kernelNotes = append(kernelNotes, "kernel ignored, unfinished: "+name)
		}
	}
	defer func() { a.Details = append(a.Details, kernelNotes...) }()
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
	a.Reason = b.accel
	a.Details = b.details()
	switch key, err := templateKey(b.vmm, b.spec); {
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
func (s *Sandbox) Accel() Accel { return s.b.spec.Accel }

func (b *backend) details() []string {
	d := []string{
		"vmm: " + b.vmm.Name() + " (" + b.vmm.Binary + "), machine microvm, " + b.netLine(),
		"accel: " + b.accel,
		"guest memory: " + b.memoryLine(),
		"kernel: " + b.spec.Kernel,
		"disk: " + b.spec.Disk,
		fmt.Sprintf("guest: %d MiB, %d vCPU; at most %d VMs at once", b.spec.MemoryMiB, b.spec.VCPUs, b.maxVMs),
	}
	if m := b.meta; m != nil {
		d = append(d, fmt.Sprintf("template: %s (cold boot %d ms, save %d ms, %d bytes)", b.tmpl, m.BootMS, m.SaveMS, m.Size))
	} else if b.cfg.Cold {
		d = append(d, "template: none (cold boot per run)")
	}
	return d
}

// memoryLine says how VMs restored from one saved state hold its memory.
func (b *backend) memoryLine() string {
	if b.vmm.SharedRAM {
		return "shared copy-on-write from the template (" + b.vmm.Name() + ": memory-backend-file readonly=on)"
	}
	return "copied per VM, not shared: " + b.noSharedRAM + " (" + b.vmm.Name() + ")"
}

// netLine says what network the VMs have.
func (b *backend) netLine() string {
	if b.cfg.Egress == nil {
		return "no network device"
	}
	return "network: " + netDesc
}

// Close implements engine.Backend: the engine has discarded every VM.
func (b *backend) Close() error { return nil }

// Describe says which accelerator the VMs use and how they start; see
// moat.Describer.
func (s *Sandbox) Describe() string {
	d := "accel " + string(s.Accel()) + ", restored from a saved template"
	if s.b.cfg.Cold {
		d = "accel " + string(s.Accel()) + ", a fresh VM booted for every run"
	}
	if s.b.cfg.Egress != nil {
		d += "; network: " + netDesc
	}
	return d
}

var _ moat.Describer = (*Sandbox)(nil)
