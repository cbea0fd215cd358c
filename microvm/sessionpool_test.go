package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// waitForPool makes sb's sessions wait, at most a minute each, for a VM of
// the engine's pool instead of restoring their own when none is ready, so
// that a test knows where a session's VM came from.
func waitForPool(t *testing.T, sb *Sandbox) {
	t.Helper()
	sb.b.takeReady = func() (engine.Instance, bool) {
		for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if inst, ok := sb.Sandbox.TakeReady(); ok {
				return inst, true
			}
		}
		t.Error("the pool had no VM ready within a minute")
		return nil, false
	}
}

func fromThePool(ss *vmSession) bool { return strings.Contains(ss.how, "(the pool's)") }

// A session's VM comes from the engine's pool when one is ready, and is as
// fresh as one NewSession restores itself: no run has used it, its
// python3 (or its interpreter) and so its string hash secret are its own,
// its random generator is reseeded, its clock is the host's, its working
// directory is empty and its writable layer has the session's disk limit.
// The pool refills after the session took its VM; Close kills the VM.
func TestSessionFromPool(t *testing.T) {
	parallel(t)
	const disk = 48 * moat.MiB
	sb := open(t, requireVMs(t), moat.Limits{Disk: disk})
	waitForPool(t, sb)
	probe := `import json, os, sys, time
st = os.statvfs('/work')
print(json.dumps({"hash": hash('moat-seed'), "seed": os.environ.get('PYTHONHASHSEED'), "random": sys.flags.hash_randomization,
    "urandom": os.urandom(16).hex(), "time": time.time(), "files": os.listdir('.'), "disk": st.f_blocks * st.f_frsize}))
`
	type seen struct {
		Hash    int64
		Seed    *string
		Random  int
		Urandom string
		Time    float64
		Files   []string
		Disk    int64
	}
	var hashes, urandoms []string
	check := func(what string, ss moat.Session) {
		t.Helper()
		if vs := vmOf(t, ss); !fromThePool(vs) {
			t.Errorf("%s: the VM did not come from the pool: %s", what, vs.how)
		}
		before := float64(time.Now().UnixNano()) / 1e9
		out := runOK(t, ss, probe)
		after := float64(time.Now().UnixNano()) / 1e9
		var s seen
		if err := json.Unmarshal([]byte(out), &s); err != nil {
			t.Fatalf("%s: the probe printed %q: %v", what, out, err)
		}
		if s.Seed != nil || s.Random != 1 {
			t.Errorf("%s: PYTHONHASHSEED set (%v), hash randomization %d: the hash secret is fixed", what, s.Seed != nil, s.Random)
		}
		if s.Time < before-1 || s.Time > after+1 {
			t.Errorf("%s: the guest's clock says %f, the host's was between %f and %f", what, s.Time, before, after)
		}
		if len(s.Files) != 0 {
			t.Errorf("%s: the working directory holds %q, want nothing", what, s.Files)
		}
		if s.Disk != int64(disk) {
			t.Errorf("%s: the writable layer has %d bytes, want the disk limit %d", what, s.Disk, int64(disk))
		}
		for _, h := range hashes {
			if h == fmt.Sprint(s.Hash) {
				t.Errorf("%s: hash('moat-seed') = %d, as in an earlier session: the hash secret is not the VM's own", what, s.Hash)
			}
		}
		for _, u := range urandoms {
			if u == s.Urandom {
				t.Errorf("%s: os.urandom drew %s, as in an earlier session", what, s.Urandom)
			}
		}
		hashes, urandoms = append(hashes, fmt.Sprint(s.Hash)), append(urandoms, s.Urandom)
	}

	a := newSession(t, sb)
	check("a plain session", a)
	b := newSession(t, sb) // the pool's replacement, refilled after a was made
	check("a second plain session", b)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	is, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer is.Close()
	check("an interpreter session", is)
	if out := runOK(t, is, "x = 41\nprint(hash('moat-seed'))"); strings.TrimSpace(out) != hashes[2] {
		t.Errorf("the interpreter's hash changed between its runs: %s, then %s", hashes[2], out)
	}
	if out := runOK(t, is, "print(x + 1)"); out != "42\n" {
		t.Errorf("the interpreter session's second run printed %q, want its variable kept", out)
	}
	for _, ss := range []moat.Session{a, b, is} {
		pid := vmOf(t, ss).vm.Pid()
		ss.Close()
		if err := syscall.Kill(pid, 0); err == nil {
			t.Errorf("the session's QEMU (pid %d) is alive after Close", pid)
		}
	}
}

