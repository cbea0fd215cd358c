package microvm

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
)

// Accel is how the VMM runs guest code: with the host's hardware
// virtualization (KVM) or by emulating the CPU (TCG).
type Accel string

// The accelerators.
const (
	AccelKVM Accel = "kvm"
	AccelTCG Accel = "tcg"
)

// VMM starts virtual machines. QEMU's microvm machine type is the one moat
// implements ([QEMU]); Firecracker or Cloud Hypervisor would be others.
//
// Start is safe for concurrent use. The VM it returns belongs to the
// caller, who must Kill it (Kill is idempotent and waits for the VMM's
// process to go). Cancelling ctx bounds the start only, not the VM's life.
type VMM interface {
	// Name names the VMM and its version, e.g. "qemu 7.2.22".
	Name() string
	// Start boots spec.Kernel, or restores spec.Restore when set, and
	// returns the running VM.
	Start(ctx context.Context, spec VMSpec) (VM, error)
}

// VMSpec describes one VM. The guest has no host directory and, unless
// Net is set, no network device; its only channels to the host are the
// agent's port, for the boot of a template a console written to a file,
// and with Net the connections to the egress proxy's address.
type VMSpec struct {
	Kernel  string // the guest kernel image
	Initrd  string // the initramfs, holding the agent as /init
	Cmdline string // the kernel command line
	Disk    string // the root filesystem image, attached read-only as /dev/vda

	MemoryMiB int
	VCPUs     int
	Accel     Accel
	// NoACPI gives the guest no ACPI tables: for a kernel built without
	// ACPI, which then finds its virtio-mmio devices on the command line.
	NoACPI bool
	// Net, when not nil, gives the guest one network device whose only
	// way out is the egress proxy (see NetSpec). Nil: no network device.
	Net *NetSpec

	// Restore is a state file saved by [VM.Save]. The VM starts paused
	// from it; [VM.Resume] lets it run.
	Restore string
	// RAM, for a [QEMU] with SharedRAM only, is the file that holds the
	// guest's memory; empty means anonymous memory. With RAMWritable the
	// VM creates it (it must not exist), owned by the VM's uid, and maps
	// it shared: its memory is the file's, and Save leaves it out of the
	// stream (the caller seals it once the VM is gone, see sealRAM).
	// Without, it is a sealed file (root's, 0444) that moat opens
	// read-only and the VM maps privately, copy-on-write: the VMs of one
	// file share the pages they do not write, and none can write it.
	RAM         string
	RAMWritable bool
	// Frozen keeps a restored guest paused once the state is loaded
	// (QEMU's -S), until Resume or Save: a state's conversion (see
	// shareState) never runs it.
	Frozen bool
	// stateID and ramID, when not nil, are the versions of Restore and
	// RAM whose digests were checked: Start refuses others (checkVersion).
	stateID, ramID *fileVersion
	// Console receives the guest's serial console, from a goroutine of the
	// VM that ends before Kill returns. Nil means discard.
	Console io.Writer
}

// VM is one running virtual machine.
type VM interface {
	// Agent is the host's end of the guest agent's port.
	Agent() net.Conn
	// Save pauses the guest and writes its state to path. The VM stays
	// paused; the caller kills it afterwards.
	Save(ctx context.Context, path string) error
	// Resume waits for a restore to finish, or for nothing when the guest
	// was paused, and lets the guest run.
	Resume(ctx context.Context) error
	// Pause stops the guest's vCPUs (QMP stop): nothing in the guest runs
	// until Resume.
	Pause(ctx context.Context) error
	// Pid is the VMM process's id on the host.
	Pid() int
	// Exited is closed when the VMM process has ended.
	Exited() <-chan struct{}
	// Kill ends the VMM process and waits for it. It may be called more
	// than once.
	Kill() error
	// Abort sends the VMM process SIGKILL and returns at once; Kill still
	// cleans up.
	Abort()
}

// socketPair returns two connected unix stream sockets: the host's end as a
// net.Conn and the VMM's end as a file to pass to it.
func socketPair() (net.Conn, *os.File, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("microvm: socketpair: %w", err)
	}
	host := os.NewFile(uintptr(fds[0]), "host")
	defer host.Close()
	conn, err := net.FileConn(host)
	if err != nil {
		syscall.Close(fds[1])
		return nil, nil, fmt.Errorf("microvm: socketpair: %w", err)
	}
	return conn, os.NewFile(uintptr(fds[1]), "vmm"), nil
}

// portName names the virtio-serial port of the guest agent; the agent finds
// its device by this name.
const portName = "moat.agent"
