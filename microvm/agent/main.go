// Command agent is moat's guest agent: PID 1 of the microvm level's virtual
// machine. It is built static (CGO_ENABLED=0) and placed at /init in the
// initramfs that moat generates.
//
// At boot it mounts what the guest needs, loads the kernel modules listed in
// /modules/order (virtio-mmio, virtio-blk, virtio-console, overlay; none for
// a kernel that has them built in), mounts the shared root filesystem
// read-only from /dev/vda under a writable tmpfs layer (overlayfs), prepares
// a cgroup for the run, configures the network device when the VM has one
// (eth0: 10.0.2.15/24, no default route; see net.go), starts python3 once
// in a run's cgroup (chrooted into the root filesystem, as an unprivileged
// uid) to fill the page cache and ends it, opens the virtio-serial port
// named moat.agent and says Hello. moat saves the VM at that point and
// starts every VM as a restore of it.
//
// Run on the host by QEMU's user network as `agent egress-pipe SOCKET`, the
// binary is the pipe between one guest connection and moat's egress socket
// (see egressPipe).
//
// After the restore, while the VM waits in moat's pool, moat sends a
// Refresh: the agent sets the clock, reseeds the kernel's random generator,
// starts the run's python3 (a zygote, waiting for its code) after the
// reseed, so that no two VMs of one template share Python's string hash
// secret, its address layout or its stack canary (code never runs in a
// python3 that started before the VM's latest refresh; see freshen), and
// says Idle. Then moat sends one Run, or a Session (whose live
// interpreter, in an interpreter session, is that python3 handed the
// interpreter's driver as its code). For a Run the agent
// sets the clock again, reseeds the kernel's random generator again, sizes
// the writable layer to the disk limit, sets the cgroup's memory and
// process limits and python3's rlimits, and hands python3 the code. It
// streams stdout and stderr to the host, enforces the CPU time, and sends
// the evidence of how the code ended (python3's wait status, the cgroup's
// events, the files at the size limit, a full disk); the host judges it,
// keeps the wall time and throws the VM away.
//
// In a session the agent serves many Runs, one at a time, each in a cgroup
// of its own whose every process it kills when python3 ends, and keeps the
// working directory between them; after each it starts the next run's
// python3 and says Idle, and the host pauses the VM until the next run. It
// also carries out the session's file operations inside the guest, on names
// resolved beneath the working directory without following any symbolic
// link (openat2 with RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS). A session
// the host suspended (its VM saved whole) comes back as a restore of that
// state, its agent where it was, in the session's loop: the host's first
// frame is then Refresh, for which it sets the clock and reseeds the
// kernel's random generator, as for a Run, and replaces the next run's
// python3 (or an interpreter that has not run code yet), which every fork
// of that state would otherwise share.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/microvm/internal/wire"
)

const (
	portName  = "moat.agent"
	rootDisk  = "/dev/vda"
	lowerDir  = "/rootfs"
	upperFS   = "/upper" // the writable tmpfs: overlay upper, work and /dev/shm
	newRoot   = "/newroot"
	cgroupDir = "/sys/fs/cgroup"
	codeDir   = "/.moat" // a tmpfs of its own in the run's root: the code and the zygote
	workDir   = "/work"
	python    = "/usr/bin/python3"
	runUID    = 1000
	runGID    = 1000
)

// consoleLog writes a line to the kernel console, for whoever reads the
// VM's serial port (only the template boot's is kept).
func consoleLog(format string, args ...any) {
	msg := fmt.Sprintf("moat-agent: "+format+"\n", args...)
	if f, err := os.OpenFile("/dev/kmsg", os.O_WRONLY, 0); err == nil {
		f.WriteString(msg)
		f.Close()
		return
	}
	os.Stderr.WriteString(msg)
}

func main() {
	if len(os.Args) == 3 && os.Args[1] == pipeArg && os.Getpid() != 1 {
		os.Exit(egressPipe(os.Args[2], os.Stdin, os.Stdout))
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "moat guest agent: must run as PID 1 of a moat VM")
		os.Exit(2)
	}
	reaped = newReaper()
	a := &agent{}
	if err := a.boot(); err != nil {
		a.fatal(fmt.Errorf("boot: %w", err))
	}
	if err := a.serve(); err != nil {
		a.fatal(err)
	}
	hang()
}

type agent struct {
	port *os.File
	mu   sync.Mutex // serializes frames on port
	// zygote is python3 waiting for the next run's code; groups counts the
	// run cgroups made, to name the next.
	zygote *zygote
	groups int
	// gen counts the frames that said the VM is a new copy of a saved
	// state (the template, or a suspended session): a Refresh, a Session,
	// a Run that comes first. A python3 started in an earlier generation
	// was saved with the state, and so is in every copy of it with the
	// same string hash secret (_Py_HashSecret, drawn at its start and
	// fixed for its life): no code ever runs in one, except in the live
	// interpreter that holds a session's variables (see freshen).
	gen int
	// files is the session's working directory (nil outside a session).
	files *files
	// interpMode: the session keeps a live interpreter, interp (nil once
	// it has ended, until the next run starts a fresh one).
	interpMode bool
	interp     *interp
	// env is what the code's environment gets on top of pythonCmd's: the
	// egress proxy's (nil for a VM without network).
	env []string
}

