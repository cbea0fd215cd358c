package engine

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moatsandbox/moat"
)

// Recycling (Config.Recycle): consecutive runs of one tenant
// (moat.Request.Tenant) may reuse one instance, reset between them. The
// instance is the level's ([Recycler]): a plain session's, made and reset
// by the backend; the engine keeps, per tenant,
// the instances reset and waiting (parked), hands one to a run of that
// tenant only, and closes them when they are idle too long, have served
// recycleRuns runs, fail to reset, or the sandbox closes.
//
// A run of a tenant that finds none parked runs as any other, in a fresh
// instance of the pool; when the tenant ran before, within recycleIdle,
// the engine then makes one for it in the background, so that its next
// runs find it (a tenant that runs once costs no instance of its own). A parked instance that cannot
// start a run (it went bad while it waited) is closed and the run goes to
// the pool. Every Result of a recycled run says so in its notes.

// Recycler is implemented by backends whose instances can serve one
// tenant's consecutive runs.
//
// NewRecycled makes such an instance: a plain session's (as
// SessionBackend.NewSession with no options would), which the engine never
// exposes as a session. Its Start serves one run at a time, as a session's.
//
// Reset makes inst, an instance NewRecycled made, whose last run's Process.Wait
// has returned, as a fresh instance would be for the next run: every
// process of the code's killed, every place the code could write
// (its working directory, /tmp, /dev/shm, kernel objects that outlive a
// process such as SysV IPC) emptied, and the counters that judge a run or
// the session (CPU budgets, the spent flag) fresh. It is called off the
// run's path, never while a run or file operation of inst is in progress.
// An error means inst cannot serve another run; the engine then closes
// it. Reset must judge from the host side that the reset happened: what
// the code left behind may try to make it look done.
type Recycler interface {
	Backend
	NewRecycled(ctx context.Context) (SessionInstance, error)
	Reset(ctx context.Context, inst SessionInstance) error
}

const (
	// recycleKeep is the most instances parked at once, over all tenants:
	// a park past it closes the one parked longest.
	recycleKeep = 8
	// recycleIdle is how long a parked instance waits for its tenant.
	recycleIdle = 2 * time.Minute
	// recycleRuns is how many runs one instance serves before it is
	// closed, so that what a reset cannot see (a sandbox kernel's own
	// caches) does not accumulate without bound.
	recycleRuns = 100
	// resetTimeout bounds a Reset, and makeTimeout the making of an
	// instance for a tenant.
	resetTimeout = 30 * time.Second
	makeTimeout  = time.Minute
)

// makeAtOnce is how many instances are made for one tenant at once: a
// tenant whose runs come from several clients at a time needs several, and
// one at a time left most of its first seconds' runs without one (a fresh
// instance made on the run's path each).
const makeAtOnce = 2

// recycleWork is how many makes and resets run at once: two per CPU. They
// are off the runs' paths and outside MaxRuns, so a tenant whose runs
// leave much to wipe must not take the host from the others' runs; but a
// reset starts the next run's interpreter, as a pool's refill does, and
// with one per CPU the resets, not the CPUs, bounded a tenant's runs under
// 8 clients (container-runc/recycled 0.33x of the bare python3 start's
// runs/s against 0.38x and 0.50x with two per CPU, alternated, 2 cores).
var recycleWork = max(2, 2*runtime.NumCPU())

// recycled is one instance of a tenant's.
type recycled struct {
	tenant string
	inst   SessionInstance
	runs   int       // runs it has served
	parked time.Time // when it was last parked
	idle   *time.Timer
}

// recycler keeps the parked instances of a Sandbox.
type recycler struct {
	s *Sandbox
	b Recycler

	mu     sync.Mutex
	parked map[string][]*recycled // by tenant, oldest first
	n      int                    // parked, over all tenants
	making map[string]int         // instances being made, by tenant
	seen   map[string]time.Time   // when tenants without a parked instance last ran
	closed bool
	bg     sync.WaitGroup // makes, resets and closes in progress
	work   chan struct{}  // a slot per make or reset running (recycleWork)

	served atomic.Int64 // runs served by a recycled instance
}

