package microvm

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// A suspended session is its whole VM, saved as a template is (QMP stop,
// then migrate to a file): the guest's RAM, which holds everything of the
// session (the working directory and every writable place are on the
// guest's tmpfs, the root disk is the shared read-only image, and a live
// interpreter is a process in the guest), and its devices' state. The
// engine's directory for it (engine.StateSaver) holds
//
//	vm        QEMU's migration stream, written by moat through a descriptor
//	vm.json   savedVM: what machine it is and the session's host-side state
//
// A resume starts a new QEMU, as a uid of its own, with -incoming from vm
// (opened read-only by moat and passed as a descriptor: the VM's uid has no
// access to the directory, and nothing writes into it, so that one
// directory resumes many times: forks), lets it run, and sends the agent,
// which is where it was in the session's loop, a Refresh with the host's
// clock and fresh randomness (each run also gets them, as ever). The
// restored VM must be the machine that was saved: the same QEMU and
// command line, kernel, initramfs (and so agent), disk, memory and vCPUs,
// which the template's key covers (templateKey); a state of another one is
// refused. The agent answers the Refresh only once what waits for the
// next run is the fork's own: a plain session's next python3, saved with
// the state and so in every fork, is replaced by one started after the
// reseed, with a hash seed of its own, and so is a live interpreter that
// has run no code yet. The declared exception: Python's string hash seed
// of a live interpreter that has run code lives in its memory (its dicts
// and sets depend on it) and cannot change under it, so every fork of one
// state has the state's seed, and the random module's state too
// (os.urandom, and so secrets, is the kernel's, reseeded);
// TestHashSeedForks checks both.
//
// With QEMU.SharedRAM the state's memory is a RAM file of its own, sealed
// (see ram.go), and vm holds the devices alone: the forks of one state map
// it copy-on-write and share the pages none of them writes. A session VM's
// memory is private (a copy-on-write of its template's), so its migration
// carries it; shareState turns that stream into the two files, restoring
// it into a converter VM (frozen: its guest never runs) whose memory is
// the new RAM file mapped shared, and migrating that out again with
// x-ignore-shared. The RAM file is in the engine's manifest like the
// others: a damaged one is refused before any VM starts.
//
// A session with a network (Config.Egress) is not suspended with its
// memory: its code's environment holds its proxy run's CA and secrets'
// placeholders, which a resumed VM would need its old run for.

const (
	savedStateFile = "vm"
	savedMetaFile  = "vm.json"
	savedFormat    = 1
)

// savedVM is vm.json.
type savedVM struct {
	Format int `json:"format"`
	// Template is the template key (templateKey) of the machine saved.
	Template  string `json:"template"`
	VMM       string `json:"vmm"`
	Accel     Accel  `json:"accel"`
	MemoryMiB int    `json:"memory_mib"`
	VCPUs     int    `json:"vcpus"`
	// Interpreter: the session keeps a live interpreter.
	Interpreter bool `json:"interpreter"`
	// CPUUsedNS is the QEMU CPU time of the session's runs so far, which
	// its budget (Config.SessionCPUTime) keeps counting from.
	CPUUsedNS int64 `json:"cpu_used_ns"`
	// FileOps is the last file operation's id.
	FileOps uint64 `json:"file_ops"`
	SaveMS  int64  `json:"save_ms"`
	Bytes   int64  `json:"state_bytes"`
	// SharedRAM: the memory is in ram, not in vm (see shareState).
	SharedRAM bool `json:"shared_ram,omitempty"`
}

var (
	_ engine.StateSaver    = (*vmSession)(nil)
	_ engine.StateRestorer = (*backend)(nil)
)

