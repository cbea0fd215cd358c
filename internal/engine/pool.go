package engine

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
)

// pool keeps up to n instances prepared ahead of runs. One goroutine
// refills it, one instance at a time, whenever a run takes one; a failed
// Prepare is retried after a pause that doubles up to a minute, so that a
// level that went bad does not spin.
type pool struct {
	b     Backend
	n     int
	log   *slog.Logger
	level moat.Level

	// refillAfter: take does not wake the refill; the run's end does.
	refillAfter bool

	ready  chan Instance
	wake   chan struct{}
	quit   chan struct{}
	done   chan struct{}
	ctx    context.Context
	cancel context.CancelFunc
	once   sync.Once
}

func newPool(b Backend, n int, log *slog.Logger, level moat.Level) *pool {
	p := &pool{b: b, n: n, log: log, level: level,
		ready: make(chan Instance, max(n, 1)), wake: make(chan struct{}, 1),
		quit: make(chan struct{}), done: make(chan struct{})}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	if n == 0 {
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
		if !p.refillAfter {
			p.poke()
		}
		return inst, nil
	default:
	}
	if !p.refillAfter {
		p.poke()
	}
	return p.b.Prepare(ctx)
}

// takeReady returns a prepared instance if one waits, and never prepares
// one.
func (p *pool) takeReady() (Instance, bool) {
	select {
	case inst := <-p.ready:
		if !p.refillAfter {
			p.poke()
		}
		return inst, true
	default:
		return nil, false
	}
}

func (p *pool) fill() {
	defer close(p.done)
	pause := time.Duration(0)
	for {
		select {
		case <-p.quit:
			return
		case <-p.wake:
		case <-time.After(pause):
		}
		for len(p.ready) < p.n {
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
