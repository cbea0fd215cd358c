package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/internal/egress"
	"golang.org/x/sys/unix"
)

// QEMU is the [VMM] built on qemu-system-x86_64's microvm machine type:
// direct kernel boot, no firmware tables beyond ACPI, no PCI, virtio-mmio
// devices only, and -nodefaults so that nothing is there that moat did not
// ask for (no network card, no display, no USB). Its zero value is not
// usable; fill in Binary.
type QEMU struct {
	// Binary is the path of qemu-system-x86_64.
	Binary string
	// Version is what the binary says, e.g. "7.2.22".
	Version string
	// Credentials, when not nil, returns the uid, gid and supplementary
	// groups (the group of /dev/kvm, say) of one QEMU process, and release,
	// called once the process is gone: each VM has a uid of its own. Nil
	// means QEMU runs as moat's own user (root): only the KVM probe does.
	Credentials func() (uid, gid int, groups []uint32, release func(), err error)
	// SharedRAM: this QEMU's memory-backend-file takes readonly=on (QEMU
	// 8.2 and later; Debian 12's 7.2 does not), so that VMs restored from
	// one saved state can map its RAM file copy-on-write and share its
	// pages (see VMSpec.RAM). Every VM then has its memory as the object
	// "ram" and migrates with x-ignore-shared.
	SharedRAM bool
	// Tag marks every QEMU process in its command line (-name), so that
	// leftovers can be found: "moat-vm:OWNER:ID", OWNER being the owner id
	// of package owner.
	Tag func() string
}

// Name implements VMM.
func (q *QEMU) Name() string { return "qemu " + q.Version }

// qemuVM is one QEMU process.
type qemuVM struct {
	cmd     *exec.Cmd
	agent   net.Conn
	mon     *qmp
	stderr  *capture.Buffer
	release func()
	console chan struct{} // closed when the console's copier is done
	exited  chan struct{}
	waitErr error
	// sharedRAM: the VM's memory is the object "ram" (QEMU.SharedRAM);
	// saveIgnoreShared: it is a file mapped shared, which Save leaves out
	// of the stream.
	sharedRAM, saveIgnoreShared bool

	killOnce sync.Once
}

// Descriptors QEMU inherits: the agent's port, the monitor, one more
// (the console's socket for a boot, the state for a restore) and, with
// VMSpec.RAM, the RAM file.
const (
	fdAgent = 3
	fdQMP   = 4
	fdExtra = 5
	fdRAM   = 6
)

