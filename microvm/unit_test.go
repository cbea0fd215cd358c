package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// These tests need no VM.

func TestGuestMemoryMiB(t *testing.T) {
	for _, c := range []struct {
		l    moat.Limits
		want int
	}{
		{moat.Limits{}, 512}, // 256+64+192
		{moat.Limits{Memory: 64 * moat.MiB, Disk: 4 * moat.MiB}, 512}, // the floor
		{moat.Limits{Memory: 300 * moat.MiB}, 640},                    // 556, rounded up
		{moat.Limits{Memory: moat.GiB, Disk: moat.GiB}, 2304},         // 2048+192, rounded up
	} {
		if got := GuestMemoryMiB(c.l); got != c.want {
			t.Errorf("GuestMemoryMiB(memory %v, disk %v) = %d, want %d", c.l.Memory, c.l.Disk, got, c.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero", Config{}, true},
		{"tcg", Config{Accel: AccelTCG, Cold: true, VCPUs: 2, MaxVMs: 3, Warm: 16, SessionCPUTime: moat.Duration(time.Minute)}, true},
		{"no warm VM", Config{Warm: -1}, true},
		{"too many warm VMs", Config{Warm: 17}, false},
		{"warm below -1", Config{Warm: -2}, false},
		{"negative session cpu time", Config{SessionCPUTime: -1}, false},
		{"unknown accel", Config{Accel: "hvf"}, false},
		{"require kvm with tcg", Config{Accel: AccelTCG, RequireKVM: true}, false},
		{"negative vcpus", Config{VCPUs: -1}, false},
		{"negative max vms", Config{MaxVMs: -1}, false},
		{"relative qemu", Config{QEMU: "qemu-system-x86_64"}, false},
		{"low uids", Config{UIDFirst: 10}, false},
		{"bad limits", Config{Limits: moat.Limits{Memory: moat.MiB}}, false},
	} {
		err := c.cfg.Validate()
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, moat.ErrInvalid)) {
			t.Errorf("%s: Validate() = %v, want ok=%v (or an error wrapping ErrInvalid)", c.name, err, c.ok)
		}
	}
}

// The VM has no network device, no shared directory and a read-only disk,
// whatever the spec.
func TestQEMUArgs(t *testing.T) {
	q := &QEMU{Binary: "/usr/bin/qemu-system-x86_64", Version: "7.2"}
	spec := VMSpec{Kernel: "/k", Initrd: "/i", Disk: "/d,x", Cmdline: "console=ttyS0", MemoryMiB: 512, VCPUs: 1, Accel: AccelTCG}
	for _, c := range []struct {
		name string
		mod  func(*VMSpec)
		want []string
		not  []string
	}{
		{"boot", func(*VMSpec) {}, []string{"-nodefaults", "-nic\x00none", "file=/d,,x,format=raw,if=none,readonly=on", "-cpu\x00max", "-m\x00512M", "-name\x00tag"}, []string{"-incoming"}},
		{"restore", func(s *VMSpec) { s.Restore = "/state" }, []string{"-incoming\x00fd:5", "null,id=con"}, []string{"/state"}},
		{"console", func(s *VMSpec) { s.Console = &bytes.Buffer{} }, []string{"socket,id=con,fd=5"}, nil},
		{"kvm", func(s *VMSpec) { s.Accel = AccelKVM }, []string{"-accel\x00kvm", "-cpu\x00host,-arch-capabilities"}, nil},
	} {
		s := spec
		c.mod(&s)
		args := strings.Join(q.args(s, "tag"), "\x00")
		for _, w := range c.want {
			if !strings.Contains(args, w) {
				t.Errorf("%s: the command line lacks %q: %q", c.name, w, args)
			}
		}
		for _, bad := range append(c.not, "-netdev", "-net\x00", "virtfs", "virtio-9p", "vhost-user-fs", "-usb", "e1000", "virtio-net") {
			if strings.Contains(args, bad) {
				t.Errorf("%s: the command line holds %q: %q", c.name, bad, args)
			}
		}
	}
}