// zygoteSource is the Python program that, once started, closes
// descriptor 4 (the agent then knows it is ready), waits on descriptor 3
// for its start: a mode, the path of the code and the KEY=VALUE entries
// the run adds to its environment (the egress proxy's, which a VM restored
// from the template learns only with its run), NUL-separated, up to the
// end of the pipe. The mode is "run" (a run's code) or "driver" (a
// session's live interpreter: driverSource, whose records and reports
// pipes are the zygote's descriptors 5 and 6, made its 3 and 4; see
// interpFromZygote). Either way descriptors 5 and 6 are closed before the
// code runs; then it runs the code as `python3 PATH`
// would: as module __main__ with its own globals, sys.argv and sys.path[0]
// set from PATH, the traceback of an uncaught exception printed by
// sys.excepthook without the zygote's frame and exit status 1 (an uncaught
// KeyboardInterrupt, after the clean-up, by SIGINT), SystemExit handled by
// the interpreter. What it cannot make as a fresh interpreter would: the
// code runs one frame below the zygote's, and code that is not UTF-8 and
// declares no encoding gets compile()'s SyntaxError, not the tokenizer's
// wording of it. (The string hash secret is a fresh interpreter's: the
// zygote starts in the VM's own copy, after its refresh.)
// TestZygoteAsPython3 compares the two.
const zygoteSource = `import os, sys
def _moat_main():
    os.close(4)
    with os.fdopen(3, 'rb') as f:
        mode, path, *env = f.read().split(b'\0')
    if mode == b'driver':
        os.dup2(5, 3)
        os.dup2(6, 4)
    elif mode != b'run':
        os._exit(2)
    for fd in 5, 6:
        try:
            os.close(fd)
        except OSError:
            pass
    path = path.decode()
    for kv in env:
        k, _, v = kv.partition(b'=')
        os.environb[k] = v
    with open(path, 'rb') as f:
        src = f.read()
    main = type(sys)('__main__')
    main.__file__ = path
    main.__cached__ = None
    main.__loader__ = type(__loader__)('__main__', path)
    # What else the interpreter puts in a script's namespace: it puts the
    # same in the zygote's, which is one.
    main.__builtins__ = __builtins__
    if '__annotations__' in globals():
        main.__annotations__ = {}
    sys.modules['__main__'] = main
    sys.argv[:] = [path]
    sys.orig_argv[:] = [sys.orig_argv[0], path]
    sys.path[0] = os.path.dirname(path)
    try:
        if b'\0' in src:
            # What the interpreter's tokenizer says; compile() would raise
            # ValueError instead.
            i = src.index(b'\0')
            line = src[src.rfind(b'\n', 0, i) + 1:].split(b'\n', 1)[0]
            raise SyntaxError('source code cannot contain null bytes',
                              (path, src.count(b'\n', 0, i) + 1, None, line.decode('utf-8', 'replace')))
        code = compile(src, path, 'exec', dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return KeyboardInterrupt if type(e) is KeyboardInterrupt else 1
    return 0
_moat_status = _moat_main()
del _moat_main
if _moat_status is KeyboardInterrupt:
    # The interpreter ends on it as python3 does: the clean-up, then
    # SIGINT. The traceback is printed already.
    sys.excepthook = lambda *args: None
    raise KeyboardInterrupt
if _moat_status:
    raise SystemExit(_moat_status)
`

// zygote is python3 waiting for its code, in a cgroup of its own.
type zygote struct {
	cmd       *exec.Cmd
	group     string   // its cgroup's directory
	start     *os.File // write the start (see zygoteSource) and close: the code runs
	out, errs *os.File // its stdout and stderr
	// records and reports are the agent's ends of the driver's pipes
	// (its descriptors 5 and 6), which it closes unless it becomes a
	// session's interpreter (interpFromZygote).
	records, reports *os.File
	gen              int // the agent's gen when it started
}

// discard ends z, which has not been given code.
func (z *zygote) discard() {
	killGroup(z.group)
	z.start.Close()
	z.out.Close()
	z.errs.Close()
	z.closeDriver()
	go func() { reaped.wait(z.cmd.Process.Pid); removeGroup(z.group) }()
}

// closeDriver closes the agent's ends of the driver's pipes, which a run's
// zygote does not use.
func (z *zygote) closeDriver() {
	z.records.Close()
	z.reports.Close()
}

// newZygote starts the next run's python3 in a new cgroup, in the
// current generation, and waits until it is ready.
func (a *agent) newZygote() error {
	a.groups++
	z, err := startZygote(fmt.Sprintf("%s/run-%d", cgroupDir, a.groups))
	if err != nil {
		return err
	}
	z.gen = a.gen
	a.zygote = z
	return nil
}

// zygoteReady bounds the wait for a new python3 to be ready.
const zygoteReady = time.Minute

