package engine

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// recycling is a Recycler over fake sessions: a run's code "leave" leaves
// a file behind, "look" exits 1 when it finds one; Reset removes them
// unless failReset is set.
type recycling struct {
	fakeSessions
	mu        sync.Mutex
	made      []*recSession
	resets    int
	failReset bool
	// hold, when set, blocks every Reset until it is closed; resetting
	// and mostResetting count the Resets in progress.
	hold                     chan struct{}
	resetting, mostResetting int
}

type recSession struct {
	fakeSession
}

func (b *recycling) NewRecycled(ctx context.Context) (SessionInstance, error) {
	rs := &recSession{fakeSession: fakeSession{files: map[string]string{}}}
	b.mu.Lock()
	b.made = append(b.made, rs)
	b.mu.Unlock()
	return rs, nil
}

func (rs *recSession) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error) {
	switch string(code) {
	case "leave":
		rs.mu.Lock()
		rs.files["residue"] = "x"
		rs.mu.Unlock()
		code = []byte("exit 0")
	case "look":
		rs.mu.Lock()
		n := len(rs.files)
		rs.mu.Unlock()
		if n > 0 {
			code = []byte("exit 1")
		} else {
			code = []byte("exit 0")
		}
	}
	return rs.fakeSession.Start(ctx, code, stdout, stderr)
}

func (b *recycling) Reset(ctx context.Context, inst SessionInstance) error {
	b.mu.Lock()
	hold := b.hold
	b.resetting++
	b.mostResetting = max(b.mostResetting, b.resetting)
	b.mu.Unlock()
	if hold != nil {
		<-hold
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.resetting--
	if b.failReset {
		return errors.New("fake: reset failed")
	}
	b.resets++
	rs := inst.(*recSession)
	rs.mu.Lock()
	clear(rs.files)
	rs.mu.Unlock()
	return nil
}

func (b *recycling) counts() (made, resets int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.made), b.resets
}

func newRecycling(t *testing.T) (*Sandbox, *recycling) {
	t.Helper()
	b := &recycling{}
	s, err := New(Config{Level: moat.LevelGVisor, Limits: fast(), Warm: -1, Recycle: true}, b)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, b
}