// SaveState implements engine.StateSaver: the VM, paused, is migrated to
// dir/vm, then killed and its uid released. A session with a network is
// refused (moat.ErrInvalid) and keeps running. When the migration fails
// the VM is killed and the error wraps moat.ErrClosed.
func (ss *vmSession) SaveState(ctx context.Context, dir string) error {
	b := ss.b
	if ss.net != nil {
		return fmt.Errorf("microvm: suspend: a session with a network cannot be suspended with its memory yet (its code's environment holds its own proxy run's CA and placeholders): %w", moat.ErrInvalid)
	}
	key, err := templateKey(b.vmm, b.spec)
	if err != nil {
		return err
	}
	if err := ss.settle(ctx); err != nil {
		return err
	}
	ss.mu.Lock()
	if ss.broken != nil || ss.closed {
		err := ss.broken
		ss.mu.Unlock()
		if err == nil {
			err = fmt.Errorf("microvm: session: %w", moat.ErrClosed)
		}
		return err
	}
	start := time.Now()
	state := filepath.Join(dir, savedStateFile)
	if err := ss.vm.Save(ctx, state); err != nil {
		ss.breakLocked(fmt.Errorf("microvm: suspend: %w", err))
		ss.closed = true
		ss.mu.Unlock()
		ss.vm.Kill()
		return fmt.Errorf("microvm: suspend: %w; the session's VM is killed: %w", err, moat.ErrClosed)
	}
	shared := false
	if b.vmm.SharedRAM {
		// The session's VM stays paused (and is still the session's)
		// until the conversion is done.
		if err := b.shareState(ctx, dir); err != nil {
			ss.mu.Unlock()
			return fmt.Errorf("microvm: suspend: %w", err)
		}
		shared = true
	}
	st, err := os.Stat(state)
	if err == nil {
		err = os.Chmod(state, 0o600)
	}
	var bytes int64
	if err == nil {
		bytes = st.Size()
		if shared {
			// The memory file's nominal size is the guest's: count
			// what it takes on disk.
			var rst os.FileInfo
			if rst, err = os.Stat(filepath.Join(dir, ramFile)); err == nil {
				bytes += min(rst.Size(), rst.Sys().(*syscall.Stat_t).Blocks*512)
			}
		}
	}
	if err == nil {
		m := savedVM{SharedRAM: shared, Bytes: bytes,
			Format: savedFormat, Template: key, VMM: b.vmm.Name(), Accel: b.spec.Accel,
			MemoryMiB: b.spec.MemoryMiB, VCPUs: b.spec.VCPUs, Interpreter: ss.interp,
			CPUUsedNS: int64(ss.used), FileOps: ss.ids.Load(),
			SaveMS: time.Since(start).Milliseconds(),
		}
		var mb []byte
		mb, err = json.MarshalIndent(m, "", "  ")
		if err == nil {
			err = writeFileSync(filepath.Join(dir, savedMetaFile), append(mb, '\n'))
		}
	}
	if err != nil {
		// The VM is paused as it was (migrated, which cont resumes).
		ss.mu.Unlock()
		return fmt.Errorf("microvm: suspend: %w", err)
	}
	ss.closed = true
	if ss.grace != nil {
		ss.grace.Stop()
	}
	ss.mu.Unlock()
	ss.vm.Kill()
	return nil
}