// startZygote starts zygoteSource in the run's root and uid, in a new
// cgroup, group, and waits until it is ready: what is left for a run is
// the code.
func startZygote(group string) (*zygote, error) {
	if err := os.Mkdir(group, 0o755); err != nil {
		return nil, err
	}
	cg, err := os.Open(group)
	if err != nil {
		return nil, err
	}
	defer cg.Close()
	goR, goW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer goR.Close()
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer outW.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer errW.Close()
	devNull, err := os.Open("/dev/null")
	if err != nil {
		return nil, err
	}
	defer devNull.Close()
	cmd := pythonCmd(codeDir + "/zygote.py")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devNull, outW, errW
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer readyR.Close()
	recR, recW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer recR.Close()
	repR, repW, err := os.Pipe()
	if err != nil {
		recW.Close()
		return nil, err
	}
	defer repW.Close()
	cmd.ExtraFiles = []*os.File{goR, readyW, recR, repW}
	cmd.SysProcAttr.UseCgroupFD = true
	cmd.SysProcAttr.CgroupFD = int(cg.Fd())
	err = reaped.start(cmd)
	readyW.Close()
	if err != nil {
		recW.Close()
		repR.Close()
		return nil, fmt.Errorf("start python3: %w", err)
	}
	z := &zygote{cmd: cmd, group: group, start: goW, out: outR, errs: errR, records: recW, reports: repR}
	// python3 closes its end when it is ready, or dies.
	readyR.SetReadDeadline(time.Now().Add(zygoteReady))
	if _, err := readyR.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		cmd.Process.Kill()
		z.closeDriver()
		return nil, fmt.Errorf("python3 was not ready within %v: %v", zygoteReady, err)
	}
	return z, nil
}

func (a *agent) send(k wire.Kind, p []byte) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return wire.Write(a.port, k, p)
}

func (a *agent) sendJSON(k wire.Kind, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return a.send(k, b)
}

// fatal reports err to the host if it can and ends the VM, so that QEMU
// exits and the host sees the failure at once.
func (a *agent) fatal(err error) {
	consoleLog("fatal: %v", err)
	if a.port != nil {
		msg := err.Error()
		if len(msg) > wire.MaxReport {
			msg = msg[:wire.MaxReport]
		}
		a.send(wire.KindFail, []byte(msg))
	}
	// QEMU runs with -no-reboot: a reboot ends it, whether or not the
	// kernel can power the machine off.
	unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	hang()
}

func hang() {
	for {
		time.Sleep(time.Hour)
	}
}

type mnt struct {
	src, dst, fstype string
	flags            uintptr
	data             string
}

func mountAll(ms []mnt) error {
	for _, m := range ms {
		if err := os.MkdirAll(m.dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s on %s: %w", m.fstype, m.dst, err)
		}
	}
	return nil
}

const nosuid = unix.MS_NOSUID | unix.MS_NODEV

func (a *agent) boot() error {
	if err := mountAll([]mnt{
		{"proc", "/proc", "proc", nosuid | unix.MS_NOEXEC, ""},
		{"sysfs", "/sys", "sysfs", nosuid | unix.MS_NOEXEC, ""},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
		{"cgroup2", cgroupDir, "cgroup2", nosuid | unix.MS_NOEXEC, ""},
	}); err != nil {
		return err
	}
	if err := loadModules("/modules"); err != nil {
		return err
	}
	if err := waitFor(rootDisk, 10*time.Second); err != nil {
		return err
	}
	if err := mountAll([]mnt{
		{rootDisk, lowerDir, "ext4", unix.MS_RDONLY | nosuid, ""},
		// Sized at run time from the disk limit (a remount).
		{"tmpfs", upperFS, "tmpfs", nosuid, "size=1m,nr_inodes=1024,mode=0755"},
	}); err != nil {
		return err
	}
	for _, d := range []string{"u", "w", "shm"} {
		if err := os.Mkdir(filepath.Join(upperFS, d), 0o755); err != nil {
			return err
		}
	}
	if err := os.Chmod(filepath.Join(upperFS, "shm"), 0o1777); err != nil {
		return err
	}
	if err := mountAll([]mnt{{"overlay", newRoot, "overlay", nosuid,
		"lowerdir=" + lowerDir + ",upperdir=" + upperFS + "/u,workdir=" + upperFS + "/w"}}); err != nil {
		return err
	}
	if err := prepareRoot(); err != nil {
		return err
	}
	if err := prepareCgroup(); err != nil {
		return err
	}
	netDone, err := setupNet()
	if err != nil {
		return err
	}
	if err := os.WriteFile(newRoot+codeDir+"/zygote.py", []byte(zygoteSource), 0o444); err != nil {
		return err
	}
	// python3 starts once now, as the run's uid in a run's cgroup, so that
	// the page cache saved with the template holds python3 and what it
	// reads to start, and is ended: the template keeps no python3. Each VM
	// restored from it starts its own after its refresh, before any code
	// runs (see freshen); its hash secret, drawn at its start, is then the
	// VM's own. Keeping the template's python3 only to kill it after the
	// restore measured no faster (TCG, 2 x 8 runs: the new python3 ready
	// in a median 1207/1261 ms without it, 1319/1347 ms with it).
	// A VM that is never saved (moat.nosave: a cold sandbox's) skips it.
	if !cmdlineHas(noSaveArg) {
		if err := a.newZygote(); err != nil {
			return err
		}
		a.zygote.discard()
		a.zygote = nil
	}
	port, err := findPort(portName, 10*time.Second)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(port, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	a.port = f
	var uts unix.Utsname
	unix.Uname(&uts)
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts)
	return a.sendJSON(wire.KindHello, wire.Hello{
		Kernel: unix.ByteSliceToString(uts.Release[:]),
		BootMS: ts.Nano() / 1e6,
		Net:    netDone,
	})
}