// waitParked waits until n instances are parked.
func waitParked(t *testing.T, s *Sandbox, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.PoolStats().Parked != n {
		if time.Now().After(deadline) {
			t.Fatalf("parked %d, want %d", s.PoolStats().Parked, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitMade waits until no instance is being made for a tenant.
func waitMade(t *testing.T, s *Sandbox) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.rec.mu.Lock()
		n := len(s.rec.making)
		s.rec.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("an instance for a tenant is still being made")
		}
		time.Sleep(time.Millisecond)
	}
}

// waitClosed waits until inst is closed once.
func waitClosed(t *testing.T, inst *recSession, what string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		inst.mu.Lock()
		closed := inst.closed
		inst.mu.Unlock()
		if closed == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s was not closed", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func recycledNote(res *moat.Result) string {
	for _, n := range res.Notes {
		if strings.HasPrefix(n, "recycled:") {
			return n
		}
	}
	return ""
}

func run(t *testing.T, s *Sandbox, tenant, code string) *moat.Result {
	t.Helper()
	res, err := s.Run(context.Background(), moat.Request{Code: []byte(code), Tenant: tenant})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func TestRecycleNeedsARecycler(t *testing.T) {
	_, err := New(Config{Level: moat.LevelSubprocess, Recycle: true}, &fakeSessions{})
	// fakeSessions keeps sessions but cannot reset one.
	if !errors.Is(err, moat.ErrInvalid) || !strings.Contains(err.Error(), "recycling is not supported") {
		t.Fatalf("New with Recycle over a backend that cannot reset: %v", err)
	}
}

func TestRecycleWithinOneTenant(t *testing.T) {
	s, b := newRecycling(t)
	// The first run goes to the pool, and makes no instance for a tenant
	// that may never run again; the second one does.
	if res := run(t, s, "alice", "exit 0"); recycledNote(res) != "" {
		t.Fatalf("a first run is not recycled: %v", res.Notes)
	}
	waitMade(t, s)
	if made, _ := b.counts(); made != 0 {
		t.Fatal("an instance was made for a tenant's first run")
	}
	if res := run(t, s, "alice", "exit 0"); recycledNote(res) != "" {
		t.Fatalf("a second run that found none parked is not recycled: %v", res.Notes)
	}
	waitParked(t, s, 1)
	// Its first run leaves a file; the reset removes it before the next.
	run(t, s, "alice", "leave")
	waitParked(t, s, 1)
	res := run(t, s, "alice", "look")
	if res.ExitCode != 0 {
		t.Fatal("a recycled run found what the tenant's previous run left: no reset between them")
	}
	if note := recycledNote(res); !strings.Contains(note, "served 1 earlier run") {
		t.Fatalf("the recycled run's notes: %v", res.Notes)
	}
	waitParked(t, s, 1)
	if made, resets := b.counts(); made != 1 || resets != 2 {
		t.Fatalf("made %d instances, %d resets; want 1 and 2", made, resets)
	}
	if ps := s.PoolStats(); ps.Recycled != 1 {
		t.Fatalf("pool stats %+v: want 1 recycled run (the first run of the tenant's instance is not one)", ps)
	}
}

func TestRecycleNeverAcrossTenants(t *testing.T) {
	s, b := newRecycling(t)
	run(t, s, "alice", "exit 0")
	run(t, s, "alice", "exit 0")
	waitParked(t, s, 1)
	run(t, s, "alice", "leave")
	// While alice's instance is parked, bob's runs never get it, nor do
	// runs without a tenant.
	for _, tenant := range []string{"bob", "bob", ""} {
		if res := run(t, s, tenant, "exit 0"); recycledNote(res) != "" {
			t.Fatalf("tenant %q got a recycled instance: %v", tenant, res.Notes)
		}
	}
	waitParked(t, s, 2) // alice's and the one made for bob
	b.mu.Lock()
	alice := b.made[0]
	b.mu.Unlock()
	before := alice.runs.Load()
	res := run(t, s, "bob", "look")
	if alice.runs.Load() != before {
		t.Fatal("bob's run went to alice's instance")
	}
	if res.ExitCode != 0 || recycledNote(res) == "" && len(res.Notes) != 0 {
		t.Fatalf("bob's run: %+v", res)
	}
}

func TestRecycleOffByDefault(t *testing.T) {
	b := &recycling{}
	s, err := New(Config{Level: moat.LevelGVisor, Limits: fast(), Warm: -1}, b)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for range 3 {
		run(t, s, "alice", "exit 0")
	}
	time.Sleep(20 * time.Millisecond)
	if made, _ := b.counts(); made != 0 || s.PoolStats().Parked != 0 {
		t.Fatalf("recycling off, yet %d instances made for a tenant", made)
	}
}

func TestRecycleFailedResetCloses(t *testing.T) {
	s, b := newRecycling(t)
	run(t, s, "alice", "exit 0")
	run(t, s, "alice", "exit 0")
	waitParked(t, s, 1)
	b.mu.Lock()
	b.failReset = true
	inst := b.made[0]
	b.mu.Unlock()
	run(t, s, "alice", "leave")
	waitClosed(t, inst, "an instance whose reset failed")
	if s.PoolStats().Parked != 0 {
		t.Fatal("an instance whose reset failed was parked again")
	}
	// The next run of the tenant runs in a fresh instance.
	if res := run(t, s, "alice", "exit 0"); res.ExitCode != 0 || recycledNote(res) != "" {
		t.Fatalf("after a failed reset: %+v", res)
	}
}

func TestRecycleSpentCloses(t *testing.T) {
	s, b := newRecycling(t)
	run(t, s, "alice", "exit 0")
	run(t, s, "alice", "exit 0")
	waitParked(t, s, 1)
	run(t, s, "alice", "spend")
	b.mu.Lock()
	inst := b.made[0]
	b.mu.Unlock()
	waitClosed(t, inst, "an instance whose budget a run used up")
	if _, resets := b.counts(); resets != 0 {
		t.Fatal("a spent instance was reset for reuse")
	}
}

func TestRecycleKeepsAtMost(t *testing.T) {
	s, b := newRecycling(t)
	for i := range recycleKeep + 2 {
		run(t, s, string(rune('a'+i)), "exit 0")
		run(t, s, string(rune('a'+i)), "exit 0")
		waitMade(t, s)
		waitParked(t, s, min(i+1, recycleKeep))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	closed := 0
	for _, rs := range b.made {
		rs.mu.Lock()
		closed += rs.closed
		rs.mu.Unlock()
	}
	if len(b.made) != recycleKeep+2 || closed != 2 {
		t.Fatalf("%d made, %d closed: want %d made and the 2 parked longest closed", len(b.made), closed, recycleKeep+2)
	}
	if first := b.made[0]; first.closed != 1 {
		t.Fatal("the instance parked longest was not the one closed")
	}
}

func TestRecycleCloseClosesParked(t *testing.T) {
	b := &recycling{}
	s, err := New(Config{Level: moat.LevelGVisor, Limits: fast(), Warm: -1, Recycle: true}, b)
	if err != nil {
		t.Fatal(err)
	}
	run(t, s, "alice", "exit 0")
	run(t, s, "alice", "exit 0")
	waitParked(t, s, 1)
	run(t, s, "alice", "exit 0") // its reset may still run as Close starts
	s.Close()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, rs := range b.made {
		if rs.closed != 1 {
			t.Fatalf("an instance of the tenant's was closed %d times by the sandbox's Close", rs.closed)
		}
	}
}

func TestRecycleBoundsBackgroundWork(t *testing.T) {
	s, b := newRecycling(t)
	tenants := []string{"a", "b", "c", "d", "e"}
	for _, tenant := range tenants {
		run(t, s, tenant, "exit 0")
		run(t, s, tenant, "exit 0")
	}
	waitMade(t, s)
	waitParked(t, s, len(tenants))
	b.mu.Lock()
	b.hold = make(chan struct{})
	b.mu.Unlock()
	for _, tenant := range tenants {
		run(t, s, tenant, "exit 0") // each leaves a reset to do
	}
	time.Sleep(50 * time.Millisecond)
	b.mu.Lock()
	most := b.mostResetting
	close(b.hold)
	b.mu.Unlock()
	if most != recycleWork {
		t.Fatalf("%d resets ran at once, want at most (and here exactly) %d", most, recycleWork)
	}
	waitParked(t, s, len(tenants))
}
