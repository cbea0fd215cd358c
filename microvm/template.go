package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// A template is a VM booted once, up to the point where its agent is ready,
// and saved: every sandbox starts as a restore of it.
//
//	STATE/microvm/templates/KEY/state       QEMU's migration stream
//	STATE/microvm/templates/KEY/ram         the guest's memory (QEMU.SharedRAM)
//	STATE/microvm/templates/KEY/meta.json   what it is and how long it took
//	STATE/microvm/templates/KEY/console.log the boot's serial console
//
// The key covers everything that changes what the saved VM holds: the VMM
// and its version, the kernel, the initramfs (and so the agent), the disk,
// the command line, the accelerator, the guest's memory size and vCPUs,
// and the network device. A VM's devices are part of its saved state, so a
// template saved without the egress network device (-nic none) cannot be
// restored with one, nor the other way round: a sandbox with Egress has a
// template of its own, booted with the device (its guestfwd's socket a
// placeholder: nothing connects during the boot) and its initramfs with
// the network modules, and the agent configures the device before the
// save. Each VM restored from it gets its own socket on the same command
// line, which the key leaves out; libslirp saves no guestfwd of the cmd:
// kind, so the restored VM's is the new command line's. One of each kind
// is kept: pruning replaces only a template of the same kind.
//
// With QEMU.SharedRAM the template's boot has its memory in the file ram
// (share=on, the boot VM's uid its owner while it runs), the stream holds
// its devices alone, and ram is then root's, 0444, synced: every VM
// restored maps it copy-on-write and the restores share its pages (see
// ram.go). Without (QEMU 7.2) the stream holds the memory and each
// restore reads its own copy of it.
//
// meta.json has the digests of state and ram. A sandbox checks them once
// (useTemplate, once per process and file version) and each restore then
// refuses, with moat.ErrInvalid, a descriptor of another version of
// either file than the one checked (one fstat: a write, truncation,
// growth or hole punched, or another file renamed in, makes another).

// templateMeta is meta.json.
type templateMeta struct {
	Key         string    `json:"key"`
	VMM         string    `json:"vmm"`
	Kernel      string    `json:"kernel"`       // the release the guest reported
	Image       string    `json:"kernel_image"` // the kernel file it booted
	Disk        string    `json:"disk"`
	Accel       Accel     `json:"accel"`
	MemoryMiB   int       `json:"memory_mib"`
	VCPUs       int       `json:"vcpus"`
	Net         bool      `json:"net,omitempty"`        // booted with the egress network device
	SharedRAM   bool      `json:"shared_ram,omitempty"` // the memory is in ram, shared copy-on-write
	RAMSHA256   string    `json:"ram_sha256,omitempty"` // hashSparse of ram
	StateSHA256 string    `json:"state_sha256"`         // hashSparse of state
	BootMS      int64     `json:"boot_ms"`              // QEMU start to the agent's hello
	GuestMS     int64     `json:"guest_boot_ms"`        // the guest's own clock at hello
	SaveMS      int64     `json:"save_ms"`
	Size        int64     `json:"state_bytes"`
	Created     time.Time `json:"created"`
}

// templateKey names the template of spec.
func templateKey(vmm VMM, spec VMSpec) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "template v1\nvmm=%s\ncmdline=%s\naccel=%s\nmem=%d\nvcpus=%d\nnoacpi=%v\n",
		vmm.Name(), spec.Cmdline, spec.Accel, spec.MemoryMiB, spec.VCPUs, spec.NoACPI)
	if q, ok := vmm.(*QEMU); ok {
		// v2: meta.json has the state's digest, which useTemplate requires.
		fmt.Fprintf(h, "shared_ram=%v\nmeta=v2\n", q.SharedRAM)
		// The whole command line, but for what differs between runs (a
		// VM's egress socket among them).
		var n *NetSpec
		if spec.Net != nil {
			n = &NetSpec{Pipe: spec.Net.Pipe}
		}
		fmt.Fprintf(h, "args=%q\n", q.args(VMSpec{
			Kernel: spec.Kernel, Initrd: spec.Initrd, Disk: spec.Disk, Cmdline: spec.Cmdline,
			MemoryMiB: spec.MemoryMiB, VCPUs: spec.VCPUs, Accel: spec.Accel, NoACPI: spec.NoACPI, Net: n,
			RAM: templateRAM(q, "ram"), RAMWritable: true,
		}, "tag"))
	}
	if err := fileKey(h, spec.Kernel, spec.Initrd, spec.Disk); err != nil {
		return "", fmt.Errorf("microvm: template key: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil))[:24], nil
}

// templateRAM is the RAM file a template's boot writes: path with a QEMU
// that shares saved memory, none (anonymous memory) otherwise.
func templateRAM(vmm VMM, path string) string {
	if q, ok := vmm.(*QEMU); ok && q.SharedRAM {
		return path
	}
	return ""
}

// bootToHello starts a fresh VM from spec and waits, at most timeout, for
// its agent's hello.
func bootToHello(ctx context.Context, vmm VMM, spec VMSpec, timeout time.Duration) (VM, *wire.Hello, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	vm, err := vmm.Start(ctx, spec)
	if err != nil {
		return nil, nil, err
	}
	hello, err := readHello(ctx, vm)
	if err != nil {
		vm.Kill()
		if ctx.Err() != nil && errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("the guest did not report ready within %v", timeout)
		}
		return nil, nil, fmt.Errorf("microvm: boot (%s): %w", spec.Accel, err)
	}
	if spec.Net != nil && hello.Net == "" {
		vm.Kill()
		return nil, nil, errNoNet
	}
	return vm, hello, nil
}