// settle waits, at most idleGrace, for the VM to pause: for the agent's
// Idle after the last run (the next run's python3 is ready), so that the
// saved agent waits in the session's loop with nothing to send.
func (ss *vmSession) settle(ctx context.Context) error {
	deadline := time.Now().Add(idleGrace + time.Second)
	for {
		ss.mu.Lock()
		done := ss.paused || ss.broken != nil || ss.closed
		ss.mu.Unlock()
		if done || time.Now().After(deadline) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// RestoreState implements engine.StateRestorer: a new VM from dir/vm,
// which it only reads, its clock set and its random generator reseeded.
// A state of another machine than this sandbox's (see savedVM.Template),
// or saved with other options, is refused with moat.ErrInvalid.
func (b *backend) RestoreState(ctx context.Context, dir string, opts moat.SessionOptions) (engine.SessionInstance, error) {
	mb, err := os.ReadFile(filepath.Join(dir, savedMetaFile))
	if err != nil {
		return nil, fmt.Errorf("microvm: resume: %w", err)
	}
	var m savedVM
	if err := json.Unmarshal(mb, &m); err != nil {
		return nil, fmt.Errorf("microvm: resume: %s: %v: %w", savedMetaFile, err, moat.ErrInvalid)
	}
	if m.Format != savedFormat {
		return nil, fmt.Errorf("microvm: resume: a state of format %d, this moat reads %d: %w", m.Format, savedFormat, moat.ErrInvalid)
	}
	if b.cfg.Egress != nil {
		return nil, fmt.Errorf("microvm: resume: the state was saved without a network, and this sandbox gives each VM one: %w", moat.ErrInvalid)
	}
	key, err := templateKey(b.vmm, b.spec)
	if err != nil {
		return nil, err
	}
	if m.Template != key {
		return nil, fmt.Errorf("microvm: resume: the state is of another machine (%s, %s, %d MiB, %d vCPU, template %s; this sandbox's is %s): QEMU, its command line, the kernel, the agent, the disk or the guest's memory changed since: %w",
			m.VMM, m.Accel, m.MemoryMiB, m.VCPUs, m.Template, key, moat.ErrInvalid)
	}
	if m.Interpreter != opts.Interpreter {
		return nil, fmt.Errorf("microvm: resume: the state's session has interpreter=%v, the options say %v: %w", m.Interpreter, opts.Interpreter, moat.ErrInvalid)
	}
	spec := b.spec
	spec.Restore = filepath.Join(dir, savedStateFile)
	if m.SharedRAM {
		spec.RAM = filepath.Join(dir, ramFile)
		f, err := openRAM(spec.RAM) // sealed, or refused before any VM starts
		if err == nil {
			err = checkRAM(f, int64(m.MemoryMiB)<<20)
			f.Close()
		}
		if err != nil {
			return nil, fmt.Errorf("microvm: resume: %w", err)
		}
	}
	vm, err := b.vmm.Start(ctx, spec)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, time.Duration(b.cfg.BootTimeout))
	defer cancel()
	if err := vm.Resume(rctx); err != nil {
		vm.Kill()
		return nil, err
	}
	ss := &vmSession{b: b, vm: vm, idle: make(chan struct{}, 1), interp: m.Interpreter,
		budget: time.Duration(b.cfg.SessionCPUTime), used: time.Duration(m.CPUUsedNS)}
	ss.ids.Store(m.FileOps)
	ss.pending = 1 // the Refresh, which the agent answers with Idle
	ss.c = newAgentConn(vm.Agent(), ss.onIdle)
	seed := make([]byte, 64)
	rand.Read(seed)
	if err := ss.c.sendJSON(wire.KindRefresh, wire.Refresh{UnixNano: time.Now().UnixNano(), Seed: seed}); err != nil {
		vm.Kill()
		return nil, err
	}
	if err := ss.awaitIdle(ctx, "resume"); err != nil {
		vm.Kill()
		return nil, err
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.broken != nil {
		return nil, ss.broken
	}
	if err := ss.pauseLocked(); err != nil {
		return nil, err
	}
	return ss, nil
}

// writeFileSync writes a new file of root's alone and syncs it.
func writeFileSync(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}

// shareState turns dir/vm, a stream that carries the guest's memory, into
// the sealed RAM file dir/ram and a stream of the devices alone (see the
// comment at the top): a converter VM, as a uid of its own and frozen,
// loads the stream into its memory, which is dir/ram mapped shared, and is
// migrated out with x-ignore-shared; once it is gone the file is sealed.
func (b *backend) shareState(ctx context.Context, dir string) error {
	stream := filepath.Join(dir, savedStateFile)
	out := stream + ".devices"
	ram := filepath.Join(dir, ramFile)
	spec := b.spec
	spec.Restore, spec.RAM, spec.RAMWritable, spec.Frozen = stream, ram, true, true
	fail := func(err error) error {
		os.Remove(out)
		os.Remove(ram)
		return fmt.Errorf("share the memory: %w", err)
	}
	cctx, cancel := context.WithTimeout(ctx, time.Duration(b.cfg.BootTimeout))
	defer cancel()
	vm, err := b.vmm.Start(cctx, spec)
	if err != nil {
		return fail(err)
	}
	defer vm.Kill()
	qv, ok := vm.(*qemuVM)
	if !ok {
		return fail(errors.New("not a qemu VM"))
	}
	if err := qv.awaitIncoming(cctx); err != nil {
		return fail(err)
	}
	if err := vm.Save(cctx, out); err != nil {
		return fail(err)
	}
	vm.Kill() // and so every process of its uid, which held the file
	if err := sealRAM(ram, int64(spec.MemoryMiB)<<20); err != nil {
		return fail(err)
	}
	if err := os.Chmod(out, 0o600); err != nil {
		return fail(err)
	}
	if f, err := os.Open(out); err == nil {
		err = f.Sync()
		f.Close()
		if err != nil {
			return fail(err)
		}
	}
	if err := os.Rename(out, stream); err != nil {
		return fail(err)
	}
	return nil
}
