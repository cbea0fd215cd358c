package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// hashProbe prints the string hash of a constant, which only Python's hash
// secret (_Py_HashSecret, drawn when python3 starts) decides, and says that
// nothing fixed the secret: PYTHONHASHSEED unset, hash randomization on.
const hashProbe = "import os, sys\nprint(hash('moat-seed'), os.environ.get('PYTHONHASHSEED'), sys.flags.hash_randomization)\n"

var hashLine = regexp.MustCompile(`^(-?[0-9]+) None 1\n$`)

// hashOf checks a probe's output and returns its hash.
func hashOf(t *testing.T, out string) string {
	t.Helper()
	m := hashLine.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("the hash probe printed %q, want the hash, None (no PYTHONHASHSEED) and 1 (randomized)", out)
	}
	return m[1]
}

// Every VM restored from one template runs its code in a python3 of its
// own, started after the VM's refresh: two one-shot runs, from the pool
// (Prepare's Refresh) or not, have different string hash secrets (issue
// 13: the hash seed is reseeded in every fork).
//
// The same python3 draws its address layout (where libc is mapped) and its
// stack canary (from the 16 bytes of AT_RANDOM) at its start: a run's are
// its own as well.
func TestHashSeedOneShot(t *testing.T) {
	parallel(t)
	sb := shared(t)
	a, b := hashOf(t, string(run(t, sb, hashProbe).Stdout)), hashOf(t, string(run(t, sb, hashProbe).Stdout))
	if a == b {
		t.Errorf("two one-shot runs of one template have one string hash secret: hash('moat-seed') = %s in both", a)
	}
	la, lb := string(run(t, sb, layoutProbe).Stdout), string(run(t, sb, layoutProbe).Stdout)
	fa, fb := strings.Fields(la), strings.Fields(lb)
	if len(fa) != 2 || len(fb) != 2 || len(fa[1]) != 32 {
		t.Fatalf("the layout probe printed %q and %q, want libc's address and 32 hexadecimal digits", la, lb)
	}
	if fa[0] == fb[0] || fa[1] == fb[1] {
		t.Errorf("two one-shot runs: libc at %s and %s, AT_RANDOM %s and %s; want each run's own", fa[0], fb[0], fa[1], fb[1])
	}
}

// layoutProbe prints where libc is mapped and the bytes of AT_RANDOM (the
// kernel's 16 random bytes for the process, which glibc's stack canary is
// made from).
const layoutProbe = `import ctypes, struct
libc = [l.split('-')[0] for l in open('/proc/self/maps') if 'libc.so' in l][0]
aux = open('/proc/self/auxv', 'rb').read()
rnd = [ctypes.string_at(v, 16).hex() for k, v in struct.iter_unpack('QQ', aux) if k == 25][0]
print(libc, rnd)
`

// A Run that comes to a VM with no Refresh before it (the agent cannot know
// what the host did) still runs in a python3 started after the Run's own
// refresh, not in the template's: the agent checks it where the code is
// handed over.
func TestHashSeedRunWithoutRefresh(t *testing.T) {
	parallel(t)
	sb := open(t, noPool(t), moat.Limits{})
	probe := func() string {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		vm, n, how, err := sb.b.startVM(ctx)
		if err != nil {
			t.Fatal(err)
		}
		in := &vmInstance{b: sb.b, vm: vm, net: n, c: newAgentConn(vm.Agent(), nil), how: how}
		defer in.Discard()
		var out, errs bytes.Buffer
		p, err := in.Start(ctx, []byte(hashProbe), &out, &errs)
		if err != nil {
			t.Fatal(err)
		}
		ev, err := p.Wait()
		if err != nil || !ev.Exited || ev.Status.ExitStatus() != 0 {
			t.Fatalf("Wait: %+v, %v; stderr %s", ev, err, errs.Bytes())
		}
		return hashOf(t, out.String())
	}
	if a, b := probe(), probe(); a == b {
		t.Errorf("two VMs of one template sent a Run without a Refresh ran in one hash secret: hash('moat-seed') = %s in both", a)
	}
}

// A plain session's first run has a secret of its own, not the template's;
// each later run is a new python3 with a new one.
func TestHashSeedSessions(t *testing.T) {
	parallel(t)
	sb := open(t, noPool(t), moat.Limits{})
	a, b := newSession(t, sb), newSession(t, sb)
	a1, b1 := hashOf(t, runOK(t, a, hashProbe)), hashOf(t, runOK(t, b, hashProbe))
	if a1 == b1 {
		t.Errorf("the first runs of two plain sessions have one hash secret: hash('moat-seed') = %s in both", a1)
	}
	if a2 := hashOf(t, runOK(t, a, hashProbe)); a2 == a1 {
		t.Errorf("two runs of one plain session have one hash secret: %s", a1)
	}
}