// readHello reads the agent's first frame, which must be a hello.
func readHello(ctx context.Context, vm VM) (*wire.Hello, error) {
	conn := vm.Agent()
	stop := context.AfterFunc(ctx, func() { conn.SetReadDeadline(time.Now()) })
	defer stop()
	defer conn.SetReadDeadline(time.Time{})
	k, p, err := wire.Read(conn, wire.MaxReport)
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = errors.New("the VM ended before its agent was ready")
		}
		return nil, err
	}
	switch k {
	case wire.KindHello:
		var h wire.Hello
		if err := json.Unmarshal(p, &h); err != nil {
			return nil, err
		}
		return &h, nil
	case wire.KindFail:
		return nil, fmt.Errorf("the guest agent failed: %s", p)
	}
	return nil, fmt.Errorf("the guest agent said %s before hello", k)
}

// ensureTemplate returns the template of spec, booting and saving it if it
// is not there yet. Concurrent callers (in this process or another) wait
// for one boot. The files are root's: QEMU gets the state as a descriptor
// and its uid needs no access to them.
func ensureTemplate(ctx context.Context, stateDir string, vmm VMM, spec VMSpec, timeout time.Duration) (dir string, meta *templateMeta, err error) {
	key, err := templateKey(vmm, spec)
	if err != nil {
		return "", nil, err
	}
	dir = filepath.Join(stateDir, "microvm", "templates", key)
	if m, err := readMeta(dir); err == nil {
		return dir, m, nil
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return "", nil, fmt.Errorf("microvm: %w", err)
	}
	unlock, err := lockFile(dir + ".lock")
	if err != nil {
		return "", nil, err
	}
	defer unlock()
	if m, err := readMeta(dir); err == nil {
		return dir, m, nil
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), fmt.Sprintf("%s.tmp-%d-", key, os.Getpid()))
	if err != nil {
		return "", nil, fmt.Errorf("microvm: %w", err)
	}
	defer os.RemoveAll(tmp)
	os.Chmod(tmp, 0o755)
	console := capture.New(256<<10, nil, nil)
	spec.Console = console
	ram := filepath.Join(tmp, ramFile)
	spec.RAM, spec.RAMWritable = templateRAM(vmm, ram), true
	start := time.Now()
	vm, hello, err := bootToHello(ctx, vmm, spec, timeout)
	if err != nil {
		return "", nil, fmt.Errorf("%w%s", err, consoleTail(console.Bytes()))
	}
	defer vm.Kill()
	bootMS := time.Since(start).Milliseconds()
	saveStart := time.Now()
	state := filepath.Join(tmp, "state")
	if err := vm.Save(ctx, state); err != nil {
		return "", nil, fmt.Errorf("microvm: save the template: %w", err)
	}
	saveMS := time.Since(saveStart).Milliseconds()
	vm.Kill() // and every process of its uid, which held the RAM file
	var ramSum string
	if spec.RAM != "" {
		if err := sealRAM(ram, int64(spec.MemoryMiB)<<20); err != nil {
			return "", nil, fmt.Errorf("microvm: save the template: %w", err)
		}
		if ramSum, err = hashFile(ram); err != nil {
			return "", nil, fmt.Errorf("microvm: save the template: %w", err)
		}
	}
	if err := os.WriteFile(filepath.Join(tmp, "console.log"), console.Bytes(), 0o644); err != nil {
		return "", nil, fmt.Errorf("microvm: %w", err)
	}
	st, err := os.Stat(state)
	if err != nil {
		return "", nil, fmt.Errorf("microvm: save the template: %w", err)
	}
	stateSum, err := hashFile(state)
	if err != nil {
		return "", nil, fmt.Errorf("microvm: save the template: %w", err)
	}
	m := &templateMeta{
		Key: key, VMM: vmm.Name(), Kernel: hello.Kernel, Image: spec.Kernel, Disk: spec.Disk, Accel: spec.Accel,
		MemoryMiB: spec.MemoryMiB, VCPUs: spec.VCPUs, Net: spec.Net != nil, SharedRAM: spec.RAM != "", RAMSHA256: ramSum, StateSHA256: stateSum,
		BootMS: bootMS, GuestMS: hello.BootMS, SaveMS: saveMS, Size: st.Size(), Created: time.Now().UTC(),
	}
	b, _ := json.MarshalIndent(m, "", "  ")
	if err := os.WriteFile(filepath.Join(tmp, "meta.json"), append(b, '\n'), 0o644); err != nil {
		return "", nil, fmt.Errorf("microvm: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", nil, fmt.Errorf("microvm: %w", err)
	}
	pruneTemplates(filepath.Dir(dir), m)
	return dir, m, nil
}