// A pooled VM that ended while it waited does not become a session:
// NewSession restores a fresh one.
func TestSessionStalePool(t *testing.T) {
	parallel(t)
	sb := open(t, noPool(t), moat.Limits{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	inst, err := sb.b.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stale := inst.(*vmInstance)
	stale.vm.Abort()
	<-stale.vm.Exited()
	taken := 0
	sb.b.takeReady = func() (engine.Instance, bool) { taken++; return stale, taken == 1 }
	ss := newSession(t, sb)
	if vs := vmOf(t, ss); taken != 1 || fromThePool(vs) || vs.vm == stale.vm {
		t.Fatalf("NewSession took %d pooled VMs and made its session of %q; want a VM of its own", taken, vs.how)
	}
	if out := runOK(t, ss, "print(6 * 7)"); out != "42\n" {
		t.Errorf("the session's run printed %q", out)
	}
}

// fromPool over fake VMs: a VM that has ended, or whose agent goes away
// instead of answering the Session, is stale and discarded; one that
// answers becomes the session's, its Idle frames the session's from then
// on, the Session carrying the session's limits.
func TestFromPool(t *testing.T) {
	l := moat.Limits{Disk: 32 * moat.MiB, FileSize: 4 * moat.MiB}
	b := &backend{limits: l.WithDefaults(), log: slog.New(slog.DiscardHandler),
		cfg: Config{BootTimeout: moat.Duration(10 * time.Second), SessionCPUTime: moat.Duration(time.Minute)}}
	pooled := func(t *testing.T, guest func(conn net.Conn, s wire.Session)) (*vmInstance, *fakeVM) {
		vm := newFakeVM(t)
		go func() {
			k, p, err := wire.Read(vm.guest, 0)
			var s wire.Session
			if err != nil {
				return // the VM ended before the host said anything
			}
			if k != wire.KindSession || json.Unmarshal(p, &s) != nil {
				t.Errorf("the guest got %s %q; want a session", k, p)
				vm.guest.Close()
				return
			}
			guest(vm.guest, s)
		}()
		// The pool's Idle went to Prepare's waiter.
		return &vmInstance{b: b, vm: vm, c: newAgentConn(vm.Agent(), func() { t.Error("an Idle went to the pool's waiter") }), how: "vm: fake"}, vm
	}
	t.Run("ended", func(t *testing.T) {
		in, vm := pooled(t, func(net.Conn, wire.Session) {})
		vm.Abort()
		if _, err := b.fromPool(context.Background(), in, moat.SessionOptions{}); !errors.Is(err, engine.ErrStale) {
			t.Errorf("fromPool of a VM that ended: %v, want ErrStale", err)
		}
	})
	t.Run("gone before the idle", func(t *testing.T) {
		in, vm := pooled(t, func(conn net.Conn, _ wire.Session) { conn.Close() })
		if _, err := b.fromPool(context.Background(), in, moat.SessionOptions{}); !errors.Is(err, engine.ErrStale) {
			t.Errorf("fromPool of a VM whose agent went away: %v, want ErrStale", err)
		}
		select {
		case <-vm.Exited():
		default:
			t.Error("the stale VM was not discarded")
		}
	})
	t.Run("silent", func(t *testing.T) {
		// A live VM whose agent does not answer the Session is a failure,
		// not a stale VM to replace.
		in, vm := pooled(t, func(net.Conn, wire.Session) {})
		quick := *b
		quick.cfg.BootTimeout = moat.Duration(200 * time.Millisecond)
		in.b = &quick
		_, err := quick.fromPool(context.Background(), in, moat.SessionOptions{})
		if err == nil || errors.Is(err, engine.ErrStale) || !strings.Contains(err.Error(), "did not answer") {
			t.Errorf("fromPool of a VM whose agent is silent: %v, want its timeout, not ErrStale", err)
		}
		select {
		case <-vm.Exited():
		default:
			t.Error("the VM was not discarded")
		}
	})
	t.Run("answers", func(t *testing.T) {
		got := make(chan wire.Session, 1)
		in, vm := pooled(t, func(conn net.Conn, s wire.Session) {
			got <- s
			wire.Write(conn, wire.KindIdle, nil)
		})
		ss, err := b.fromPool(context.Background(), in, moat.SessionOptions{Interpreter: true})
		if err != nil {
			t.Fatal(err)
		}
		defer ss.Close()
		s := <-got
		if s.Disk != int64(l.Disk) || s.FileSize != int64(l.FileSize) || !s.Interpreter || len(s.Seed) != 64 {
			t.Errorf("the Session frame: %+v; want the session's disk and file size limits, an interpreter, 64 bytes of seed", s)
		}
		if ss.vm != vm || !ss.interp || !fromThePool(ss) || vm.paused.Load() != 1 {
			t.Errorf("the session: pooled %v (%s), interpreter %v, paused %d times; want the pool's VM, paused once", ss.vm == vm, ss.how, ss.interp, vm.paused.Load())
		}
	})
}

// BenchmarkNewSession measures, alternating in one run, NewSession and
// NewSession with its first run of print(1), the session's VM taken from
// the pool (the pool given the time to refill in between) or restored by
// NewSession itself (a sandbox without a pool), plain and with a live
// interpreter, and reports the median of each:
//
//	go test -run '^$' -bench NewSession -benchtime 5x ./microvm
func BenchmarkNewSession(b *testing.B) {
	for _, interp := range []bool{false, true} {
		name := "plain"
		if interp {
			name = "interpreter"
		}
		b.Run(name, func(b *testing.B) { benchNewSession(b, moat.SessionOptions{Interpreter: interp}) })
	}
}

func benchNewSession(b *testing.B, opts moat.SessionOptions) {
	if a := Check(context.Background(), Config{}); !a.Available {
		b.Skipf("the microvm level cannot run here: %s", a.Reason)
	}
	pooled, err := New(Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer pooled.Close()
	own, err := New(Config{Warm: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer own.Close()
	// NewSession of pooled takes the pool's VM once it is ready.
	ready := func() engine.Instance {
		for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if inst, ok := pooled.Sandbox.TakeReady(); ok {
				return inst
			}
		}
		b.Fatal("the pool had no VM ready within a minute")
		return nil
	}
	ctx := context.Background()
	var made, first = map[string][]time.Duration{}, map[string][]time.Duration{}
	b.ResetTimer()
	for range b.N {
		for _, k := range []string{"pool", "own"} {
			sb := own
			if k == "pool" {
				sb = pooled
				inst := ready()
				pooled.b.takeReady = func() (engine.Instance, bool) { return inst, true }
			}
			start := time.Now()
			ss, err := sb.NewSession(ctx, opts)
			if err != nil {
				b.Fatal(err)
			}
			made[k] = append(made[k], time.Since(start))
			res, err := ss.Run(ctx, moat.Request{Code: []byte("print(1)")})
			if err != nil || string(res.Stdout) != "1\n" {
				b.Fatalf("run: %+v, %v", res, err)
			}
			first[k] = append(first[k], time.Since(start))
			if k == "pool" && !fromThePool(ss.(*engine.Session).Instance().(*vmSession)) {
				b.Fatal("the session's VM did not come from the pool")
			}
			ss.Close()
		}
	}
	b.StopTimer()
	median := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2]) / float64(time.Millisecond)
	}
	for _, k := range []string{"pool", "own"} {
		b.ReportMetric(median(made[k]), k+"-new-ms")
		b.ReportMetric(median(first[k]), k+"-first-ms")
	}
	b.ReportMetric(0, "ns/op")
}
