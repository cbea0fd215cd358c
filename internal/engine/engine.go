package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/capture"
)

// Config configures the engine over one backend.
type Config struct {
	// Level is the level the backend is; it names results and errors.
	Level moat.Level
	// Limits bound each run; zero fields mean moat's defaults.
	Limits moat.Limits
	// Warm is how many instances are kept prepared ahead of runs. Zero
	// means DefaultWarm; -1 means none (every run prepares its own).
	Warm int
	// WarmMax is how many the pool may keep while runs come in bursts:
	// each run that finds none ready raises the pool's size by one, up
	// to WarmMax, and each BurstDecay without such a run lowers it by
	// one, down to Warm (an instance over the size is discarded). Zero
	// means Warm: the pool keeps Warm, always. It must not be below Warm
	// nor above MaxWarm.
	WarmMax int
	// RefillAfterRun makes the pool prepare the instance that replaces
	// one a run took once that run has ended, not as it starts: for a
	// level whose Prepare competes with the run for the host's CPU (a
	// microvm under emulation, where a restore keeps a CPU busy).
	RefillAfterRun bool
	// MaxRuns caps how many runs (and session runs) are in progress at
	// once; the others wait for a slot, or for their context. Zero means no
	// cap.
	MaxRuns int
	// MaxCode is the most code one run may carry, on top of the disk
	// limit. Zero means only the disk limit caps it.
	MaxCode int
	// Notes are put in every Result, before the evidence's own.
	Notes []string
	// Hints are notes a Result gets when its stderr, as captured, shows a
	// message of the level's that says more than it seems to (a loader
	// refusing a noexec mount, say). They are for the reader: they decide
	// no verdict, and code that prints the message gets the note.
	Hints []Hint
	// Recycle lets consecutive runs of one tenant (moat.Request.Tenant)
	// reuse one instance, reset between them; runs of different tenants
	// or without one never share. The backend must be a Recycler, else
	// New fails. False (the default) gives every run a fresh instance.
	// See recycle.go.
	Recycle bool
	// Logger gets a line per run at debug level. Nil means discard.
	Logger *slog.Logger
}

// Hint is a note for a Result whose stderr contains In.
type Hint struct {
	In   string
	Note string
}

// DefaultWarm is what a zero Config.Warm means, and MaxWarm the most it may
// ask.
const (
	DefaultWarm = 1
	MaxWarm     = 16
)

// BurstDecay is how long a pool that grew for a burst (Config.WarmMax)
// waits without a miss before it shrinks by one.
const BurstDecay = 30 * time.Second

// ValidateWarm checks a level's warm setting; the error wraps
// moat.ErrInvalid and names the level.
func ValidateWarm(level moat.Level, warm int) error {
	if warm < -1 || warm > MaxWarm {
		return fmt.Errorf("%s: warm %d is not between -1 (none) and %d: %w", level, warm, MaxWarm, moat.ErrInvalid)
	}
	return nil
}

// ValidateWarmMax checks a level's warm_max setting against its warm; the
// error wraps moat.ErrInvalid and names the level.
func ValidateWarmMax(level moat.Level, warm, warmMax int) error {
	if warmMax == 0 {
		return nil
	}
	if warm == 0 {
		warm = DefaultWarm
	}
	if warmMax < max(warm, 0) || warmMax > MaxWarm {
		return fmt.Errorf("%s: warm_max %d is not between warm (%d) and %d: %w", level, warmMax, max(warm, 0), MaxWarm, moat.ErrInvalid)
	}
	return nil
}

// Sandbox is a moat.Sandbox over a backend; it is a moat.Sessioner when the
// backend is a SessionBackend.
type Sandbox struct {
	cfg    Config
	lim    moat.Limits
	b      Backend
	log    *slog.Logger
	pool   *pool
	rec    *recycler // nil unless Config.Recycle
	slots  chan struct{}
	mu     sync.Mutex
	closed bool
	quit   chan struct{} // closed by Close: runs still waiting for a slot give up
	runs   sync.WaitGroup
}

var (
	_ moat.Sandbox      = (*Sandbox)(nil)
	_ moat.PoolReporter = (*Sandbox)(nil)
)

// New returns the engine over b. It starts preparing Config.Warm instances
// in the background.
func New(cfg Config, b Backend) (*Sandbox, error) {
	if err := ValidateWarm(cfg.Level, cfg.Warm); err != nil {
		return nil, err
	}
	if err := ValidateWarmMax(cfg.Level, cfg.Warm, cfg.WarmMax); err != nil {
		return nil, err
	}
	if err := cfg.Limits.Validate(); err != nil {
		return nil, err
	}
	s := &Sandbox{cfg: cfg, lim: cfg.Limits.WithDefaults(), b: b, log: cfg.Logger, quit: make(chan struct{})}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxRuns > 0 {
		s.slots = make(chan struct{}, cfg.MaxRuns)
	}
	warm := cfg.Warm
	if warm == 0 {
		warm = DefaultWarm
	}
	if cfg.Recycle {
		rec, err := newRecycler(s, b)
		if err != nil {
			return nil, err
		}
		s.rec = rec
	}
	s.pool = newPool(b, max(warm, 0), max(warm, cfg.WarmMax, 0), s.log, cfg.Level)
	s.pool.refillAfter = cfg.RefillAfterRun
	return s, nil
}