func newRecycler(s *Sandbox, b Backend) (*recycler, error) {
	rb, ok := b.(Recycler)
	if !ok {
		return nil, fmt.Errorf("%s: recycling is not supported at this level: %w", s.cfg.Level, moat.ErrInvalid)
	}
	return &recycler{s: s, b: rb, parked: map[string][]*recycled{}, making: map[string]int{}, seen: map[string]time.Time{},
		work: make(chan struct{}, recycleWork)}, nil
}

// take returns the instance of tenant's parked longest, or nil.
func (r *recycler) take(tenant string) *recycled {
	r.mu.Lock()
	defer r.mu.Unlock()
	list := r.parked[tenant]
	if len(list) == 0 {
		return nil
	}
	rc := list[0]
	r.unparkLocked(rc)
	return rc
}

// unparkLocked takes rc out of the parked instances. The caller holds mu.
func (r *recycler) unparkLocked(rc *recycled) {
	list := r.parked[rc.tenant]
	for i, x := range list {
		if x == rc {
			list = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(r.parked, rc.tenant)
	} else {
		r.parked[rc.tenant] = list
	}
	r.n--
	rc.idle.Stop()
}

// maxSeen bounds the tenants want remembers.
const maxSeen = 4096

// want makes an instance for tenant in the background when the tenant ran
// before within recycleIdle, unless one is being made for it already or
// the sandbox is closing.
func (r *recycler) want(tenant string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	last, again := r.seen[tenant]
	again = again && now.Sub(last) < recycleIdle
	if len(r.seen) >= maxSeen {
		for t, at := range r.seen {
			if now.Sub(at) >= recycleIdle {
				delete(r.seen, t)
			}
		}
		if len(r.seen) >= maxSeen {
			clear(r.seen)
		}
	}
	r.seen[tenant] = now
	if r.closed || r.making[tenant] >= makeAtOnce || !again {
		return
	}
	r.making[tenant]++
	r.bg.Go(func() {
		defer func() {
			r.mu.Lock()
			if r.making[tenant]--; r.making[tenant] == 0 {
				delete(r.making, tenant)
			}
			r.mu.Unlock()
		}()
		if !r.begin() {
			return
		}
		defer r.end()
		ctx, cancel := context.WithTimeout(context.Background(), makeTimeout)
		defer cancel()
		inst, err := r.b.NewRecycled(ctx)
		if err != nil {
			r.s.log.Warn(string(r.s.cfg.Level)+": recycle: cannot make an instance", "err", err)
			return
		}
		r.park(&recycled{tenant: tenant, inst: inst})
	})
}

// park puts rc back for its tenant's next run, or closes it when the
// sandbox is closing. A park past recycleKeep closes the instance parked
// longest, whoever's it is.
func (r *recycler) park(rc *recycled) {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		r.close(rc)
		return
	}
	var evict *recycled
	if r.n >= recycleKeep {
		for _, list := range r.parked {
			if len(list) > 0 && (evict == nil || list[0].parked.Before(evict.parked)) {
				evict = list[0]
			}
		}
		if evict != nil {
			r.unparkLocked(evict)
		}
	}
	rc.parked = time.Now()
	rc.idle = time.AfterFunc(recycleIdle, func() { r.expire(rc) })
	r.parked[rc.tenant] = append(r.parked[rc.tenant], rc)
	r.n++
	r.mu.Unlock()
	if evict != nil {
		r.close(evict)
	}
}

// expire closes rc if it is still parked.
func (r *recycler) expire(rc *recycled) {
	r.mu.Lock()
	still := false
	for _, x := range r.parked[rc.tenant] {
		if x == rc {
			still = true
			break
		}
	}
	if still {
		r.unparkLocked(rc)
	}
	r.mu.Unlock()
	if still {
		r.close(rc)
	}
}