// args returns QEMU's command line for spec.
func (q *QEMU) args(spec VMSpec, tag string) []string {
	mem := strconv.Itoa(spec.MemoryMiB) + "M"
	cpu := "max"
	if spec.Accel == AccelKVM {
		// Without arch-capabilities: a nested KVM that rejects writes to
		// that MSR makes QEMU 7.2 abort on an assertion at start.
		cpu = "host,-arch-capabilities"
	}
	machine := "microvm,pcie=off"
	if spec.NoACPI {
		machine += ",acpi=off"
	}
	nic := []string{"-nic", "none"}
	// QEMU's seccomp sandbox denies spawning and the set*id calls, but for
	// a VM with a network, whose user network runs the pipe for each
	// connection to the proxy (see NetSpec) after a setsid. QEMU runs as a
	// uid of its own with no capabilities and no_new_privs (which the
	// seccomp filter's loading sets, and which its children inherit with
	// the filter): set*id cannot change its uid or gain a privilege, and
	// what the pipe and a compromised QEMU could leave behind is killed
	// with the VM (killUID).
	spawn, elevate := "deny", "deny"
	if n := spec.Net; n != nil {
		socket := n.Socket
		if socket == "" {
			socket = "none" // a template's boot: its guest connects nowhere
		}
		nic = []string{
			"-netdev", "user,id=n0,restrict=on,ipv6=off,guestfwd=tcp:" + proxyAddr + ":" + strconv.Itoa(egress.Port) +
				"-cmd:" + escapeOpt(shellQuote(n.Pipe)+" "+pipeArg+" "+shellQuote(socket)),
			"-device", "virtio-net-device,netdev=n0,mac=52:54:00:12:34:56",
		}
		spawn, elevate = "allow", "allow"
	}
	if q.SharedRAM {
		// The guest's memory is the object "ram": a file (by the
		// descriptor moat opened, which QEMU reopens through /proc with
		// the access asked for) or, without VMSpec.RAM, anonymous memory.
		// With x-ignore-shared a migration leaves a shared file's RAM out
		// of the stream (both sides must have it).
		machine += ",memory-backend=ram"
	}
	a := []string{"-name", tag, "-nodefaults", "-no-user-config", "-display", "none"}
	a = append(a, nic...)
	a = append(a,
		"-machine", machine,
		"-accel", accelOpt(spec.Accel),
		"-cpu", cpu,
		"-smp", strconv.Itoa(spec.VCPUs),
		"-m", mem,
		"-no-reboot",
		"-sandbox", "on,obsolete=deny,elevateprivileges="+elevate+",spawn="+spawn+",resourcecontrol=deny",
		"-kernel", spec.Kernel, "-initrd", spec.Initrd, "-append", spec.Cmdline,
		"-drive", "id=root,file="+escapeOpt(spec.Disk)+",format=raw,if=none,readonly=on",
		"-device", "virtio-blk-device,drive=root",
		"-device", "virtio-serial-device,max_ports=2",
		"-chardev", "socket,id=agent,fd=3",
		"-device", "virtserialport,chardev=agent,name="+portName,
		"-chardev", "socket,id=qmp,fd=4",
		"-mon", "chardev=qmp,mode=control",
	)
	if spec.Console != nil && spec.Restore == "" {
		a = append(a, "-chardev", "socket,id=con,fd="+strconv.Itoa(fdExtra), "-serial", "chardev:con")
	} else {
		a = append(a, "-chardev", "null,id=con", "-serial", "chardev:con")
	}
	if q.SharedRAM {
		obj := "memory-backend-ram,id=ram,size=" + mem
		switch {
		case spec.RAM != "" && spec.RAMWritable:
			obj = "memory-backend-file,id=ram,size=" + mem + ",mem-path=/proc/self/fd/" + strconv.Itoa(fdRAM) + ",share=on"
		case spec.RAM != "":
			obj = "memory-backend-file,id=ram,size=" + mem + ",mem-path=/proc/self/fd/" + strconv.Itoa(fdRAM) + ",share=off,readonly=on,rom=off"
		}
		a = append(a, "-object", obj)
	}
	if spec.Frozen {
		a = append(a, "-S")
	}
	switch {
	case spec.Restore != "" && q.SharedRAM:
		// x-ignore-shared is set over QMP before the migration starts
		// (QEMU 10 has no -global for it): see Start.
		a = append(a, "-incoming", "defer")
	case spec.Restore != "":
		a = append(a, "-incoming", "fd:"+strconv.Itoa(fdExtra))
	}
	return a
}

// accelOpt is QEMU's -accel option. Multi-threaded TCG, QEMU's default,
// is faster here than thread=single even with one vCPU.
//
// TCG's translation cache keeps QEMU's default size (tb-size: 1 GiB on a
// host with 2 GiB or more, reserved, not used): it is most of what an idle
// session's QEMU holds of its own (about 40 of 66 MiB after a run of
// print(1), 2026-12-02), but that is the code a python3's start and a run
// translate, which every run of a session executes again. A cache smaller
// than that is flushed on every run, which then translates it all again: with
// tb-size=32 an idle session held 57 MiB and with 16, 39 MiB, but three
// session runs of print(1) took 8.3 and 10.4 s of QEMU's CPU time against
// 1.2-1.7 s with the default, and the first run 1.4 and 1.3 s against
// 0.4-0.6 s. A cache of 40 MiB or more holds the same 40 MiB.
func accelOpt(a Accel) string { return string(a) }

// escapeOpt escapes a value inside a QEMU option list, where a comma must
// be doubled.
func escapeOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// pipeArg makes the agent's binary the egress pipe (see the agent's net.go).
const pipeArg = "egress-pipe"

