package engine

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moatsandbox/moat"
)

// pool keeps instances prepared ahead of runs: size of them, which is n
// but grows by one, up to most, with each take that finds none ready, and
// shrinks by one, down to n, each BurstDecay without such a take. One
// goroutine refills it, one instance at a time, whenever a run takes one,
// so that the refill never holds more than one Prepare's worth of the
// host while runs are in progress; a failed Prepare is retried after a
// pause that doubles up to a minute, so that a level that went bad does
// not spin.
type pool struct {
	b     Backend
	n     int
	most  int
	log   *slog.Logger
	level moat.Level

	// size is how many the pool keeps now, between n and most; lastMiss
	// is the time of the last take that found none (UnixNano).
	size     atomic.Int64
	lastMiss atomic.Int64

	// refillAfter: take does not wake the refill; the run's end does.
	refillAfter bool

	// hits and misses count takes that found a prepared instance and
	// those that prepared their own.
	hits, misses atomic.Int64

	ready  chan Instance
	wake   chan struct{}
	quit   chan struct{}
	done   chan struct{}
	ctx    context.Context
	cancel context.CancelFunc
	once   sync.Once
}

func newPool(b Backend, n, most int, log *slog.Logger, level moat.Level) *pool {
	p := &pool{b: b, n: n, most: max(n, most), log: log, level: level,
		ready: make(chan Instance, max(n, most, 1)), wake: make(chan struct{}, 1),
		quit: make(chan struct{}), done: make(chan struct{})}
	p.size.Store(int64(n))
	p.ctx, p.cancel = context.WithCancel(context.Background())
	if p.most == 0 {
		close(p.done)
		return p
	}
	go p.fill()
	p.poke()
	return p
}

func (p *pool) poke() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// take returns a prepared instance, or prepares one now.
func (p *pool) take(ctx context.Context) (Instance, error) {
	select {
	case inst := <-p.ready:
		p.hits.Add(1)
		if !p.refillAfter {
			p.poke()
		}
		return inst, nil
	default:
	}
	p.miss()
	if !p.refillAfter {
		p.poke()
	}
	return p.b.Prepare(ctx)
}

// miss counts a take that found none ready, and grows the pool by one up
// to most.
func (p *pool) miss() {
	p.misses.Add(1)
	p.lastMiss.Store(time.Now().UnixNano())
	if cur := p.size.Load(); cur < int64(p.most) {
		p.size.CompareAndSwap(cur, cur+1)
	}
}

// burstDecay is BurstDecay; tests shorten it.
var burstDecay = BurstDecay

// shrink lowers a pool that grew for a burst by one when no take missed
// for BurstDecay, and discards an instance over the new size.
func (p *pool) shrink(now time.Time) {
	cur := p.size.Load()
	if cur <= int64(p.n) || now.Sub(time.Unix(0, p.lastMiss.Load())) < burstDecay {
		return
	}
	if !p.size.CompareAndSwap(cur, cur-1) {
		return
	}
	p.lastMiss.Store(now.UnixNano()) // the next step waits as long again
	if len(p.ready) > int(cur-1) {
		select {
		case inst := <-p.ready:
			inst.Discard()
		default:
		}
	}
}

// stats says how the pool has served takes.
func (p *pool) stats() moat.PoolStats {
	return moat.PoolStats{Size: int(p.size.Load()), Max: p.most, Ready: len(p.ready), Hits: p.hits.Load(), Misses: p.misses.Load()}
}

// takeReady returns a prepared instance if one waits, and never prepares
// one.
func (p *pool) takeReady() (Instance, bool) {
	select {
	case inst := <-p.ready:
		p.hits.Add(1)
		if !p.refillAfter {
			p.poke()
		}
		return inst, true
	default:
		p.miss()
		return nil, false
	}
}

func (p *pool) fill() {
	defer close(p.done)
	pause := time.Duration(0)
	decay := time.NewTicker(burstDecay / 4)
	defer decay.Stop()
	for {
		select {
		case <-p.quit:
			return
		case <-p.wake:
		case <-time.After(pause):
		case now := <-decay.C:
			p.shrink(now)
			continue
		}
		for len(p.ready) < int(p.size.Load()) {
			// Closed: nothing more is prepared (a Prepare may not stop for
			// its context, and each costs a container or a VM).
			select {
			case <-p.quit:
				return
			default:
			}
			inst, err := p.b.Prepare(p.ctx)
			if err != nil {
				select {
				case <-p.quit:
					return
				default:
				}
				pause = min(max(2*pause, time.Second), time.Minute)
				p.log.Warn(string(p.level)+": prepare an instance ahead of runs", "err", err, "retry_in", pause)
				break
			}
			pause = time.Hour
			select {
			case <-p.quit:
				inst.Discard()
				return
			default:
			}
			select {
			case p.ready <- inst:
			case <-p.quit:
				inst.Discard()
				return
			}
		}
	}
}

// close stops the refill and discards the instances that wait.
func (p *pool) close() {
	p.once.Do(func() {
		close(p.quit)
		p.cancel()
		<-p.done
		for {
			select {
			case inst := <-p.ready:
				inst.Discard()
			default:
				return
			}
		}
	})
}