// readCpio parses a newc archive: name → mode, rdev and data.
func readCpio(t *testing.T, b []byte) map[string][3]string {
	t.Helper()
	out := map[string][3]string{}
	for off := 0; ; {
		if off+110 > len(b) || string(b[off:off+6]) != "070701" {
			t.Fatalf("no newc header at %d", off)
		}
		field := func(i int) int {
			v, err := strconv.ParseUint(string(b[off+6+8*i:off+14+8*i]), 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return int(v)
		}
		mode, size, rmaj, rmin, namesize := field(1), field(6), field(9), field(10), field(11)
		name := string(b[off+110 : off+110+namesize-1])
		off += (110 + namesize + 3) &^ 3
		data := b[off : off+size]
		off += (size + 3) &^ 3
		if name == "TRAILER!!!" {
			if off != len(b) {
				t.Errorf("%d bytes after the trailer", len(b)-off)
			}
			return out
		}
		out[name] = [3]string{fmt.Sprintf("%o", mode), fmt.Sprintf("%d:%d", rmaj, rmin), string(data)}
	}
}

func TestCpio(t *testing.T) {
	var buf bytes.Buffer
	w := newCpio(&buf)
	w.dir("dev")
	w.node("dev/console", syscall.S_IFCHR|0o600, 5, 1)
	w.file("init", 0o755, []byte("#!agent"))
	w.file("modules/odd", 0o644, []byte("12345"))
	if err := w.close(); err != nil {
		t.Fatal(err)
	}
	got := readCpio(t, buf.Bytes())
	want := map[string][3]string{
		"dev":         {"40755", "0:0", ""},
		"dev/console": {"20600", "5:1", ""},
		"init":        {"100755", "0:0", "#!agent"},
		"modules/odd": {"100644", "0:0", "12345"},
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s: got %q, want %q", name, got[name], w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("the archive holds %d entries, want %d", len(got), len(want))
	}
	// Where cpio(1) is installed, it must read the archive too.
	if cp, err := exec.LookPath("cpio"); err == nil {
		cmd := exec.Command(cp, "-it", "--quiet")
		cmd.Stdin = bytes.NewReader(buf.Bytes())
		if out, err := cmd.CombinedOutput(); err != nil || !strings.HasPrefix(string(out), "dev\ndev/console\ninit\nmodules/odd\n") {
			t.Errorf("cpio -it: %v: %s", err, out)
		}
	}
}

// reap kills tagged VMs whose moat process is gone, and only those: an
// owner id nobody holds is dead; this process's own id is alive.
func TestReap(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root")
		}
		t.Skip("owner ids live in /run/moat/owners, which needs root")
	}
	me, err := owner.Self(ownersDir)
	if err != nil {
		t.Fatal(err)
	}
	start := func(id string) *exec.Cmd {
		// python3 keeps its arguments in its command line, as QEMU does.
		cmd := exec.Command("/usr/bin/python3", "-c", "import time; time.sleep(60)",
			"-name", tagPrefix+id+":0badc0de")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	const deadID = "00000000deadbeef"
	orphan := start(deadID)
	ours := start(me)
	// A child shows its own command line only once it has exec'd.
	var found []vmProcess
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		found = listVMs()
		missing := false
		for _, c := range []*exec.Cmd{orphan, ours} {
			if !slices.ContainsFunc(found, func(p vmProcess) bool { return p.pid == c.Process.Pid }) {
				missing = true
			}
		}
		if !missing {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("listVMs() = %v, want it to find the tagged processes %d and %d", found, orphan.Process.Pid, ours.Process.Pid)
		}
	}
	reap(t.TempDir(), slog.New(slog.DiscardHandler))
	waited := make(chan error, 1)
	go func() { waited <- orphan.Wait() }()
	select {
	case <-waited:
	case <-time.After(5 * time.Second):
		t.Errorf("the VM of a dead owner (%s) was not killed", deadID)
	}
	if err := ours.Process.Signal(syscall.Signal(0)); err != nil {
		t.Errorf("reap killed a VM of this live process: %v", err)
	}
}

// fakeVM is a VM whose guest is the test: its agent port is one end of a
// unix socket pair. Abort stands for QEMU's death: the guest's end closes,
// and what the guest had written is still there to read, as from a real
// VM's socket.
type fakeVM struct {
	host, guest net.Conn
	exited      chan struct{}
	once        sync.Once
	paused      atomic.Int32 // Pause calls
	resumed     atomic.Int32 // Resume calls
}