// close closes rc's instance.
func (r *recycler) close(rc *recycled) {
	if err := rc.inst.Close(); err != nil {
		r.s.log.Warn(string(r.s.cfg.Level)+": recycle: close", "err", err)
	}
}

// after resets rc once its run has ended, in the background, and parks it
// again, unless it has served recycleRuns runs or the run left it unable
// to serve (broken: its sandbox failed).
func (r *recycler) after(rc *recycled, broken bool) {
	r.mu.Lock()
	closed := r.closed
	if !closed {
		r.bg.Add(1)
	}
	r.mu.Unlock()
	if closed {
		r.close(rc)
		return
	}
	go func() {
		defer r.bg.Done()
		if broken || rc.runs >= recycleRuns {
			r.close(rc)
			return
		}
		if !r.begin() {
			r.close(rc)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), resetTimeout)
		err := r.b.Reset(ctx, rc.inst)
		cancel()
		r.end()
		if err != nil {
			r.s.log.Warn(string(r.s.cfg.Level)+": recycle: reset failed; the instance is closed", "err", err)
			r.close(rc)
			return
		}
		r.park(rc)
	}()
}

// begin waits for a work slot; false means the sandbox closed meanwhile
// and the work is not to be done. end gives the slot back.
func (r *recycler) begin() bool {
	r.work <- struct{}{}
	r.mu.Lock()
	closed := r.closed
	r.mu.Unlock()
	if closed {
		<-r.work
	}
	return !closed
}

func (r *recycler) end() { <-r.work }

// shut closes every parked instance and waits for the makes and resets in
// progress, whose instances are closed as they end.
func (r *recycler) shut() {
	r.mu.Lock()
	r.closed = true
	var all []*recycled
	for _, list := range r.parked {
		all = append(all, list...)
	}
	for _, rc := range all {
		r.unparkLocked(rc)
	}
	r.mu.Unlock()
	for _, rc := range all {
		r.close(rc)
	}
	r.bg.Wait()
}

func (r *recycler) stats(ps *moat.PoolStats) {
	r.mu.Lock()
	ps.Parked = r.n
	r.mu.Unlock()
	ps.Recycled = r.served.Load()
}

// runRecycled runs req in rc, a parked instance of req.Tenant's. ok is
// false when rc could not start the code (nothing of it ran): rc is then
// closed and the caller runs req in a fresh instance.
func (s *Sandbox) runRecycled(ctx context.Context, rc *recycled, req moat.Request, began time.Time) (res *moat.Result, err error, ok bool) {
	started := false
	var ev Evidence
	res, err = s.runIn(ctx, func(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error) {
		p, err := rc.inst.Start(ctx, code, stdout, stderr)
		if err != nil {
			return nil, err
		}
		started = true
		return &spy{Process: p, ev: &ev}, nil
	}, req, began)
	if !started {
		s.rec.close(rc)
		if ctx.Err() != nil {
			return nil, ctx.Err(), true
		}
		s.log.Debug(string(s.cfg.Level)+": recycle: a parked instance could not start a run", "err", err)
		return nil, nil, false
	}
	rc.runs++
	if rc.runs > 1 {
		s.rec.served.Add(1) // the first run of a tenant's instance is not a recycled one
	}
	// A sandbox that failed (an error) or whose session budget the run
	// used up serves no more runs.
	s.rec.after(rc, err != nil || ev.Spent)
	if err != nil {
		return nil, err, true
	}
	if rc.runs > 1 {
		res.Notes = append(res.Notes, fmt.Sprintf("recycled: this run's instance served %d earlier run(s) of the same tenant, reset after each (every process killed, its writable places emptied, its counters fresh)", rc.runs-1))
	}
	res.Duration = time.Since(began)
	return res, nil, true
}