// shellQuote quotes s for the command line of a guestfwd's cmd:, which
// libslirp splits as a shell would (g_shell_parse_argv) and runs without
// a shell.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// Start implements VMM.
func (q *QEMU) Start(ctx context.Context, spec VMSpec) (VM, error) {
	agentHost, agentVM, err := socketPair()
	if err != nil {
		return nil, err
	}
	defer agentVM.Close()
	qmpHost, qmpVM, err := socketPair()
	if err != nil {
		agentHost.Close()
		return nil, err
	}
	defer qmpVM.Close()
	tag := "moat-vm"
	if q.Tag != nil {
		tag = q.Tag()
	}
	vm := &qemuVM{
		agent:   agentHost,
		stderr:  capture.New(16<<10, nil, nil),
		exited:  make(chan struct{}),
		release: func() {},
	}
	fail := func(err error) (VM, error) {
		agentHost.Close()
		qmpHost.Close()
		vm.release()
		return nil, err
	}
	if spec.RAM != "" && !q.SharedRAM {
		return fail(fmt.Errorf("microvm: %s cannot map a RAM file read-only: %w", q.Name(), moat.ErrUnavailable))
	}
	cmd := exec.Command(q.Binary, q.args(spec, tag)...)
	cmd.Env = []string{}
	cmd.Dir = "/"
	cmd.Stdout = vm.stderr
	cmd.Stderr = vm.stderr
	cmd.ExtraFiles = []*os.File{agentVM, qmpVM}
	var closeAfterStart *os.File // the console's end: its copier ends at QEMU's exit
	if spec.Restore != "" {
		// QEMU reads the state from a descriptor moat opened: the VM's uid
		// needs no access to the template.
		state, err := os.Open(spec.Restore)
		if err != nil {
			return fail(fmt.Errorf("microvm: restore: %w", err))
		}
		defer state.Close()
		if err := checkVersion(state, spec.stateID); err != nil {
			return fail(err)
		}
		cmd.ExtraFiles = append(cmd.ExtraFiles, state)
		if spec.RAM != "" && !spec.RAMWritable {
			// Opened with the state, read-only: a template pruned
			// meanwhile is still whole for this VM, and the VM's uid
			// reopens it (through /proc) read-only or not at all, the
			// file being root's, mode 0444.
			ram, err := openRAM(spec.RAM)
			if err != nil {
				return fail(err)
			}
			defer ram.Close()
			if err := checkVersion(ram, spec.ramID); err != nil {
				return fail(err)
			}
			cmd.ExtraFiles = append(cmd.ExtraFiles, ram)
		}
	} else if spec.Console != nil {
		conHost, conVM, err := socketPair()
		if err != nil {
			return fail(err)
		}
		defer conVM.Close()
		closeAfterStart = conVM
		cmd.ExtraFiles = append(cmd.ExtraFiles, conVM)
		vm.console = make(chan struct{})
		go func() {
			defer close(vm.console)
			defer conHost.Close()
			io.Copy(spec.Console, conHost)
		}()
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	ramUID, ramGID := 0, 0
	if q.Credentials != nil {
		uid, gid, groups, release, err := q.Credentials()
		if err != nil {
			return fail(err)
		}
		vm.release = release
		ramUID, ramGID = uid, gid
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: groups}
		if spec.Net != nil {
			// What QEMU's user network spawns runs as the VM's uid and
			// may outlive QEMU: it is killed before the uid is released.
			vm.release = func() { killUID(uid); release() }
			if spec.Net.Socket != "" {
				if err := os.Chown(spec.Net.Socket, uid, gid); err != nil {
					return fail(fmt.Errorf("microvm: egress: %w", err))
				}
			}
		}
	}
	if spec.RAM != "" && spec.RAMWritable {
		ram, err := createRAM(spec.RAM, ramUID, ramGID)
		if err != nil {
			return fail(err)
		}
		// The file is the VM's uid's while the VM runs, and root's again
		// before that uid goes back to the pool: the next VM of it (any
		// sandbox's) must not open it for writing before the caller
		// seals it, nor ever after (see reclaimRAM).
		release := vm.release
		vm.release = func() {
			reclaimRAM(ram)
			ram.Close()
			release()
		}
		if len(cmd.ExtraFiles) == fdExtra-fdAgent {
			cmd.ExtraFiles = append(cmd.ExtraFiles, nil) // no descriptor 5
		}
		cmd.ExtraFiles = append(cmd.ExtraFiles, ram)
	}
	cmd.WaitDelay = time.Second
	// os/exec hands the child every descriptor not marked close-on-exec,
	// not only ExtraFiles: one that moat's parent left it, or that a
	// library opened with a raw open(2), would be QEMU's, as the VM's uid.
	if err := closeOnExecFrom(3); err != nil {
		return fail(fmt.Errorf("microvm: start: cannot mark moat's descriptors close-on-exec: %w: %w", err, moat.ErrUnavailable))
	}
	err = cmd.Start()
	agentVM.Close() // QEMU holds its ends now: its exit closes the sockets
	qmpVM.Close()
	if closeAfterStart != nil {
		closeAfterStart.Close()
	}
	if err != nil {
		return fail(fmt.Errorf("microvm: start %s: %w", q.Binary, err))
	}
	vm.cmd = cmd
	go func() {
		vm.waitErr = cmd.Wait()
		close(vm.exited)
	}()
	mctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	stop := context.AfterFunc(mctx, func() { qmpHost.SetDeadline(time.Now()) })
	defer stop()
	mon, err := dialQMP(mctx, qmpHost)
	if err != nil {
		vm.Kill()
		qmpHost.Close()
		return nil, vm.explain(err)
	}
	vm.mon = mon
	if q.SharedRAM {
		// Both sides of a migration must agree on x-ignore-shared, which
		// changes the stream's format: it is on where the stream leaves
		// the memory out, because it is in a file. A VM whose memory is
		// its file, mapped shared (a template's boot, a conversion) saves
		// with it; a VM that maps a sealed file loads with it. A session
		// VM's memory is private, so its Save carries the memory (off),
		// and so does the stream a conversion loads (off).
		vm.sharedRAM = true
		vm.saveIgnoreShared = spec.RAM != "" && spec.RAMWritable
		if spec.Restore != "" {
			err := vm.setIgnoreShared(mctx, spec.RAM != "" && !spec.RAMWritable)
			if err == nil {
				err = mon.execute(mctx, "migrate-incoming", map[string]any{"uri": "fd:" + strconv.Itoa(fdExtra)}, nil)
			}
			if err != nil {
				vm.Kill()
				return nil, vm.explain(fmt.Errorf("microvm: start: %w", err))
			}
		}
	}
	return vm, nil
}