func newFakeVM(t *testing.T) *fakeVM {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "fake")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	f := &fakeVM{host: conn(fds[0]), guest: conn(fds[1]), exited: make(chan struct{})}
	t.Cleanup(func() { f.Kill() })
	return f
}

func (f *fakeVM) Agent() net.Conn                    { return f.host }
func (f *fakeVM) Save(context.Context, string) error { return errors.New("fake") }
func (f *fakeVM) Resume(context.Context) error       { f.resumed.Add(1); return nil }
func (f *fakeVM) Pause(context.Context) error        { f.paused.Add(1); return nil }
func (f *fakeVM) Pid() int                           { return os.Getpid() }
func (f *fakeVM) Exited() <-chan struct{}            { return f.exited }
func (f *fakeVM) Abort()                             { f.once.Do(func() { f.guest.Close(); close(f.exited) }) }
func (f *fakeVM) Kill() error {
	f.Abort()
	f.host.Close()
	return nil
}

// fakeBackend gives the engine instances over fake VMs, each played by
// guest.
type fakeBackend struct {
	t     *testing.T
	b     *backend
	guest func(conn net.Conn)
}

func (f *fakeBackend) Prepare(ctx context.Context) (engine.Instance, error) {
	vm := newFakeVM(f.t)
	go func() {
		if _, _, err := wire.Read(vm.guest, 0); err != nil {
			return
		}
		f.guest(vm.guest)
		io.Copy(io.Discard, vm.guest)
	}()
	return &vmInstance{b: f.b, vm: vm, c: newAgentConn(vm.Agent(), nil), how: "vm: fake"}, nil
}

func (f *fakeBackend) Close() error { return nil }