// noSaveArg on the kernel's command line says the VM is never saved (see
// microvm's noSaveArg).
const noSaveArg = "moat.nosave"

// cmdlineHas says whether the kernel's command line has the word arg.
func cmdlineHas(arg string) bool {
	b, err := os.ReadFile("/proc/cmdline")
	return err == nil && slices.Contains(strings.Fields(string(b)), arg)
}

// egress takes the code's part of the VM's network: the environment, and
// the CA bundle, which it places at caFile. Nil is no network.
func (a *agent) egress(e *wire.Egress) error {
	if e == nil {
		return nil
	}
	for _, kv := range e.Env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" || strings.ContainsRune(kv, 0) {
			return fmt.Errorf("egress: bad environment entry %q", kv)
		}
	}
	a.env = e.Env
	if e.CABundle != "" {
		return writeCA(e.CABundle)
	}
	return nil
}

// loadModules loads, in order, the modules named in dir/order.
func loadModules(dir string) error {
	order, err := os.ReadFile(filepath.Join(dir, "order"))
	if err != nil {
		return err
	}
	for _, name := range strings.Fields(string(order)) {
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		err = unix.FinitModule(int(f.Fd()), "", 0)
		f.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("load module %s: %w", name, err)
		}
	}
	return nil
}

func waitFor(path string, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not appear within %v", path, d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// findPort returns the device of the virtio-serial port called name.
func findPort(name string, d time.Duration) (string, error) {
	deadline := time.Now().Add(d)
	for {
		ents, _ := os.ReadDir("/sys/class/virtio-ports")
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join("/sys/class/virtio-ports", e.Name(), "name"))
			if err == nil && strings.TrimSpace(string(b)) == name {
				dev := "/dev/" + e.Name()
				if err := waitFor(dev, time.Second); err != nil {
					return "", err
				}
				return dev, nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no virtio-serial port named %s within %v", name, d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// prepareRoot makes the run's view of the root filesystem: a working
// directory of its own, /tmp, a /proc that hides other users' processes and
// a read-only /dev with the usual character devices and a /dev/shm on the
// size-limited layer.
func prepareRoot() error {
	for _, d := range []struct {
		path     string
		mode     os.FileMode
		uid, gid int
	}{
		{workDir, 0o700, runUID, runGID},
		{"/tmp", 0o1777, 0, 0},
		{"/var/tmp", 0o1777, 0, 0},
		{codeDir, 0o755, 0, 0},
		{"/proc", 0o555, 0, 0},
		{"/dev", 0o755, 0, 0},
	} {
		p := newRoot + d.path
		os.MkdirAll(p, d.mode)
		if err := os.Chown(p, d.uid, d.gid); err != nil {
			return err
		}
		if err := os.Chmod(p, d.mode); err != nil {
			return err
		}
	}
	if err := mountAll([]mnt{
		// Sized for each run's code (a remount): the code never takes
		// from the run's disk.
		{"tmpfs", newRoot + codeDir, "tmpfs", nosuid | unix.MS_NOEXEC, "size=64k,nr_inodes=16,mode=0755"},
		{"proc", newRoot + "/proc", "proc", nosuid | unix.MS_NOEXEC, "hidepid=2"},
		{"tmpfs", newRoot + "/dev", "tmpfs", unix.MS_NOSUID | unix.MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755"},
	}); err != nil {
		return err
	}
	dev := newRoot + "/dev"
	for _, n := range []struct {
		name         string
		major, minor uint32
	}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}} {
		p := filepath.Join(dev, n.name)
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(n.major, n.minor))); err != nil {
			return fmt.Errorf("mknod %s: %w", p, err)
		}
		os.Chmod(p, 0o666)
	}
	for name, target := range map[string]string{
		"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2",
	} {
		if err := os.Symlink(target, filepath.Join(dev, name)); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dev+"/shm", 0o1777); err != nil {
		return err
	}
	if err := unix.Mount(upperFS+"/shm", dev+"/shm", "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind /dev/shm: %w", err)
	}
	if err := unix.Mount("", dev, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("remount /dev read-only: %w", err)
	}
	return nil
}

func prepareCgroup() error {
	if err := os.WriteFile(cgroupDir+"/cgroup.subtree_control", []byte("+memory +pids"), 0); err != nil {
		return fmt.Errorf("enable cgroup controllers: %w", err)
	}
	return nil
}

// serve waits for the frames after the restore — a Refresh, which the
// host sends while the VM waits in its pool, then a Run or a Session, or
// one of these alone — and carries them out.
func (a *agent) serve() error {
	refreshed := false
	for {
		k, p, err := wire.Read(a.port, 0)
		if err != nil {
			return fmt.Errorf("read run: %w", err)
		}
		switch {
		case k == wire.KindRefresh && !refreshed:
			var r wire.Refresh
			if err := json.Unmarshal(p, &r); err != nil {
				return fmt.Errorf("refresh: %w", err)
			}
			if err := a.restored(r.UnixNano, r.Seed); err != nil {
				return err
			}
			if err := a.send(wire.KindIdle, nil); err != nil {
				return err
			}
			refreshed = true
		case k == wire.KindRun:
			var r wire.Run
			if err := json.Unmarshal(p, &r); err != nil {
				return fmt.Errorf("run: %w", err)
			}
			return a.oneRun(&r, refreshed)
		case k == wire.KindSession:
			var s wire.Session
			if err := json.Unmarshal(p, &s); err != nil {
				return fmt.Errorf("session: %w", err)
			}
			return a.session(&s, refreshed)
		default:
			return fmt.Errorf("want a refresh, a run or a session frame, got %s", k)
		}
	}
}