// Level returns the backend's level.
func (s *Sandbox) Level() moat.Level { return s.cfg.Level }

// Limits returns the limits every run gets, defaults filled in.
func (s *Sandbox) Limits() moat.Limits { return s.lim }

// Backend returns the backend under s.
func (s *Sandbox) Backend() Backend { return s.b }

// Take returns a prepared instance from the pool, or prepares one now, for
// a backend that serves a run of one of its sessions with an instance of
// the kind it prepares for one-shot runs (a helper process waiting for its
// spec), so that session runs too find one ready. The caller discards it.
// It is safe for concurrent use, also after Close, when it prepares one.
func (s *Sandbox) Take(ctx context.Context) (Instance, error) { return s.pool.take(ctx) }

// PoolStats says how the pool of prepared instances has served runs; see
// moat.PoolReporter.
func (s *Sandbox) PoolStats() moat.PoolStats {
	ps := s.pool.stats()
	if s.rec != nil {
		s.rec.stats(&ps)
	}
	return ps
}

// TakeReady returns an instance the pool prepared ahead, and false when
// none is ready; it never prepares one. It is for a backend that makes a
// session's instance out of one prepared for a one-shot run (a restored VM)
// where making its own differs from Prepare. The caller owns what it gets:
// it keeps it or discards it. With RefillAfterRun the pool prepares the
// replacement once the session's creation has ended (see NewSession). It
// is safe for concurrent use.
func (s *Sandbox) TakeReady() (Instance, bool) { return s.pool.takeReady() }

// Close makes later runs fail with moat.ErrClosed, and so the runs still
// waiting for a MaxRuns slot, waits for the runs in progress, discards the
// pooled instances and closes the backend. Calls after the first return
// nil.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.quit)
	s.mu.Unlock()
	s.runs.Wait()
	if s.rec != nil {
		s.rec.shut()
	}
	s.pool.close()
	return s.b.Close()
}

// enter checks the request and counts a run in; the caller calls s.runs.Done.
func (s *Sandbox) enter(req moat.Request) error {
	if err := s.checkCode(req.Code); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("%s: %w", s.cfg.Level, moat.ErrClosed)
	}
	s.runs.Add(1)
	return nil
}

func (s *Sandbox) checkCode(code []byte) error {
	if len(code) == 0 {
		return fmt.Errorf("%s: empty code: %w", s.cfg.Level, moat.ErrInvalid)
	}
	if int64(len(code)) > int64(s.lim.Disk) {
		return fmt.Errorf("%s: code of %d bytes does not fit in the disk limit %v: %w", s.cfg.Level, len(code), s.lim.Disk, moat.ErrInvalid)
	}
	if s.cfg.MaxCode > 0 && len(code) > s.cfg.MaxCode {
		return fmt.Errorf("%s: code of %d bytes is more than the level takes (%d): %w", s.cfg.Level, len(code), s.cfg.MaxCode, moat.ErrInvalid)
	}
	return nil
}

// slot waits for a run slot when MaxRuns caps them; release gives it back.
// A one-shot run (oneShot) gives up when the sandbox closes; a session's
// runs outlive it.
func (s *Sandbox) slot(ctx context.Context, oneShot bool) (release func(), err error) {
	if s.slots == nil {
		return func() {}, nil
	}
	var quit chan struct{}
	if oneShot {
		quit = s.quit
	}
	closed := func() error {
		return fmt.Errorf("%s: closed while the run waited for a slot: %w", s.cfg.Level, moat.ErrClosed)
	}
	select {
	case s.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-quit:
		return nil, closed()
	}
	select {
	case <-quit: // a slot came free as the sandbox closed
		<-s.slots
		return nil, closed()
	default:
		return func() { <-s.slots }, nil
	}
}