// setIgnoreShared sets the migration capability x-ignore-shared.
func (vm *qemuVM) setIgnoreShared(ctx context.Context, on bool) error {
	caps := map[string]any{"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": on}}}
	return vm.mon.execute(ctx, "migrate-set-capabilities", caps, nil)
}

// closeOnExecFrom marks every descriptor of this process from first on
// close-on-exec (ExtraFiles are dup2'ed into the child all the same).
func closeOnExecFrom(first int) error {
	err := unix.CloseRange(uint(first), ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
	if err == nil || !(errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL)) {
		return err
	}
	// Before Linux 5.11: one at a time.
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= first {
			unix.CloseOnExec(fd)
		}
	}
	return nil
}

// killUID kills every process of uid (kill -9 -1 as uid, which the
// kernel carries out at once over the whole process list: a process that
// forks meanwhile cannot escape it). The uid is a VM's own, whose QEMU is
// gone: what is left is what its user network spawned.
func killUID(uid int) {
	cmd := exec.Command(killBinary, "-9", "-1")
	cmd.Env = []string{}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), Groups: []uint32{}}}
	cmd.Run() // it fails when there was nothing to kill
}

// killBinary is procps' kill(1).
var killBinary = "/usr/bin/kill"

// explain adds what QEMU printed to err.
func (vm *qemuVM) explain(err error) error {
	select {
	case <-vm.exited:
	case <-time.After(100 * time.Millisecond):
	}
	if out := bytes.TrimSpace(vm.stderr.Bytes()); len(out) > 0 {
		return fmt.Errorf("%w (qemu: %s)", err, strings.ToValidUTF8(string(out), "?"))
	}
	return err
}