// restored sets the clock and reseeds the random generator of a VM the
// host says is a new copy of a saved state, then makes the python3 that
// waits for the next run's code one of this copy's own (freshen): started
// after the reseed, it draws a hash secret no other copy has.
func (a *agent) restored(unixNano int64, seed []byte) error {
	if err := refresh(unixNano, seed); err != nil {
		return err
	}
	a.gen++
	return a.freshen()
}

// freshen makes sure that what waits for the next run's code started in
// the current generation: a zygote started earlier is replaced; so is a
// session's interpreter that has run no code yet. A session's first
// interpreter is the zygote of the current generation when there is one
// (a pooled VM's, started at its Refresh), handed the driver. An interpreter that has
// is the session's memory and is kept, hash secret and all: every fork of
// one suspended state shares it (the declared exception; see the
// package doc of microvm).
func (a *agent) freshen() error {
	if a.interpMode {
		if z := a.zygote; z != nil {
			a.zygote = nil
			if a.interp == nil && z.gen == a.gen {
				// The python3 the pool's Refresh started, after the
				// reseed, in this VM alone: it becomes the interpreter,
				// its start already done.
				it, err := a.interpFromZygote(z)
				if err != nil {
					return fmt.Errorf("start the interpreter: %w", err)
				}
				a.interp = it
				return nil
			}
			z.discard()
		}
		return a.freshInterp()
	}
	if z := a.zygote; z != nil {
		if z.gen == a.gen {
			return nil
		}
		a.zygote = nil
		z.discard()
	}
	if err := a.newZygote(); err != nil {
		return fmt.Errorf("start the run's python3: %w", err)
	}
	return nil
}

// oneRun carries out the one Run of a VM restored from the template.
// Unless a Refresh came first, the Run is the first word of the VM's
// copy, and its python3 starts now.
func (a *agent) oneRun(r *wire.Run, refreshed bool) error {
	var err error
	if refreshed {
		err = refresh(r.UnixNano, r.Seed)
	} else {
		err = a.restored(r.UnixNano, r.Seed)
	}
	if err != nil {
		return err
	}
	if err := sizeLayer(r.Disk); err != nil {
		return err
	}
	if err := a.egress(r.Egress); err != nil {
		return err
	}
	exit, err := a.run(r, &runState{})
	if err != nil {
		return err
	}
	return a.sendJSON(wire.KindExit, exit)
}

// sizeLayer sizes the writable layer to the disk limit.
func sizeLayer(disk int64) error {
	inodes := max(disk/(4<<10), 64) + 64
	if err := unix.Mount("tmpfs", upperFS, "tmpfs", unix.MS_REMOUNT|nosuid,
		fmt.Sprintf("size=%d,nr_inodes=%d", disk, inodes)); err != nil {
		return fmt.Errorf("size the writable layer: %w", err)
	}
	return nil
}

// session serves a session's runs and file operations until the VM is
// killed. Runs take turns: the next waits for the previous one's end and
// for its python3 to be ready. File operations are carried out as they
// come, during a run too.
//
// Unless a Refresh came first (refreshed), the Session is the first word
// of the VM's copy. Its first run's python3 (or its interpreter) starts
// after the refresh, with the session's environment, before the Idle.
func (a *agent) session(s *wire.Session, refreshed bool) error {
	if err := refresh(s.UnixNano, s.Seed); err != nil {
		return err
	}
	if !refreshed {
		a.gen++
	}
	if err := sizeLayer(s.Disk); err != nil {
		return err
	}
	if err := a.egress(s.Egress); err != nil {
		return err
	}
	f, err := openFiles(newRoot+workDir, runUID, runGID, s.FileSize, a)
	if err != nil {
		return err
	}
	a.files = f
	if s.Interpreter {
		if err := os.WriteFile(newRoot+codeDir+"/driver.py", []byte(driverSource), 0o444); err != nil {
			return err
		}
		a.interpMode = true
	}
	// What waits for the first run starts now, after the refresh, with
	// the session's environment (or is the Refresh's, when one came).
	if err := a.freshen(); err != nil {
		return err
	}
	turn := make(chan struct{}, 1) // held by the run in progress
	var cur *runState
	if err := a.send(wire.KindIdle, nil); err != nil {
		return err
	}
	for {
		k, p, err := wire.Read(a.port, 0)
		if err != nil {
			return fmt.Errorf("session: read: %w", err)
		}
		switch k {
		case wire.KindRun:
			var r wire.Run
			if err := json.Unmarshal(p, &r); err != nil {
				return fmt.Errorf("session: run: %w", err)
			}
			st := &runState{}
			cur = st
			go a.sessionRun(&r, st, turn)
		case wire.KindKill:
			if cur != nil {
				cur.kill()
			}
		case wire.KindRefresh:
			// The VM is a restore of the session's own saved state, one
			// of its forks perhaps.
			var r wire.Refresh
			if err := json.Unmarshal(p, &r); err != nil {
				return fmt.Errorf("session: refresh: %w", err)
			}
			go a.sessionRefresh(&r, turn)
		case wire.KindFile:
			var op wire.File
			if err := json.Unmarshal(p, &op); err != nil {
				return fmt.Errorf("session: file: %w", err)
			}
			a.files.do(&op)
		case wire.KindData:
			id, b, err := wire.DataID(p)
			if err != nil {
				return fmt.Errorf("session: %w", err)
			}
			a.files.data(id, b)
		default:
			return fmt.Errorf("session: want a run, kill, refresh or file frame, got %s", k)
		}
	}
}