// A live interpreter keeps its secret from run to run (its dicts and sets
// are its memory); two sessions' interpreters have secrets of their own.
func TestHashSeedInterpreter(t *testing.T) {
	parallel(t)
	sb := open(t, noPool(t), moat.Limits{})
	ctx := context.Background()
	a, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	a1, b1 := hashOf(t, runOK(t, a, hashProbe)), hashOf(t, runOK(t, b, hashProbe))
	if a1 == b1 {
		t.Errorf("two interpreter sessions have one hash secret: hash('moat-seed') = %s in both", a1)
	}
	if a2 := hashOf(t, runOK(t, a, hashProbe)); a2 != a1 {
		t.Errorf("one interpreter session's hash of one string changed between runs: %s, then %s", a1, a2)
	}
}

// Forks of one suspended state: a plain session's runs are new python3s,
// each fork's its own, started after the fork's Refresh (the one waiting
// in the saved state is replaced); an interpreter session's interpreter
// that has run code is its memory, which every fork has as saved, hash
// secret included — the declared exception (see suspend.go). One saved
// before its first run is replaced like a plain session's python3.
func TestHashSeedForks(t *testing.T) {
	parallel(t)
	sb := open(t, noPool(t), moat.Limits{})
	ctx := context.Background()
	forks := func(ss moat.Session) (moat.Session, moat.Session) {
		dir, _ := suspendOne(t, ss)
		return resumeOne(t, sb, dir), resumeOne(t, sb, dir)
	}

	t.Run("plain", func(t *testing.T) {
		ss := newSession(t, sb)
		orig := hashOf(t, runOK(t, ss, hashProbe))
		f, g := forks(ss)
		hf, hg := hashOf(t, runOK(t, f, hashProbe)), hashOf(t, runOK(t, g, hashProbe))
		if hf == hg || hf == orig || hg == orig {
			t.Errorf("plain session %s, then its two forks %s and %s: a fork ran in the saved state's python3", orig, hf, hg)
		}
	})
	t.Run("interpreter", func(t *testing.T) {
		ss, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
		if err != nil {
			t.Fatal(err)
		}
		defer ss.Close()
		orig := hashOf(t, runOK(t, ss, hashProbe))
		f, g := forks(ss)
		hf, hg := hashOf(t, runOK(t, f, hashProbe)), hashOf(t, runOK(t, g, hashProbe))
		if hf != orig || hg != orig {
			t.Errorf("the declared exception: forks of a live interpreter keep its hash secret (%s); they have %s and %s", orig, hf, hg)
		}
	})
	t.Run("interpreter before its first run", func(t *testing.T) {
		ss, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
		if err != nil {
			t.Fatal(err)
		}
		defer ss.Close()
		f, g := forks(ss)
		rf, rg := runIn(t, f, hashProbe), runIn(t, g, hashProbe)
		hf, hg := hashOf(t, string(rf.Stdout)), hashOf(t, string(rg.Stdout))
		if hf == hg {
			t.Errorf("two forks of an interpreter session saved before its first run have one hash secret: %s", hf)
		}
		for _, r := range []*moat.Result{rf, rg} {
			if strings.Contains(strings.Join(r.Notes, "\n"), "interpreter restarted") {
				t.Errorf("a fork's first run says the interpreter restarted, as if one had ended: %q", r.Notes)
			}
		}
	})
}

// Prepare's Refresh: the host sends the time and fresh randomness, and
// takes the agent's Idle as ready; a Fail, another frame, a VM that ends
// or a silent one is an error, and no instance goes to the pool.
func TestRefreshAgent(t *testing.T) {
	for _, tt := range []struct {
		name  string
		guest func(conn net.Conn)
		want  string
		is    error
	}{
		{"idle", func(conn net.Conn) { wire.Write(conn, wire.KindIdle, nil) }, "", nil},
		{"fail", func(conn net.Conn) { wire.Write(conn, wire.KindFail, []byte("start the run's python3: boom")) }, "boom", moat.ErrUnavailable},
		{"another frame", func(conn net.Conn) { wire.Write(conn, wire.KindStarted, nil) }, "sent started in answer to the refresh", nil},
		{"the VM ends", func(conn net.Conn) { conn.Close() }, "the VM ended before its agent was refreshed", nil},
		{"silent", func(conn net.Conn) {}, "did not answer the refresh within", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			vm := newFakeVM(t)
			got := make(chan wire.Refresh, 1)
			go func() {
				k, p, err := wire.Read(vm.guest, 0)
				var r wire.Refresh
				if err != nil || k != wire.KindRefresh || json.Unmarshal(p, &r) != nil {
					t.Errorf("the guest got %s %q, %v; want a refresh", k, p, err)
				}
				got <- r
				tt.guest(vm.guest)
			}()
			idle := make(chan struct{}, 1)
			c := newAgentConn(vm.Agent(), func() { idle <- struct{}{} })
			before := time.Now()
			err := refreshAgent(context.Background(), c, idle, 500*time.Millisecond)
			if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) ||
				tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("refreshAgent = %v, want %q (wrapping %v)", err, tt.want, tt.is)
			}
			r := <-got
			if len(r.Seed) != 64 || time.Unix(0, r.UnixNano).Before(before) || time.Unix(0, r.UnixNano).After(time.Now()) {
				t.Errorf("the refresh: %d bytes of seed, time %v; want 64 and the host's clock", len(r.Seed), time.Unix(0, r.UnixNano))
			}
		})
	}
}
