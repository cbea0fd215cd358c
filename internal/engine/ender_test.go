package engine

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// enderBackend's instances start processes that run until killed, after
// writing out to their stdout.
type enderBackend struct {
	out   string
	ender bool // the processes implement Ender
	procs chan *enderProc
}

func (b *enderBackend) Prepare(context.Context) (Instance, error) { return enderInstance{b}, nil }
func (b *enderBackend) Close() error                              { return nil }

func (b *enderBackend) NewSession(context.Context, moat.SessionOptions) (SessionInstance, error) {
	return enderSession{enderInstance{b}}, nil
}

type enderInstance struct{ b *enderBackend }

func (i enderInstance) Start(_ context.Context, _ []byte, stdout, _ io.Writer) (Process, error) {
	p := &enderProc{done: make(chan struct{})}
	i.b.procs <- p
	var proc Process = p
	if i.b.ender {
		proc = &enderProcEnd{p}
	}
	// The output cap's kill comes from this writer, as from a backend's
	// goroutine; Start may still be returning.
	go io.WriteString(stdout, i.b.out)
	return proc, nil
}

func (enderInstance) Discard() {}

type enderSession struct{ enderInstance }

func (enderSession) WriteFile(context.Context, string, io.Reader) error      { return nil }
func (enderSession) ReadFile(context.Context, string) (io.ReadCloser, error) { return nil, nil }
func (enderSession) ListFiles(context.Context) ([]moat.FileInfo, error)      { return nil, nil }
func (enderSession) Stat(context.Context, string) (moat.FileInfo, error)     { return moat.FileInfo{}, nil }
func (enderSession) Mkdir(context.Context, string) error                     { return nil }
func (enderSession) Rename(context.Context, string, string) error            { return nil }
func (enderSession) RemoveFile(context.Context, string) error                { return nil }
func (enderSession) Close() error                                            { return nil }

type enderProc struct {
	mu    sync.Mutex
	kills int
	ends  []moat.Reason
	once  sync.Once
	done  chan struct{}
}

func (p *enderProc) Kill() {
	p.mu.Lock()
	p.kills++
	p.mu.Unlock()
	p.once.Do(func() { close(p.done) })
}

func (p *enderProc) Wait() (Evidence, error) {
	<-p.done
	return Evidence{}, nil
}

type enderProcEnd struct{ *enderProc }

func (p *enderProcEnd) End(why moat.Reason) {
	p.mu.Lock()
	p.ends = append(p.ends, why)
	p.mu.Unlock()
	p.once.Do(func() { close(p.done) })
}

// TestEnderGetsTheReason: a Process that is an Ender learns why the engine
// ended it, in a one-shot run and in a session's (through the session's
// own wrapper of the process); one that is not is killed all the same.
func TestEnderGetsTheReason(t *testing.T) {
	cases := []struct {
		name    string
		out     string
		cancel  bool
		session bool
		want    moat.Reason
	}{
		{"wall time", "", false, false, moat.ReasonTimeout},
		{"output cap", strings.Repeat("x", 100), false, false, moat.ReasonOutput},
		{"canceled", "", true, false, moat.ReasonCanceled},
		{"session wall time", "", false, true, moat.ReasonTimeout},
		{"session output cap", strings.Repeat("x", 100), false, true, moat.ReasonOutput},
		{"session canceled", "", true, true, moat.ReasonCanceled},
	}
	for _, ender := range []bool{true, false} {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				b := &enderBackend{out: c.out, ender: ender, procs: make(chan *enderProc, 2)}
				lim := moat.Limits{Output: 10}
				if !c.cancel {
					lim.WallTime = moat.Duration(50 * time.Millisecond)
				}
				s, err := New(Config{Level: "fake", Limits: lim, Warm: -1}, b)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				if c.cancel {
					time.AfterFunc(50*time.Millisecond, cancel)
				}
				run := s.Run
				if c.session {
					ss, err := s.NewSession(context.Background(), moat.SessionOptions{})
					if err != nil {
						t.Fatal(err)
					}
					defer ss.Close()
					run = ss.Run
				}
				res, err := run(ctx, moat.Request{Code: []byte("x")})
				if err != nil {
					t.Fatal(err)
				}
				if res.Reason != c.want {
					t.Errorf("reason %q, want %q", res.Reason, c.want)
				}
				p := <-b.procs
				p.mu.Lock()
				defer p.mu.Unlock()
				switch {
				case ender && (len(p.ends) == 0 || p.ends[0] != c.want || p.kills != 0):
					t.Errorf("an Ender got End(%v) and %d Kills; want End(%q) first and no Kill", p.ends, p.kills, c.want)
				case !ender && p.kills == 0:
					t.Errorf("a Process that is no Ender was not killed")
				}
			})
		}
	}
}