// sessionRefresh refreshes a session's VM restored from its saved state,
// once the run in progress (none, as the host saves an idle VM) is done,
// makes the next run's python3 this copy's own and says Idle.
func (a *agent) sessionRefresh(r *wire.Refresh, turn chan struct{}) {
	turn <- struct{}{}
	defer func() { <-turn }()
	if err := a.restored(r.UnixNano, r.Seed); err != nil {
		a.fatal(fmt.Errorf("session: refresh: %w", err))
	}
	a.send(wire.KindIdle, nil)
}

// sessionRun carries out one run of a session once the previous one is
// done, then makes the next run's python3 ready and says Idle.
func (a *agent) sessionRun(r *wire.Run, st *runState, turn chan struct{}) {
	turn <- struct{}{}
	defer func() { <-turn }()
	if err := refresh(r.UnixNano, r.Seed); err != nil {
		a.fatal(err)
	}
	a.files.runStarts()
	run := a.run
	if a.interpMode {
		run = a.interpRun
	}
	exit, err := run(r, st)
	st.done.Store(true)
	if err != nil {
		a.fatal(err)
	}
	if err := a.sendJSON(wire.KindExit, exit); err != nil {
		a.fatal(err)
	}
	if a.interpMode {
		if a.interp == nil {
			// The next run's, ready before the VM pauses.
			it, err := a.startInterp()
			if err != nil {
				a.fatal(fmt.Errorf("start the next interpreter: %w", err))
			}
			it.fresh = true
			a.interp = it
		}
		a.send(wire.KindIdle, nil)
		return
	}
	if err := a.newZygote(); err != nil {
		a.fatal(fmt.Errorf("start the next run's python3: %w", err))
	}
	a.send(wire.KindIdle, nil)
}

// runState is the run in progress, which the host may ask to kill (Kill)
// at any moment, before its code is released too.
type runState struct {
	group  atomic.Pointer[string] // the run's cgroup, once known
	killed atomic.Bool
	done   atomic.Bool // the run has ended: a late Kill must not touch the cgroup (a live interpreter's)
}

// kill ends every process of the run, or the run before it starts.
func (st *runState) kill() {
	if st.done.Load() {
		return
	}
	st.killed.Store(true)
	if g := st.group.Load(); g != nil {
		killGroup(*g)
	}
}

// refresh sets the clock and reseeds the random generator: a restored VM
// would otherwise carry the template's time and the template's random
// state, the same in every clone.
func refresh(unixNano int64, seed []byte) error {
	if unixNano > 0 {
		ts := unix.NsecToTimespec(unixNano)
		if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
			return fmt.Errorf("set clock: %w", err)
		}
	}
	if len(seed) == 0 {
		return errors.New("no seed")
	}
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; u32 buf[]; }
	buf := make([]byte, 8+len(seed))
	*(*int32)(unsafe.Pointer(&buf[0])) = int32(8 * len(seed))
	*(*int32)(unsafe.Pointer(&buf[4])) = int32(len(seed))
	copy(buf[8:], seed)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
		return fmt.Errorf("add entropy: %w", e)
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); e != 0 {
		return fmt.Errorf("reseed: %w", e)
	}
	return nil
}