func (vm *qemuVM) Agent() net.Conn         { return vm.agent }
func (vm *qemuVM) Pid() int                { return vm.cmd.Process.Pid }
func (vm *qemuVM) Exited() <-chan struct{} { return vm.exited }

// Save implements VM: stop, then migrate to a file that moat opened and
// passed to QEMU.
func (vm *qemuVM) Save(ctx context.Context, path string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("microvm: save: %w", err)
	}
	defer f.Close()
	if err := vm.mon.execute(ctx, "stop", nil, nil); err != nil {
		return vm.explain(err)
	}
	if vm.sharedRAM {
		if err := vm.setIgnoreShared(ctx, vm.saveIgnoreShared); err != nil {
			return vm.explain(err)
		}
	}
	if err := vm.mon.executeFD(ctx, "getfd", map[string]any{"fdname": "state"}, nil, f); err != nil {
		return vm.explain(err)
	}
	if err := vm.mon.execute(ctx, "migrate", map[string]any{"uri": "fd:state"}, nil); err != nil {
		return vm.explain(err)
	}
	for {
		st, desc, err := vm.mon.migration(ctx)
		if err != nil {
			return vm.explain(err)
		}
		switch st {
		case "completed":
			return nil
		case "failed", "cancelled":
			return vm.explain(fmt.Errorf("microvm: save: migration %s: %s", st, desc))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-vm.exited:
			return vm.explain(errors.New("microvm: save: qemu exited"))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// awaitIncoming waits for a Frozen restore to have loaded its state.
func (vm *qemuVM) awaitIncoming(ctx context.Context) error {
	for {
		st, err := vm.mon.status(ctx)
		if err != nil {
			return vm.explain(err)
		}
		switch st {
		case "paused", "postmigrate", "prelaunch":
			if st != "prelaunch" {
				return nil
			}
			// prelaunch: -S before the incoming migration has begun
			// or while it runs; query-migrate tells.
			mst, desc, err := vm.mon.migration(ctx)
			if err != nil {
				return vm.explain(err)
			}
			switch mst {
			case "completed":
				return nil
			case "failed", "cancelled":
				return vm.explain(fmt.Errorf("microvm: restore: migration %s: %s", mst, desc))
			}
		case "inmigrate", "restore-vm":
		default:
			return vm.explain(fmt.Errorf("microvm: restore: the VM is %s", st))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-vm.exited:
			return vm.explain(errors.New("microvm: restore: qemu exited"))
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Resume implements VM: wait for the incoming migration, then cont.
func (vm *qemuVM) Resume(ctx context.Context) error {
	for {
		st, err := vm.mon.status(ctx)
		if err != nil {
			return vm.explain(err)
		}
		switch st {
		case "running":
			return nil
		case "paused", "postmigrate":
			if err := vm.mon.execute(ctx, "cont", nil, nil); err != nil {
				return vm.explain(err)
			}
			return nil
		case "inmigrate", "prelaunch", "restore-vm":
		default:
			return vm.explain(fmt.Errorf("microvm: restore: the VM is %s", st))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-vm.exited:
			return vm.explain(errors.New("microvm: restore: qemu exited"))
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// Pause implements VM.
func (vm *qemuVM) Pause(ctx context.Context) error {
	if err := vm.mon.execute(ctx, "stop", nil, nil); err != nil {
		return vm.explain(err)
	}
	return nil
}

// Abort implements VM.
func (vm *qemuVM) Abort() {
	if vm.cmd != nil && vm.cmd.Process != nil {
		vm.cmd.Process.Kill()
	}
}

// Kill implements VM.
func (vm *qemuVM) Kill() error {
	vm.killOnce.Do(func() {
		if vm.cmd != nil && vm.cmd.Process != nil {
			vm.cmd.Process.Kill()
			<-vm.exited
		}
		vm.agent.Close()
		if vm.console != nil && vm.cmd != nil && vm.cmd.Process != nil {
			<-vm.console
		}
		if vm.mon != nil {
			vm.mon.close()
		}
		vm.release()
	})
	return nil
}
