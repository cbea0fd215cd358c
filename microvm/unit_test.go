package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
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
		{"tcg", Config{Accel: AccelTCG, Cold: true, VCPUs: 2, MaxVMs: 3}, true},
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
	found := listVMs()
	for _, c := range []*exec.Cmd{orphan, ours} {
		if !slices.ContainsFunc(found, func(p vmProcess) bool { return p.pid == c.Process.Pid }) {
			t.Fatalf("listVMs() = %v, want it to find the tagged process %d", found, c.Process.Pid)
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
// pipe.
type fakeVM struct {
	host, guest net.Conn
	exited      chan struct{}
	once        sync.Once
}

func newFakeVM() *fakeVM {
	h, g := net.Pipe()
	return &fakeVM{host: h, guest: g, exited: make(chan struct{})}
}

func (f *fakeVM) Agent() net.Conn                    { return f.host }
func (f *fakeVM) Save(context.Context, string) error { return errors.New("fake") }
func (f *fakeVM) Resume(context.Context) error       { return nil }
func (f *fakeVM) Pid() int                           { return 0 }
func (f *fakeVM) Exited() <-chan struct{}            { return f.exited }
func (f *fakeVM) Kill() error {
	f.once.Do(func() { f.host.Close(); f.guest.Close(); close(f.exited) })
	return nil
}

// The host does not take the guest's word beyond what the agent could say:
// a compromised guest gets an error for its run, never an allocation of its
// choosing or a result the agent cannot make.
func TestHostileGuest(t *testing.T) {
	s := &Sandbox{limits: moat.Limits{}.WithDefaults()}
	for _, c := range []struct {
		name  string
		guest func(conn net.Conn)
		want  string
	}{
		{"huge frame", func(conn net.Conn) {
			conn.Write([]byte{byte(wire.KindStdout), 0x7f, 0xff, 0xff, 0xff})
		}, "frame too large"},
		{"frame just over the limit", func(conn net.Conn) {
			wire.Write(conn, wire.KindStdout, make([]byte, wire.MaxReport+1))
		}, "frame too large"},
		{"unknown reason", func(conn net.Conn) {
			wire.Write(conn, wire.KindExit, []byte(`{"exit_code":0,"reason":"contained"}`))
		}, "not one it makes"},
		{"host's reason", func(conn net.Conn) {
			wire.Write(conn, wire.KindExit, []byte(`{"exit_code":137,"reason":"canceled"}`))
		}, "not one it makes"},
		{"exit code out of range", func(conn net.Conn) {
			wire.Write(conn, wire.KindExit, []byte(`{"exit_code":-1}`))
		}, "not one it makes"},
		{"long failure", func(conn net.Conn) {
			wire.Write(conn, wire.KindFail, bytes.Repeat([]byte{0xff}, wire.MaxReport))
		}, "the guest agent failed"},
	} {
		t.Run(c.name, func(t *testing.T) {
			vm := newFakeVM()
			defer vm.Kill()
			go func() {
				if _, _, err := wire.Read(vm.guest, 0); err != nil {
					return
				}
				c.guest(vm.guest)
				io.Copy(io.Discard, vm.guest)
			}()
			res, err := s.talk(context.Background(), vm, moat.Request{Code: []byte("print(1)")})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("talk = %+v, %v; want an error saying %q", res, err, c.want)
			}
			if len(err.Error()) > 2048 {
				t.Errorf("the error holds %d bytes of the guest's words", len(err.Error()))
			}
		})
	}
	// What the agent does say is taken.
	vm := newFakeVM()
	defer vm.Kill()
	go func() {
		wire.Read(vm.guest, 0)
		wire.Write(vm.guest, wire.KindStarted, nil)
		wire.Write(vm.guest, wire.KindStdout, []byte("hi\n"))
		wire.Write(vm.guest, wire.KindExit, []byte(`{"exit_code":137,"signal":9,"reason":"memory"}`))
		io.Copy(io.Discard, vm.guest)
	}()
	res, err := s.talk(context.Background(), vm, moat.Request{Code: []byte("print(1)")})
	if err != nil {
		t.Fatal(err)
	}
	if string(res.Stdout) != "hi\n" || res.ExitCode != 137 || res.Signal != "SIGKILL" || res.Reason != moat.ReasonMemory {
		t.Errorf("result %+v, want stdout hi, exit 137, SIGKILL, reason memory", res)
	}
}