// run runs r's code in the zygote and returns the evidence of how it
// ended. Every process of the run is gone when it returns.
//
// The code runs only in a python3 of the current generation: when the
// zygote is of an earlier one (or there is none), a new one starts now,
// on the run's path.
func (a *agent) run(r *wire.Run, st *runState) (*wire.Exit, error) {
	if err := a.freshen(); err != nil {
		return nil, err
	}
	z := a.zygote
	a.zygote = nil
	group := z.group
	st.group.Store(&group)
	defer func() {
		killGroup(group)
		go removeGroup(group)
	}()
	if st.killed.Load() {
		// Killed before its code was released: nothing of it ran.
		killGroup(group)
		z.start.Close()
		z.closeDriver()
		reaped.wait(z.cmd.Process.Pid)
		z.out.Close()
		z.errs.Close()
		return &wire.Exit{Signal: int(unix.SIGKILL)}, nil
	}
	codeSize := (int64(len(r.Code)) + 4095) &^ 4095
	if err := unix.Mount("tmpfs", newRoot+codeDir, "tmpfs", unix.MS_REMOUNT|nosuid|unix.MS_NOEXEC,
		fmt.Sprintf("size=%d,nr_inodes=16", codeSize+64<<10)); err != nil {
		return nil, fmt.Errorf("size the code's layer: %w", err)
	}
	codePath := codeDir + "/main.py"
	os.Remove(newRoot + codePath)
	if err := os.WriteFile(newRoot+codePath, r.Code, 0o444); err != nil {
		return nil, fmt.Errorf("write the code: %w", err)
	}
	for file, v := range map[string]string{
		"memory.max":       strconv.FormatInt(r.Memory, 10),
		"memory.oom.group": "1",
		"pids.max":         strconv.FormatInt(r.Pids, 10),
	} {
		if err := os.WriteFile(filepath.Join(group, file), []byte(v), 0); err != nil {
			return nil, fmt.Errorf("cgroup %s: %w", file, err)
		}
	}
	// No swap in the guest; this only makes sure where the kernel has it.
	os.WriteFile(filepath.Join(group, "memory.swap.max"), []byte("0"), 0)

	pid := z.cmd.Process.Pid
	// The CPU python3 used to start is not the code's.
	baseMS := cpuUsageMS(group)
	// SIGXCPU at the CPU limit, SIGKILL a second later for code that
	// ignores it; the cgroup's account bounds the tree as a whole.
	cpuSec := uint64((baseMS+999)/1000 + (r.CPUMS+999)/1000)
	for _, rl := range [][3]uint64{
		{unix.RLIMIT_CPU, cpuSec, cpuSec + 1},
		{unix.RLIMIT_FSIZE, uint64(r.FileSize), uint64(r.FileSize)},
		{unix.RLIMIT_NOFILE, uint64(r.OpenFiles), uint64(r.OpenFiles)},
		{unix.RLIMIT_CORE, 0, 0},
	} {
		if err := unix.Prlimit(pid, int(rl[0]), &unix.Rlimit{Cur: rl[1], Max: rl[2]}, nil); err != nil {
			return nil, fmt.Errorf("rlimit %d of python3: %w", rl[0], err)
		}
	}
	// Files changed from now on are the run's (see fileAtLimit).
	start := time.Now()
	z.closeDriver()
	if _, err := z.start.WriteString(strings.Join(append([]string{"run", codePath}, a.env...), "\x00")); err != nil {
		return nil, fmt.Errorf("start the code: %w", err)
	}
	z.start.Close()
	a.send(wire.KindStarted, nil)
	cmd := z.cmd

	var pumps sync.WaitGroup
	for _, s := range []struct {
		f *os.File
		k wire.Kind
	}{{z.out, wire.KindStdout}, {z.errs, wire.KindStderr}} {
		pumps.Go(func() {
			defer s.f.Close()
			buf := make([]byte, wire.MaxReport)
			for {
				n, err := s.f.Read(buf)
				if n > 0 {
					a.send(s.k, buf[:n])
				}
				if err != nil {
					return
				}
			}
		})
	}

	// The CPU time of the whole run, children included. The wall time is
	// the host's.
	var over atomic.Bool
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				if cpuUsageMS(group)-baseMS >= r.CPUMS {
					over.Store(true)
					killGroup(group)
					return
				}
			}
		}
	}()
	ws := reaped.wait(cmd.Process.Pid)
	close(done)
	wallMS := time.Since(start).Milliseconds()
	// Whatever the code left running dies with it.
	killGroup(group)
	pumpsDone := make(chan struct{})
	go func() { pumps.Wait(); close(pumpsDone) }()
	select {
	case <-pumpsDone:
	case <-time.After(2 * time.Second):
	}

	var skip map[uint64]bool
	if a.files != nil {
		skip = a.files.committed()
	}
	return report(ws, r, evidence{
		overTime: over.Load(),
		cpuMS:    cpuUsageMS(group) - baseMS,
		wallMS:   wallMS,
		oomKilled: func() bool {
			return eventCount(group, "memory.events", "oom_kill") > 0 || eventCount(group, "memory.events", "oom_group_kill") > 0
		},
		pidsRefused: func() bool { return eventCount(group, "pids.events", "max") > 0 },
		fileAtLimit: func() bool {
			return fileAtLimit(r.FileSize, start, skip, upperFS+"/u", upperFS+"/shm")
		},
		diskFull: func() bool { return diskFull(upperFS) },
	})
}

