package attack

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func greetingOf(p params, way string) string { return "MOAT-HELLO:" + p.Nonce + " " + way + "\n" }

// sendDgram sends msg to the unix datagram socket addr from the host, as a
// sandbox that let its program through would.
func sendDgram(addr, msg string) error {
	c, err := net.Dial("unixgram", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.Write([]byte(msg))
	return err
}

// hostToken returns the command line of the host_procs process of the run,
// read from the host's /proc, as a program that sees the host's processes
// would print it.
func hostToken() string {
	dirs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, d := range dirs {
		b, _ := os.ReadFile(d)
		if bytes.HasPrefix(b, []byte("moat-host-")) {
			return string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
		}
	}
	return ""
}

// TestJudgeHostSide checks the probes judged from the host's side: only
// what the host saw counts, never what the program says it did.
func TestJudgeHostSide(t *testing.T) {
	env := plant(t)
	macs, err := hostMACs()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		attack  Name
		sb      fakeSandbox
		verdict Verdict
		how     string
		detail  string // a part of the Detail, when not ""
	}{{
		name:   "a greeting the host's datagram socket received gets through, whatever the output",
		attack: UnixPathDgram,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			if err := sendDgram(p.Path, greetingOf(p, "pair_sendto")); err != nil {
				return nil, err
			}
			write(req.Stdout, started(p), errLine(p, "permission_denied", "own_connect"), done(p))
			return &moat.Result{}, nil
		},
		verdict: GotThrough, how: "received", detail: "dgram by pair_sendto",
	}, {
		name:   "a greeting written slowly down the stream socket gets through",
		attack: UnixPathStream,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			c, err := net.Dial("unix", p.Path)
			if err != nil {
				return nil, err
			}
			g := greetingOf(p, "own_connect")
			c.Write([]byte(g[:9]))
			time.Sleep(30 * time.Millisecond)
			c.Write([]byte(g[9:]))
			c.Close() // the harness reads it after Run returned: flush waits
			write(req.Stdout, started(p), done(p))
			return &moat.Result{}, nil
		},
		verdict: GotThrough, how: "received", detail: "stream by own_connect",
	}, {
		name:   "a greeting the program only prints proves nothing",
		attack: AbstractUnix,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), "MOAT-SENT own_sendto @"+p.Name+"\n"+greetingOf(p, "own_sendto"), done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "not received",
	}, {
		name:   "another run's greeting does not count",
		attack: AbstractUnix,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			other := params{Nonce: randomText(32)}
			if err := sendDgram("@"+p.Name, greetingOf(other, "own_sendto")); err != nil {
				return nil, err
			}
			write(req.Stdout, started(p), errLine(p, "connection_refused", "own_connect"), done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "not received",
	}, {
		name:   "every way refused: the first refusal says how",
		attack: UnixPathDgram,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "permission_denied", "own_connect"), errLine(p, "file_not_found", "pair_sendto"))
			return &moat.Result{ExitCode: 3}, nil
		},
		verdict: Blocked, how: "permission denied",
	}, {
		name:   "a way that crashed makes the probe inconclusive",
		attack: UnixPathDgram,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "permission_denied", "own_connect"), errLine(p, "exception", "pair_sendto: NameError"), done(p))
			return &moat.Result{}, nil
		},
		verdict: Inconclusive, how: "probe crashed",
	}, {
		name:   "an abstract name bound in the host's namespace gets through",
		attack: AbstractBind,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: "@" + p.Name + "-pair_dgram", Net: "unixgram"})
			if err != nil {
				return nil, err
			}
			time.Sleep(100 * time.Millisecond)
			c.Close()
			write(req.Stdout, started(p), errLine(p, "permission_denied", "own_dgram"), done(p))
			return &moat.Result{}, nil
		},
		verdict: GotThrough, how: "bound on the host", detail: "{pair_dgram}",
	}, {
		name:   "a name bound elsewhere, as the program says, is not on the host",
		attack: AbstractBind,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), "MOAT-BOUND @"+p.Name+"-own_dgram\n", done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "not on the host",
	}, {
		name:   "the host process's command line in the output gets through",
		attack: HostProcs,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			tok := hostToken()
			if tok == "" {
				return nil, fmt.Errorf("no host_procs process on the host")
			}
			write(req.Stdout, started(p), "MOAT-PROC 1 uid 0 sleep: "+tok+"\n", done(p))
			return &moat.Result{}, nil
		},
		verdict: GotThrough,
	}, {
		name:   "a made-up host command line is no token",
		attack: HostProcs,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), "MOAT-PROC 1 uid 0 sleep: moat-host-"+randomText(32)+" 600\n", done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "no token",
	}, {
		name:   "a host interface's MAC address in the output gets through",
		attack: HostNet,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), "MOAT-IF sysfs lo 00:00:00:00:00:00\nMOAT-IF sysfs eth0 "+macs[len(macs)-1]+"\n", done(p))
			return &moat.Result{}, nil
		},
		verdict: GotThrough,
	}, {
		name:   "loopback alone is no host address",
		attack: HostNet,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), "MOAT-IF sysfs lo 00:00:00:00:00:00\n", done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "no host address",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			o := Run(ctx, tt.sb, env, tt.attack)
			if o.Verdict != tt.verdict || o.How != tt.how || !strings.Contains(o.Detail, tt.detail) {
				t.Fatalf("got %s (%s): %s; want %s (%s) with %q", o.Verdict, o.How, o.Detail, tt.verdict, tt.how, tt.detail)
			}
		})
	}
	if n := len(env.inbox.want); n != 0 {
		t.Errorf("the inbox still expects %d run(s)", n)
	}
}