func fakeSandbox(t *testing.T, l moat.Limits, guest func(conn net.Conn)) *engine.Sandbox {
	t.Helper()
	b := &backend{limits: l.WithDefaults(), log: slog.New(slog.DiscardHandler)}
	sb, err := engine.New(engine.Config{Level: moat.LevelMicroVM, Limits: l, Warm: -1, MaxCode: wire.MaxCode},
		&fakeBackend{t: t, b: b, guest: guest})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

func exitFrame(conn net.Conn, e string) { wire.Write(conn, wire.KindExit, []byte(e)) }

// The host does not take the guest's word beyond what the agent could say:
// a compromised guest gets an error for its run, never an allocation of its
// choosing or a result the agent cannot make.
func TestHostileGuest(t *testing.T) {
	started := func(conn net.Conn) { wire.Write(conn, wire.KindStarted, nil) }
	for _, c := range []struct {
		name  string
		guest func(conn net.Conn)
		want  string
	}{
		{"huge frame", func(conn net.Conn) {
			started(conn)
			conn.Write([]byte{byte(wire.KindStdout), 0x7f, 0xff, 0xff, 0xff})
		}, "frame too large"},
		{"frame just over the limit", func(conn net.Conn) {
			started(conn)
			wire.Write(conn, wire.KindStdout, make([]byte, wire.MaxReport+1))
		}, "frame too large"},
		{"a reason, which the agent no longer sends", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"exit_code":0,"reason":"contained"}`)
		}, "not one it makes"},
		{"an unknown field", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"exit_code":0,"verdict":"ok"}`)
		}, "not one it makes"},
		{"exit code out of range", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"exit_code":-1}`)
		}, "not one it makes"},
		{"exit code past 255", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"exit_code":256}`)
		}, "not one it makes"},
		{"both an exit code and a signal", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"exit_code":1,"signal":9}`)
		}, "not one it makes"},
		{"a signal out of range", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"signal":65}`)
		}, "not one it makes"},
		{"a negative CPU time", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"exit_code":0,"cpu_ms":-5}`)
		}, "not one it makes"},
		{"two reports in one frame", func(conn net.Conn) {
			started(conn)
			exitFrame(conn, `{"exit_code":0}{"exit_code":1}`)
		}, "not one it makes"},
		{"a hello during the run", func(conn net.Conn) {
			started(conn)
			wire.Write(conn, wire.KindHello, []byte(`{}`))
		}, "never sends"},
		{"output before started", func(conn net.Conn) {
			wire.Write(conn, wire.KindStdout, []byte("x"))
		}, "before the code started"},
		{"long failure", func(conn net.Conn) {
			started(conn)
			wire.Write(conn, wire.KindFail, bytes.Repeat([]byte{0xff}, wire.MaxReport))
		}, "the guest agent failed"},
		{"the VM ends without a report", func(conn net.Conn) {
			started(conn)
			conn.Close()
		}, "without a report"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sb := fakeSandbox(t, moat.Limits{}, c.guest)
			res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
			if err == nil || !strings.Contains(err.Error(), c.want) || !errors.Is(err, moat.ErrUnavailable) {
				t.Fatalf("Run = %+v, %v; want an error wrapping ErrUnavailable saying %q", res, err, c.want)
			}
			if len(err.Error()) > 2048 {
				t.Errorf("the error holds %d bytes of the guest's words", len(err.Error()))
			}
		})
	}
}

// What the agent does say is evidence, and the engine judges it.
func TestGuestEvidence(t *testing.T) {
	for _, c := range []struct {
		exit   string
		code   int
		signal string
		reason moat.Reason
	}{
		{`{"exit_code":0}`, 0, "", moat.ReasonNone},
		{`{"exit_code":3}`, 3, "", moat.ReasonNone},
		{`{"signal":9,"oom":true}`, 137, "SIGKILL", moat.ReasonMemory},
		{`{"signal":9,"cpu":true,"oom":true}`, 137, "SIGKILL", moat.ReasonTimeout},
		{`{"signal":24,"cpu_ms":10000}`, 152, "SIGXCPU", moat.ReasonTimeout},
		{`{"signal":24,"cpu_ms":30}`, 152, "SIGXCPU", moat.ReasonSignal}, // sent by the code to itself
		{`{"exit_code":1,"pids":true,"disk":true}`, 1, "", moat.ReasonPids},
		{`{"exit_code":1,"file_size":true,"disk":true}`, 1, "", moat.ReasonFileSize},
		{`{"exit_code":1,"disk":true}`, 1, "", moat.ReasonDisk},
		{`{"signal":11}`, 139, "SIGSEGV", moat.ReasonSignal},
		{`{"exit_code":0,"oom":true}`, 0, "", moat.ReasonMemory},
	} {
		sb := fakeSandbox(t, moat.Limits{}, func(conn net.Conn) {
			wire.Write(conn, wire.KindStarted, nil)
			wire.Write(conn, wire.KindStdout, []byte("hi\n"))
			exitFrame(conn, c.exit)
		})
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
		if err != nil {
			t.Fatalf("%s: %v", c.exit, err)
		}
		if string(res.Stdout) != "hi\n" || res.ExitCode != c.code || res.Signal != c.signal || res.Reason != c.reason {
			t.Errorf("%s: result exit %d, signal %q, reason %q, stdout %q; want %d, %q, %q, hi", c.exit,
				res.ExitCode, res.Signal, res.Reason, res.Stdout, c.code, c.signal, c.reason)
		}
		if !slices.Contains(res.Notes, "vm: fake") {
			t.Errorf("%s: notes %q lack how the VM was made", c.exit, res.Notes)
		}
	}
}

// A run whose output passes the cap while its CPU time ran out is a
// timeout: the reasons go in moat's order (timeout before output), and the
// agent's report, already sent when the cap killed the VM, is still read.
func TestTimeoutBeforeOutput(t *testing.T) {
	l := moat.Limits{Output: 4 * moat.KiB}
	sb := fakeSandbox(t, l, func(conn net.Conn) {
		// One write: the report is on its way before the host reads
		// the output that passes the cap, as the agent's would be.
		var b bytes.Buffer
		wire.Write(&b, wire.KindStarted, nil)
		wire.Write(&b, wire.KindStdout, bytes.Repeat([]byte("x"), 16<<10))
		wire.Write(&b, wire.KindExit, []byte(`{"signal":9,"cpu":true,"cpu_ms":10000}`))
		conn.Write(b.Bytes())
	})
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonTimeout || !res.Truncated || res.ExitCode != 137 {
		t.Errorf("reason %q, truncated %v, exit %d; want timeout, truncated, 137", res.Reason, res.Truncated, res.ExitCode)
	}
	// Past the cap alone, it is output.
	sb = fakeSandbox(t, l, func(conn net.Conn) {
		wire.Write(conn, wire.KindStarted, nil)
		wire.Write(conn, wire.KindStdout, bytes.Repeat([]byte("x"), 16<<10))
		exitFrame(conn, `{"exit_code":0}`)
	})
	res, err = sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonOutput || !res.Truncated {
		t.Errorf("reason %q, truncated %v; want output, truncated", res.Reason, res.Truncated)
	}
}

// A guest that never reports is killed at the wall time (by the engine)
// and the run is a timeout.
func TestSilentGuestTimesOut(t *testing.T) {
	sb := fakeSandbox(t, moat.Limits{WallTime: moat.Duration(300 * time.Millisecond)}, func(conn net.Conn) {
		wire.Write(conn, wire.KindStarted, nil)
	})
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonTimeout || res.Signal != "SIGKILL" {
		t.Errorf("reason %q, signal %q; want timeout, SIGKILL", res.Reason, res.Signal)
	}
}

// processCPU reads what getrusage says of this process.
func TestProcessCPU(t *testing.T) {
	rusage := func() time.Duration {
		var ru syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	before, err := processCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	r0 := rusage()
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); {
	}
	r1 := rusage()
	after, err := processCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	got, want := after-before, r1-r0
	if got < want/2 || got > 2*want+50*time.Millisecond {
		t.Errorf("processCPU counted %v over a spin that getrusage counts %v", got, want)
	}
	if _, err := processCPU(1 << 30); err == nil {
		t.Errorf("processCPU of no process: no error")
	}
}

// fakeSession is a session over a fake VM whose agent is answer: it gets
// every frame the host sends after the session's opening.
func fakeSession(t *testing.T, l moat.Limits, answer func(conn net.Conn, k wire.Kind, p []byte)) *vmSession {
	t.Helper()
	vm := newFakeVM(t)
	b := &backend{limits: l.WithDefaults(), log: slog.New(slog.DiscardHandler),
		cfg: Config{BootTimeout: moat.Duration(10 * time.Second)}}
	ss := &vmSession{b: b, vm: vm, idle: make(chan struct{}, 1), budget: time.Hour}
	ss.c = newAgentConn(vm.Agent(), ss.onIdle)
	go func() {
		if k, _, err := wire.Read(vm.guest, 0); err != nil || k != wire.KindSession {
			return
		}
		wire.Write(vm.guest, wire.KindIdle, nil)
		for {
			k, p, err := wire.Read(vm.guest, 0)
			if err != nil {
				return
			}
			answer(vm.guest, k, p)
		}
	}()
	if err := ss.open(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	return ss
}

func reply(conn net.Conn, id uint64, r string) {
	wire.Write(conn, wire.KindReply, []byte(fmt.Sprintf(`{"id":%d%s}`, id, r)))
}

func fileID(p []byte) uint64 {
	var f wire.File
	json.Unmarshal(p, &f)
	return f.ID
}

// What a compromised guest answers to file operations is checked: sizes
// past the limits, data past what was announced, names that are not clean
// or repeat, modes and error numbers out of range, another file's
// description. Each is an error, never a result; an errno the agent sends
// maps to moat's classes.
func TestHostileGuestFiles(t *testing.T) {
	l := moat.Limits{Disk: 4 * moat.MiB, FileSize: 1 * moat.MiB}
	type answer func(conn net.Conn, id uint64)
	read := func(ss *vmSession) error { _, err := ss.ReadFile(context.Background(), "f"); return err }
	list := func(ss *vmSession) error { _, err := ss.ListFiles(context.Background()); return err }
	stat := func(ss *vmSession) error { _, err := ss.Stat(context.Background(), "f"); return err }
	for _, c := range []struct {
		name   string
		op     func(*vmSession) error
		answer answer
		is     error // nil: an error of the guest's
	}{
		{"a size past the disk", read, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"size":5000000,"more":true`)
		}, nil},
		{"more data than announced", read, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"size":3,"more":true`)
			wire.Write(conn, wire.KindData, wire.DataPayload(id, []byte("abcd")))
			reply(conn, id, ``)
		}, nil},
		{"data before the size", read, func(conn net.Conn, id uint64) {
			wire.Write(conn, wire.KindData, wire.DataPayload(id, []byte("a")))
		}, nil},
		{"an errno with a result", read, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"errno":2,"size":3,"more":true`)
		}, nil},
		{"an errno out of range", stat, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"errno":100000`)
		}, nil},
		{"an unknown field", stat, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"info":{"name":"f","size":1,"mode":420,"mod_nano":0},"verdict":"ok"`)
		}, nil},
		{"another file's description", stat, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"info":{"name":"g","size":1,"mode":420,"mod_nano":0}`)
		}, nil},
		{"a mode of unknown bits", stat, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"info":{"name":"f","size":1,"mode":4294967295,"mod_nano":0}`)
		}, nil},
		{"a negative size", stat, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"info":{"name":"f","size":-1,"mode":420,"mod_nano":0}`)
		}, nil},
		{"a name out of the directory", list, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"entries":[{"name":"../etc/passwd","size":1,"mode":420,"mod_nano":0}]`)
		}, nil},
		{"an absolute name", list, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"entries":[{"name":"/etc","size":1,"mode":420,"mod_nano":0}]`)
		}, nil},
		{"a name twice", list, func(conn net.Conn, id uint64) {
			reply(conn, id, `,"entries":[{"name":"a","size":1,"mode":420,"mod_nano":0}],"more":true`)
			reply(conn, id, `,"entries":[{"name":"a","size":1,"mode":420,"mod_nano":0}]`)
		}, nil},
		{"an empty part of a listing", list, func(conn net.Conn, id uint64) {
			for range 3 {
				reply(conn, id, `,"more":true`)
			}
		}, nil},
		{"the agent's ENOENT", stat, func(conn net.Conn, id uint64) { reply(conn, id, `,"errno":2`) }, fs.ErrNotExist},
		{"the agent's ELOOP", stat, func(conn net.Conn, id uint64) { reply(conn, id, `,"errno":40`) }, moat.ErrInvalid},
		{"the agent's ENOSPC", stat, func(conn net.Conn, id uint64) { reply(conn, id, `,"errno":28`) }, moat.ErrInvalid},
	} {
		t.Run(c.name, func(t *testing.T) {
			ss := fakeSession(t, l, func(conn net.Conn, k wire.Kind, p []byte) {
				if k == wire.KindFile {
					c.answer(conn, fileID(p))
				}
			})
			err := c.op(ss)
			switch {
			case err == nil:
				t.Fatal("no error")
			case c.is != nil && !errors.Is(err, c.is):
				t.Errorf("error %v, want one wrapping %v", err, c.is)
			case c.is == nil && !strings.Contains(err.Error(), "not one it makes"):
				t.Errorf("error %v, want one saying the answer is not the agent's", err)
			}
		})
	}
	// A write past the file size limit is refused before the guest gets
	// any of it.
	var got atomic.Int64
	ss := fakeSession(t, l, func(conn net.Conn, k wire.Kind, p []byte) {
		if k == wire.KindData {
			got.Add(int64(len(p) - 8))
		}
		if k == wire.KindFile {
			var f wire.File
			json.Unmarshal(p, &f)
			if f.Op == wire.OpCommit {
				reply(conn, f.ID, ``)
			}
		}
	})
	err := ss.WriteFile(context.Background(), "f", bytes.NewReader(make([]byte, 1<<20+1)))
	if !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("a write past the file size limit: %v, want ErrInvalid", err)
	}
	if n := got.Load(); n > 1<<20 {
		t.Errorf("the guest got %d bytes of a write past the limit", n)
	}
}

// A listing whose names add up to more than maxListBytes is refused, even
// within maxEntries: the code shapes the tree, and a deep one's names are
// long (here a compromised guest sends them straight).
func TestGuestListBytesBounded(t *testing.T) {
	l := moat.Limits{Disk: 1 * moat.GiB}
	long := strings.Repeat("d", 4000)
	ss := fakeSession(t, l, func(conn net.Conn, k wire.Kind, p []byte) {
		if k != wire.KindFile {
			return
		}
		id := fileID(p)
		n := 0
		for n*4000 < 2*64<<20 { // twice the cap, well within maxEntries

			var es []string
			for range 10 {
				es = append(es, fmt.Sprintf(`{"name":"%s%d","size":1,"mode":420,"mod_nano":0}`, long, n))
				n++
			}
			reply(conn, id, `,"entries":[`+strings.Join(es, ",")+`],"more":true`)
		}
		reply(conn, id, ``)
	})
	list, err := ss.ListFiles(context.Background())
	if !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("a listing of %d names of 4000 bytes: err %v, want one wrapping moat.ErrInvalid", len(list), err)
	}
}