// removeGroup removes a run's cgroup once its killed processes are gone.
func removeGroup(group string) {
	for i := 0; i < 100; i++ {
		if err := os.Remove(group); err == nil || errors.Is(err, fs.ErrNotExist) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// evidence is what the agent saw of how a run ended, besides python3's
// wait status. The funcs look at the run's cgroup and files; report calls
// each once.
type evidence struct {
	overTime    bool  // the agent killed the run at its CPU time
	cpuMS       int64 // the CPU time the run used
	wallMS      int64
	oomKilled   func() bool // the memory cgroup killed a process of the run
	pidsRefused func() bool // the pids cgroup refused a fork or a thread
	fileAtLimit func() bool // a file the run wrote reached the file size limit
	diskFull    func() bool // the writable layer has no space or no inode left
}

// report makes the Exit of a run with limits r from python3's wait status
// and ev. It states facts only; the host decides the reason.
func report(ws syscall.WaitStatus, r *wire.Run, ev evidence) (*wire.Exit, error) {
	exit := &wire.Exit{CPUMS: ev.cpuMS, WallMS: ev.wallMS}
	if ws.Signaled() {
		exit.Signal = int(ws.Signal())
	} else {
		exit.ExitCode = ws.ExitStatus()
	}
	// The CPU watch's kill, or RLIMIT_CPU's SIGKILL at its hard limit.
	exit.CPU = ev.overTime || (ws.Signaled() && ws.Signal() == unix.SIGKILL && ev.cpuMS >= r.CPUMS)
	exit.OOM = ev.oomKilled()
	exit.Pids = ev.pidsRefused()
	exit.FileSize = ev.fileAtLimit()
	exit.Disk = ev.diskFull()
	return exit, nil
}

// reaped is the agent's one reaper. As PID 1 the agent inherits every
// process whose parent died before it (a run's children once its python3
// is killed, a daemon the code double-forked), and a zombie it does not
// reap keeps its pid and its place in the run's pids cgroup. So the agent
// reaps every child itself, as they end, and hands the status of the
// ones it started (python3) to whoever waits for them; no exec.Cmd.Wait.
// main starts it (never a test: it would reap the test's children).
var reaped *reaper

type reaper struct {
	mu      sync.Mutex
	waiting map[int]chan syscall.WaitStatus // the children started and not yet waited for
}

func newReaper() *reaper {
	r := &reaper{waiting: map[int]chan syscall.WaitStatus{}}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, unix.SIGCHLD)
	go func() {
		// A SIGCHLD may stand for several children; the tick catches one
		// that came between a reap and the next wait for the signal.
		tick := time.NewTicker(time.Second)
		for {
			select {
			case <-sig:
			case <-tick.C:
			}
			r.reapAll()
		}
	}()
	return r
}

// start starts cmd and makes its status one that wait can take.
func (r *reaper) start(cmd *exec.Cmd) error {
	// Held over the start: a child that ends at once is reaped only after
	// it is registered.
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return err
	}
	r.waiting[cmd.Process.Pid] = make(chan syscall.WaitStatus, 1)
	return nil
}

func (r *reaper) reapAll() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
		r.mu.Lock()
		if ch, ok := r.waiting[pid]; ok {
			ch <- ws
		}
		r.mu.Unlock()
	}
}

// wait returns the status of pid, a child started by start, once it has
// ended.
func (r *reaper) wait(pid int) syscall.WaitStatus {
	r.mu.Lock()
	ch := r.waiting[pid]
	r.mu.Unlock()
	ws := <-ch
	r.mu.Lock()
	delete(r.waiting, pid)
	r.mu.Unlock()
	return ws
}

// pythonCmd returns python3 with args, to run in the run's root as the
// run's uid, in a session of its own, with the run's environment only.
//
// No no_new_privs: the root and /dev are mounted nosuid, so no program
// there can gain a privilege (set-user-ID bits and file capabilities are
// ignored), and the uid has none.
func pythonCmd(args ...string) *exec.Cmd {
	return &exec.Cmd{
		Path: python,
		Args: append([]string{"python3"}, args...),
		Dir:  workDir,
		Env:  []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + workDir, "LANG=C.UTF-8"},
		SysProcAttr: &syscall.SysProcAttr{
			Chroot:     newRoot,
			Credential: &syscall.Credential{Uid: runUID, Gid: runGID, Groups: []uint32{}},
			Setsid:     true,
		},
	}
}

// killGroup kills every process of a run's cgroup.
func killGroup(group string) {
	os.WriteFile(group+"/cgroup.kill", []byte("1"), 0)
}

// cpuUsageMS is the CPU time a run's cgroup has used.
func cpuUsageMS(group string) int64 {
	return eventCount(group, "cpu.stat", "usage_usec") / 1000
}

// eventCount reads "key value" from a flat-keyed file of a run's cgroup.
func eventCount(group, file, key string) int64 {
	b, err := os.ReadFile(filepath.Join(group, file))
	if err != nil {
		return 0
	}
	return flatKeyed(b, key)
}

// flatKeyed returns the value of key in b, the text of a flat-keyed cgroup
// file ("key value" lines), or 0 when key is not there or its value is not
// a number. A value past int64 reads as the largest int64.
func flatKeyed(b []byte, key string) int64 {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == key {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	return 0
}

// ctimeSlack is how far a file's ctime may lag the clock: the kernel
// stamps files with its coarse clock, a tick or two behind.
const ctimeSlack = 50 * time.Millisecond

// fileAtLimit reports whether a regular file under dirs that changed
// since the run began (by its ctime, which the code cannot set back)
// reached limit bytes: the trace RLIMIT_FSIZE leaves (Python ignores
// SIGXFSZ and gets EFBIG instead). Files the session's host wrote during
// the run (skip, by inode) are not the run's.
func fileAtLimit(limit int64, since time.Time, skip map[uint64]bool, dirs ...string) bool {
	found := false
	for _, d := range dirs {
		filepath.WalkDir(d, func(p string, e fs.DirEntry, err error) error {
			if err != nil || !e.Type().IsRegular() {
				return nil
			}
			info, err := e.Info()
			if err != nil || info.Size() < limit {
				return nil
			}
			st, ok := info.Sys().(*syscall.Stat_t)
			if !ok || skip[st.Ino] || time.Unix(st.Ctim.Unix()).Before(since.Add(-ctimeSlack)) {
				return nil
			}
			found = true
			return filepath.SkipAll
		})
	}
	return found
}

func diskFull(dir string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false
	}
	return st.Bavail == 0 || st.Ffree == 0
}