// Run runs req in a fresh instance; see moat.Sandbox.
func (s *Sandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	if err := s.enter(req); err != nil {
		return nil, err
	}
	defer s.runs.Done()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	start := time.Now()
	release, err := s.slot(ctx, true)
	if err != nil {
		return nil, err
	}
	defer release()
	if s.rec != nil && req.Tenant != "" {
		if rc := s.rec.take(req.Tenant); rc != nil {
			if res, err, ok := s.runRecycled(ctx, rc, req, start); ok {
				return res, err
			}
		} else {
			s.rec.want(req.Tenant)
		}
	}
	res, err := s.runFresh(ctx, req, start)
	if err != nil {
		return nil, err
	}
	s.log.Debug(string(s.cfg.Level)+": run", "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason)
	return res, nil
}

func (s *Sandbox) runFresh(ctx context.Context, req moat.Request, start time.Time) (*moat.Result, error) {
	for attempt := 0; ; attempt++ {
		inst, err := s.pool.take(ctx)
		if err != nil {
			return nil, s.setupError(ctx, err)
		}
		res, err := s.runIn(ctx, inst.Start, req, start)
		inst.Discard()
		if s.cfg.RefillAfterRun {
			s.pool.poke()
		}
		if errors.Is(err, ErrStale) && attempt == 0 {
			continue
		}
		if res != nil {
			res.Duration = time.Since(start)
		}
		return res, err
	}
}

// setupError is err, or the caller's cancellation when that is what it was.
func (s *Sandbox) setupError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	// A stale instance's error is wrapped too: runFresh still sees
	// ErrStale in it, and when the retry is stale as well, the caller gets
	// moat's class.
	if errors.Is(err, moat.ErrUnavailable) || errors.Is(err, moat.ErrInvalid) || errors.Is(err, moat.ErrClosed) ||
		errors.Is(err, moat.ErrSpent) {
		return err
	}
	return fmt.Errorf("%s: %w: %w", s.cfg.Level, moat.ErrUnavailable, err)
}

// starter is Instance.Start or SessionInstance.Start.
type starter func(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error)

// runIn is the one run lifecycle: start the code with its output captured,
// kill it at the wall time, on cancellation or past the output cap, wait for
// its end and judge it.
func (s *Sandbox) runIn(ctx context.Context, start starter, req moat.Request, began time.Time) (*moat.Result, error) {
	lim := s.lim
	k := &killer{}
	stdout := capture.New(int64(lim.Output), req.Stdout, func() { k.kill(&k.output) })
	stderr := capture.New(int64(lim.Output), req.Stderr, func() { k.kill(&k.output) })
	p, err := start(ctx, req.Code, stdout, stderr)
	if err != nil {
		return nil, s.setupError(ctx, err)
	}
	k.set(p)

	wall := time.AfterFunc(time.Duration(lim.WallTime), func() { k.kill(&k.wall) })
	stopCancel := context.AfterFunc(ctx, func() { k.kill(&k.canceled) })
	ev, err := p.Wait()
	wall.Stop()
	stopCancel()
	k.mu.Lock()
	ev.Canceled, ev.WallTime, ev.Output = k.canceled, k.wall, k.output
	k.mu.Unlock()
	if stdout.Truncated() || stderr.Truncated() {
		ev.Output = true
	}
	// After a kill of the engine's, a Wait error of no class is the kill's
	// own doing (a helper or VM killed before it could report) and the run
	// gets its verdict; one wrapping moat.ErrUnavailable says the sandbox
	// failed all the same, and is never turned into a Result.
	killed := ev.Canceled || ev.WallTime || ev.Output
	if err != nil && (!killed || errors.Is(err, moat.ErrUnavailable)) {
		return nil, s.setupError(context.Background(), err)
	}
	v := Judge(ev)
	res := &moat.Result{
		Level:     s.cfg.Level,
		Stdout:    stdout.Bytes(),
		Stderr:    stderr.Bytes(),
		Truncated: stdout.Truncated() || stderr.Truncated(),
		ExitCode:  v.ExitCode,
		Signal:    v.SignalName(),
		Reason:    v.Reason,
		Duration:  time.Since(began),
	}
	if n := len(s.cfg.Notes) + len(ev.Notes); n > 0 {
		res.Notes = append(append(make([]string, 0, n), s.cfg.Notes...), ev.Notes...)
	}
	for _, h := range s.cfg.Hints {
		if bytes.Contains(res.Stderr, []byte(h.In)) {
			res.Notes = append(res.Notes, h.Note)
		}
	}
	return res, nil
}

// killer kills a run once, for the first reason, even before its Process is
// known (output may pass the cap while Start is still returning).
type killer struct {
	mu                     sync.Mutex
	p                      Process
	pending                bool
	canceled, wall, output bool
}

func (k *killer) kill(why *bool) {
	k.mu.Lock()
	first := !k.canceled && !k.wall && !k.output
	if first {
		*why = true
	}
	p, reason := k.p, k.reason()
	if p == nil {
		k.pending = true
	}
	k.mu.Unlock()
	if p != nil {
		end(p, reason)
	}
}

func (k *killer) set(p Process) {
	k.mu.Lock()
	k.p = p
	pending, reason := k.pending, k.reason()
	k.mu.Unlock()
	if pending {
		end(p, reason)
	}
}

// reason is the first reason the run was killed for. The caller holds k.mu.
func (k *killer) reason() moat.Reason {
	switch {
	case k.canceled:
		return moat.ReasonCanceled
	case k.wall:
		return moat.ReasonTimeout
	default:
		return moat.ReasonOutput
	}
}

// end ends p for why: through End when p is an Ender, else Kill.
func end(p Process, why moat.Reason) {
	if e, ok := p.(Ender); ok {
		e.End(why)
		return
	}
	p.Kill()
}