// TestJudgeShared checks the judgement of the two-run probe from what a
// fake hog and a fake probe print and when each ends.
func TestJudgeShared(t *testing.T) {
	ok := func(p params, text string) string { return marker(kindOK, p.Nonce) + " " + text + "\n" }
	ready := func(p params) string { return marker(kindReady, p.Nonce) + " 128\n" }
	// holds prints what a hog that reached its uid's limit prints, and
	// holds until the harness cancels it.
	holds := func(ctx context.Context, req moat.Request, p params) (*moat.Result, error) {
		write(req.Stdout, started(p), ok(p, "holds 128 inotify instances"), ready(p))
		<-ctx.Done()
		return &moat.Result{ExitCode: 137, Reason: moat.ReasonCanceled}, nil
	}
	refused := func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
		write(req.Stdout, started(p), ok(p, "inotify_init1 failed with EMFILE"))
		return &moat.Result{}, nil
	}
	granted := func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
		write(req.Stdout, started(p), "MOAT-GOT an inotify instance of its own\n", done(p))
		return &moat.Result{}, nil
	}
	tests := []struct {
		name       string
		hog, probe fakeSandbox
		verdict    Verdict
		how        string
	}{{
		name: "refused while the neighbour holds: a shared limit",
		hog:  holds, probe: refused,
		verdict: GotThrough, how: "shared limit",
	}, {
		name: "granted while the neighbour holds the limit: not shared",
		hog:  holds, probe: granted,
		verdict: Blocked, how: "not shared",
	}, {
		name: "refused after the neighbour ended proves nothing",
		hog: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), ok(p, "holds 128"), ready(p))
			return &moat.Result{}, nil
		},
		probe: func(ctx context.Context, req moat.Request, p params) (*moat.Result, error) {
			time.Sleep(50 * time.Millisecond)
			return refused(ctx, req, p)
		},
		verdict: Inconclusive, how: "neighbour gone",
	}, {
		name: "granted while a neighbour that reached no limit holds proves nothing",
		hog: func(ctx context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "not_exhausted", "4096 instances"), ready(p))
			<-ctx.Done()
			return &moat.Result{Reason: moat.ReasonCanceled}, nil
		},
		probe:   granted,
		verdict: Inconclusive, how: "not exhausted",
	}, {
		name: "granted while a neighbour its own run's limits stopped holds: own limits",
		hog: func(ctx context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "own_limits", "16000 inotify instances in 63 process(es), then fork: EAGAIN"), ready(p))
			<-ctx.Done()
			return &moat.Result{Reason: moat.ReasonCanceled}, nil
		},
		probe:   granted,
		verdict: Blocked, how: "own limits",
	}, {
		name: "a neighbour denied inotify blocks",
		hog: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "permission_denied", "inotify_init1"))
			return &moat.Result{ExitCode: 3}, nil
		},
		probe:   refused,
		verdict: Blocked, how: "permission denied",
	}, {
		name: "a neighbour that never started is inconclusive",
		hog: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			return nil, fmt.Errorf("fake: %w", moat.ErrUnavailable)
		},
		probe:   refused,
		verdict: Inconclusive, how: "error",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			sb := fakeSandbox(func(ctx context.Context, req moat.Request, p params) (*moat.Result, error) {
				if p.Role == "hog" {
					return tt.hog(ctx, req, p)
				}
				return tt.probe(ctx, req, p)
			})
			o := Run(ctx, sb, nil, UIDSharedLimit)
			if o.Verdict != tt.verdict || o.How != tt.how {
				t.Fatalf("got %s (%s): %s; want %s (%s)", o.Verdict, o.How, o.Detail, tt.verdict, tt.how)
			}
		})
	}
}