// pruneTemplates removes the templates that m supersedes: those of the same
// kernel file, disk file, accelerator, memory and vCPUs, made when one of
// them or the agent or QEMU was different. Each is some 100MB. A sandbox still using one
// makes it again when it next needs it; runs restoring it at this moment
// hold its state open and are not disturbed.
func pruneTemplates(root string, m *templateMeta) {
	ents, _ := os.ReadDir(root)
	for _, e := range ents {
		if !e.IsDir() || e.Name() == m.Key || strings.Contains(e.Name(), ".tmp-") {
			continue
		}
		dir := filepath.Join(root, e.Name())
		old, err := readMeta(dir)
		if err != nil || old.Image != m.Image || old.Disk != m.Disk ||
			old.Accel != m.Accel || old.MemoryMiB != m.MemoryMiB || old.VCPUs != m.VCPUs || old.Net != m.Net {
			continue
		}
		unlock, err := lockFile(dir + ".lock")
		if err != nil {
			continue
		}
		os.RemoveAll(dir)
		unlock()
	}
}

// templateFiles are the versions of a template's files that their
// digests were checked on: each restore's descriptors must be these.
type templateFiles struct {
	mu         sync.Mutex
	state, ram *fileVersion // ram: nil without QEMU.SharedRAM
}

func (tf *templateFiles) get() (state, ram *fileVersion) {
	tf.mu.Lock()
	defer tf.mu.Unlock()
	return tf.state, tf.ram
}

func (tf *templateFiles) set(state, ram *fileVersion) {
	tf.mu.Lock()
	defer tf.mu.Unlock()
	tf.state, tf.ram = state, ram
}

// verifyTemplate checks the digests of the template in dir, whose
// meta.json says meta (once per process and file version), and returns
// the versions checked: a damaged state or RAM file is refused with
// moat.ErrInvalid.
func verifyTemplate(dir string, meta *templateMeta) (state, ram *fileVersion, err error) {
	f, err := os.Open(filepath.Join(dir, "state"))
	if err != nil {
		return nil, nil, fmt.Errorf("microvm: template: %w", err)
	}
	defer f.Close()
	sid, err := verifyDigest(f, meta.StateSHA256)
	if err != nil {
		return nil, nil, err
	}
	if !meta.SharedRAM {
		return &sid, nil, nil
	}
	rid, err := verifyRAM(filepath.Join(dir, ramFile), int64(meta.MemoryMiB)<<20, meta.RAMSHA256)
	if err != nil {
		return nil, nil, err
	}
	return &sid, &rid, nil
}

// useTemplate makes dir, whose meta.json says meta, the template b
// restores from, once its files are checked (verifyTemplate).
func (b *backend) useTemplate(dir string, meta *templateMeta) error {
	state, ram, err := verifyTemplate(dir, meta)
	if err != nil {
		return err
	}
	b.tmpl, b.meta = dir, meta
	b.tmplFiles = &templateFiles{state: state, ram: ram}
	return nil
}

func readMeta(dir string) (*templateMeta, error) {
	b, err := os.ReadFile(filepath.Join(dir, "meta.json"))
	if err != nil {
		return nil, err
	}
	var m templateMeta
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(dir, "state")); err != nil {
		return nil, err
	}
	if m.SharedRAM {
		f, err := openRAM(filepath.Join(dir, ramFile))
		if err != nil {
			return nil, err
		}
		defer f.Close()
		if err := checkRAM(f, int64(m.MemoryMiB)<<20); err != nil {
			return nil, err
		}
	}
	return &m, nil
}

// consoleTail returns the end of a boot's console log, for an error
// message.
func consoleTail(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	if len(b) > 1500 {
		b = b[len(b)-1500:]
	}
	return "; console: " + strings.ToValidUTF8(strings.TrimSpace(string(b)), "?")
}
