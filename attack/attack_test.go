package attack

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/sandboxtest"
)

// TestMain checks, after the suite, that no child process of the test
// binary is left: every program a test ran is gone.
func TestMain(m *testing.M) {
	os.Exit(sandboxtest.CheckNoChildren(m.Run(), 0))
}

func plant(t *testing.T) *Env {
	t.Helper()
	env, err := Plant(t.Context())
	if err != nil {
		t.Fatalf("Plant: %v", err)
	}
	t.Cleanup(func() { env.Close() })
	return env
}

// controlUID is the unprivileged uid the positive controls of the probes
// past the tutorial's six run as: no account of the host's uses it, so that
// exhausting its per-uid limits starves nobody, and the host's sockets are
// shown reachable by any uid, not just root.
const controlUID = 64999

// tutorialSix are the tutorial's attacks.
var tutorialSix = []Name{Loop, Memory, ForkFlood, Disk, Credentials, Network}

// controlHow is the How each attack's positive control must get through
// with; "" for the attacks proved by a marker or a token.
var controlHow = map[Name]string{
	Loop:           "not stopped",
	UnixPathStream: "received",
	UnixPathDgram:  "received",
	AbstractUnix:   "received",
	AbstractBind:   "bound on the host",
	UIDSharedLimit: "shared limit",
}

// controlWays are, per attack, the ways through that the positive control
// must show working (regular expressions matched against the Outcome's
// Detail and the program's stdout): those that defeat a refusal of socket(),
// the subprocess level's. A way judged from the host side is named in the
// Detail; host_net's ioctl through a socketpair end is the program's own
// report of a MAC address.
var controlWays = map[Name][]string{
	UnixPathDgram: {`dgram by [a-z_, ]*pair_sendto`, `dgram by [a-z_, ]*pair_reconnect`},
	AbstractUnix:  {`abstract datagram socket \S+ by [a-z_, ]*pair_sendto`, `abstract datagram socket \S+ by [a-z_, ]*pair_reconnect`},
	AbstractBind:  {`[{,]pair_dgram_unspec[,}]`, `[{,]pair_stream[,}]`},
	HostNet:       {`MOAT-IF socketpair\(AF_UNIX\) SIOCGIFHWADDR \S+ (?:[0-9a-f]{2}:){5}[0-9a-f]{2}`},
}

// TestPositiveControls runs every program with the defence off (the host's
// python3, no isolation): each must get through, or its probe is broken and
// a "blocked" from it would prove nothing. The tutorial's six run as root,
// the others as controlUID.
func TestPositiveControls(t *testing.T) {
	env := plant(t)
	for _, name := range All {
		t.Run(string(name), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
			sb, how := hostSandbox{}, controlHow[name]
			if !slices.Contains(tutorialSix, name) {
				sb.uid = controlUID
			}
			if name == Loop {
				// Nothing stops the loop but the harness's deadline. The
				// PID namespace only makes the kill at the deadline take
				// the loop's stray child too, so that what gets through is
				// the loop itself.
				ctx, cancel = context.WithTimeout(t.Context(), time.Second)
				sb = hostSandbox{pidns: true}
			}
			defer cancel()
			o := Run(ctx, sb, env, name)
			if o.Verdict != GotThrough || o.Blocked || o.How != how {
				t.Fatalf("%s with the defence off: %+v, want got_through (%s)\nstdout: %s\nstderr: %s",
					name, o, how, resultOut(o.Result, true), resultOut(o.Result, false))
			}
			for _, w := range controlWays[name] {
				if !regexp.MustCompile(w).MatchString(o.Detail + "\n" + resultOut(o.Result, true)) {
					t.Errorf("%s with the defence off: the way %q did not get through: %s\nstdout: %s", name, w, o.Detail, resultOut(o.Result, true))
				}
			}
			t.Logf("%s (%s): %s", o.Verdict, o.How, o.Detail)
		})
	}
}

func resultOut(r *moat.Result, stdout bool) string {
	if r == nil {
		return "(no result)"
	}
	b := r.Stderr
	if stdout {
		b = r.Stdout
	}
	return string(b[:min(len(b), 2000)])
}

// TestLoopJudgedByWhatIsLeft runs the loop under two real, crude sandboxes
// with a 1s wall timeout: one that kills the whole PID namespace blocks it;
// one that kills only the process group leaves the loop's child running,
// which the host-side check must catch even though the Result says timeout.
func TestLoopJudgedByWhatIsLeft(t *testing.T) {
	tests := []struct {
		sb      hostSandbox
		verdict Verdict
		how     string
	}{
		{hostSandbox{wall: time.Second, pidns: true}, Blocked, "timeout"},
		{hostSandbox{wall: time.Second}, GotThrough, "left running"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("pidns=%v", tt.sb.pidns), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			o := Run(ctx, tt.sb, nil, Loop)
			if o.Verdict != tt.verdict || o.How != tt.how {
				t.Fatalf("got %s (%s): %s; want %s (%s)", o.Verdict, o.How, o.Detail, tt.verdict, tt.how)
			}
			if o.Result == nil || o.Result.Reason != moat.ReasonTimeout {
				t.Fatalf("the crude sandbox did not time out: %+v", o.Result)
			}
		})
	}
}

// fakeSandbox answers Run with whatever its function makes of the request,
// as a sandbox that could not be trusted might.
type fakeSandbox func(ctx context.Context, req moat.Request, p params) (*moat.Result, error)

func (fakeSandbox) Level() moat.Level { return "fake" }
func (fakeSandbox) Close() error      { return nil }
func (f fakeSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	return f(ctx, req, paramsOf(req.Code))
}

var paramsLine = regexp.MustCompile(`^import json, sys; P = json\.loads\(bytes\.fromhex\("([0-9a-f]+)"\)\);`)

// paramsOf reads a program's parameters back from its first line, as the
// program itself does, so that a fake can print what only the program
// could.
func paramsOf(code []byte) params {
	var p params
	first, _, _ := bytes.Cut(code, []byte("\n"))
	m := paramsLine.FindSubmatch(first)
	if m == nil {
		return p
	}
	js, err := hex.DecodeString(string(m[1]))
	if err != nil {
		return p
	}
	json.Unmarshal(js, &p)
	return p
}

// write sends the chunks to w one Write each, as a sandbox streams them.
func write(w io.Writer, chunks ...string) {
	for _, c := range chunks {
		w.Write([]byte(c))
	}
}

func started(p params) string { return marker(kindStarted, p.Nonce) + "\n" }
func errLine(p params, class, detail string) string {
	return marker(kindErr, p.Nonce) + " " + class + " " + detail + "\n"
}
func done(p params) string { return marker(kindDone, p.Nonce) + "\n" }

func TestJudge(t *testing.T) {
	env := plant(t)
	tests := []struct {
		name    string
		attack  Name
		cancel  bool // the caller cancels the run
		sb      fakeSandbox
		verdict Verdict
		how     string
	}{{
		name:   "a traceback echoing the source is no success",
		attack: Memory,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p))
			tb := "Traceback (most recent call last):\n" + string(req.Code) + "\nMemoryError\n"
			write(req.Stderr, tb)
			return &moat.Result{ExitCode: 1, Stderr: []byte(tb)}, nil
		},
		verdict: Inconclusive, how: "no verdict",
	}, {
		name:   "the source printed without running is no start",
		attack: Disk,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, string(req.Code))
			return &moat.Result{Stdout: req.Code}, nil
		},
		verdict: Inconclusive, how: "not started",
	}, {
		name:   "another run's marker does not count",
		attack: Disk,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			other := params{Nonce: strings.Repeat("0", 32)}
			write(req.Stdout, started(p), marker(kindOK, other.Nonce)+"\n", errLine(p, "no_space", "/work"))
			return &moat.Result{ExitCode: 3}, nil
		},
		verdict: Blocked, how: "no space",
	}, {
		name:   "a marker past the output cap, cut across writes, counts",
		attack: Disk,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			filler := strings.Repeat("x", 2<<20)
			ok := marker(kindOK, p.Nonce)
			write(req.Stdout, started(p), filler, ok[:7], ok[7:20], ok[20:]+" wrote 50 MiB\n")
			kept := (started(p) + filler)[:1<<20]
			return &moat.Result{Stdout: []byte(kept), Truncated: true, Reason: moat.ReasonOutput}, nil
		},
		verdict: GotThrough,
	}, {
		name:   "a marker only in the Result, not streamed, counts",
		attack: Memory,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			return &moat.Result{Stdout: []byte(started(p) + marker(kindOK, p.Nonce) + "\n")}, nil
		},
		verdict: GotThrough,
	}, {
		name:   "a Run error is inconclusive",
		attack: Memory,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			return nil, fmt.Errorf("fake: %w", moat.ErrUnavailable)
		},
		verdict: Inconclusive, how: "error",
	}, {
		name:   "a Run error after the start is inconclusive",
		attack: ForkFlood,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "fork_refused", "fork 60"))
			return nil, errors.New("fake: cleanup failed")
		},
		verdict: Inconclusive, how: "error",
	}, {
		name:   "no start marker is inconclusive",
		attack: ForkFlood,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stderr, "python3: not found\n")
			return &moat.Result{ExitCode: 127, Stderr: []byte("python3: not found\n")}, nil
		},
		verdict: Inconclusive, how: "not started",
	}, {
		name:   "a limit's reason blocks",
		attack: Memory,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p))
			return &moat.Result{ExitCode: 137, Reason: moat.ReasonMemory, Signal: "killed"}, nil
		},
		verdict: Blocked, how: "memory",
	}, {
		name:   "a denial reported by the program blocks",
		attack: Credentials,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "permission_denied", p.Path), errLine(p, "file_not_found", "/proc/1/environ"), done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "permission denied",
	}, {
		name:   "a probe that crashed is inconclusive",
		attack: Disk,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "exception", "probe: NameError: x"))
			return &moat.Result{ExitCode: 3}, nil
		},
		verdict: Inconclusive, how: "probe crashed",
	}, {
		name:   "a program that ends without token or denial blocks the credentials",
		attack: Credentials,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), "MOAT-READ "+p.Path+"\n[default]\nfake = yes\n", done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "no token",
	}, {
		name:   "the planted token in the output gets through",
		attack: Credentials,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			data, err := os.ReadFile(p.Path) // the sandbox lets the program read it
			if err != nil {
				return nil, err
			}
			write(req.Stdout, started(p), "MOAT-READ x\n", string(data))
			return &moat.Result{}, nil
		},
		verdict: GotThrough,
	}, {
		name:   "a connection the service saw gets through, whatever the output",
		attack: Network,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			c, err := net.Dial("tcp4", fmt.Sprintf("127.0.0.1:%d", p.Port))
			if err != nil {
				return nil, err
			}
			io.Copy(io.Discard, c)
			c.Close()
			write(req.Stdout, started(p), errLine(p, "network_unreachable", "127.0.0.1"), done(p))
			return &moat.Result{}, nil
		},
		verdict: GotThrough, how: "connected",
	}, {
		name:   "a network denial blocks",
		attack: Network,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p), errLine(p, "network_unreachable", "127.0.0.1"), done(p))
			return &moat.Result{}, nil
		},
		verdict: Blocked, how: "network unreachable",
	}, {
		name:   "a loop stopped at the wall time is blocked",
		attack: Loop,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p))
			return &moat.Result{ExitCode: 137, Reason: moat.ReasonTimeout, Signal: "killed"}, nil
		},
		verdict: Blocked, how: "timeout",
	}, {
		name:   "a loop that exited by itself is inconclusive",
		attack: Loop,
		sb: func(_ context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p))
			return &moat.Result{}, nil
		},
		verdict: Inconclusive, how: "exited",
	}, {
		name:   "a loop still running at the harness's deadline gets through",
		attack: Loop,
		sb: func(ctx context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p))
			<-ctx.Done()
			return &moat.Result{ExitCode: 137, Reason: moat.ReasonCanceled}, nil
		},
		verdict: GotThrough, how: "not stopped",
	}, {
		name:   "a run the caller cancels is inconclusive",
		attack: Loop,
		cancel: true,
		sb: func(ctx context.Context, req moat.Request, p params) (*moat.Result, error) {
			write(req.Stdout, started(p))
			<-ctx.Done()
			return &moat.Result{ExitCode: 137, Reason: moat.ReasonCanceled}, nil
		},
		verdict: Inconclusive, how: "canceled",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			if tt.cancel {
				ctx, cancel = context.WithCancel(t.Context())
				defer cancel()
				time.AfterFunc(50*time.Millisecond, cancel)
			}
			o := Run(ctx, tt.sb, env, tt.attack)
			if o.Verdict != tt.verdict || o.How != tt.how {
				t.Fatalf("got %s (%s): %s; want %s (%s)", o.Verdict, o.How, o.Detail, tt.verdict, tt.how)
			}
			if o.Blocked != (o.Verdict == Blocked) || o.Level != "fake" || o.Attack != tt.attack {
				t.Fatalf("inconsistent outcome %+v", o)
			}
		})
	}
}

// TestSourceHoldsNoProof checks that no program's source contains a marker,
// the nonce in clear or a host token: echoing the source, as a traceback
// does, must prove nothing.
func TestSourceHoldsNoProof(t *testing.T) {
	env := plant(t)
	var setups []*setup
	for _, name := range append(append([]Name(nil), All...), EgressAttacks...) {
		if name == UIDSharedLimit {
			setups = append(setups, sharedSetup("hog"), sharedSetup("probe"))
			continue
		}
		s, err := prepare(name, env)
		if err != nil {
			t.Fatal(err)
		}
		if s.undo != nil {
			defer s.undo()
		}
		setups = append(setups, s)
	}
	for _, s := range setups {
		code, err := source(s.name, s.p)
		if err != nil {
			t.Fatal(err)
		}
		p := s.p
		for _, nd := range append(s.tokens, p.Nonce, marker(kindStarted, p.Nonce), marker(kindOK, p.Nonce),
			marker(kindDone, p.Nonce), marker(kindReady, p.Nonce), marker(kindErr, p.Nonce), "MOAT-HELLO:"+p.Nonce) {
			if bytes.Contains(code, []byte(nd)) {
				t.Errorf("%s: the source contains %q", s.name, nd)
			}
		}
		if got := paramsOf(code); !reflect.DeepEqual(got, p) {
			t.Errorf("%s: the first line holds %+v, want %+v", s.name, got, p)
		}
	}
}

// TestParametersAreData runs a program's first line with values made to
// break out of a string literal: Python must see them as they are.
func TestParametersAreData(t *testing.T) {
	nasty := "/tmp/x\"); import os; os._exit(9) #\n'''\\\" \u2028 \x00 é"
	code, err := source(Credentials, params{Nonce: randomText(32), Tag: "moatx", Path: nasty})
	if err != nil {
		t.Fatal(err)
	}
	first, _, _ := bytes.Cut(code, []byte("\n"))
	prog := string(first) + "\nsys.stdout.write(json.dumps(P[\"path\"]))\n"
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "/usr/bin/python3", "-c", prog)
	cmd.Env = []string{}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python3: %v", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Scan() // the start marker
	var got string
	if !sc.Scan() || json.Unmarshal(sc.Bytes(), &got) != nil || got != nasty {
		t.Fatalf("python saw %q, want %q", out, nasty)
	}
}

func TestPlantClose(t *testing.T) {
	goroutines := runtime.NumGoroutine()
	env, err := Plant(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close()
	home, err := os.UserHomeDir()
	if err != nil {
		t.Fatal(err)
	}
	if rel, err := filepath.Rel(home, env.CredentialsPath); err != nil || strings.HasPrefix(rel, "..") {
		t.Fatalf("credentials at %s, not under the home %s", env.CredentialsPath, home)
	}
	fi, err := os.Stat(env.CredentialsPath)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("credentials mode %v, want 0600", fi.Mode().Perm())
	}
	data, err := os.ReadFile(env.CredentialsPath)
	if err != nil || !bytes.Contains(data, []byte("aws_secret_access_key = "+env.credToken+"\n")) || len(env.credToken) < 32 {
		t.Fatalf("credentials %q lack the token %q", data, env.credToken)
	}

	addr := fmt.Sprintf("127.0.0.1:%d", env.ServicePort)
	if got := dialRead(t, addr); got != env.serviceToken+"\n" {
		t.Fatalf("the service answered %q, want the token %q", got, env.serviceToken)
	}
	if env.conns.Load() != 1 {
		t.Fatalf("the service counted %d connections, want 1", env.conns.Load())
	}

	// The sockets: writable by any uid, and what reaches them is recorded
	// for the runs that expect it only.
	for _, p := range []string{env.sockDir, env.StreamSocket, env.DgramSocket} {
		fi, err := os.Stat(p)
		if err != nil || fi.Mode().Perm() != 0o777 {
			t.Fatalf("%s: %v, %v; want mode 0777", p, fi, err)
		}
	}
	nonce, other := randomText(32), randomText(32)
	env.inbox.expect(nonce)
	for _, addr := range []string{env.DgramSocket, "@" + env.AbstractName} {
		if err := sendDgram(addr, "MOAT-HELLO:"+nonce+" own_sendto\nMOAT-HELLO:"+other+" own_sendto\n"); err != nil {
			t.Fatal(err)
		}
	}
	for _, addr := range []string{env.StreamSocket, "@" + env.AbstractName} {
		c, err := net.Dial("unix", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte("MOAT-HELLO:" + nonce + " own_connect\n"))
		c.Close()
	}
	env.flush()
	if got := env.inbox.take(nonce); len(got) != 4 {
		t.Fatalf("the sockets saw the greeting at %q, want all four", got)
	}
	if len(env.inbox.want) != 0 || len(env.inbox.flushes) != 0 {
		t.Fatalf("the inbox keeps %v and %v", env.inbox.want, env.inbox.flushes)
	}

	if err := env.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := env.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := os.Stat(env.CredentialsPath); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("credentials still there after Close: %v", err)
	}
	if _, err := os.Stat(env.dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the planted directory is still there after Close: %v", err)
	}
	if c, err := net.Dial("tcp4", addr); err == nil {
		c.Close()
		t.Fatalf("the service still accepts on %s after Close", addr)
	}
	if _, err := os.Stat(env.sockDir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the sockets' directory is still there after Close: %v", err)
	}
	if sendDgram("@"+env.AbstractName, "x") == nil {
		t.Fatalf("the abstract name @%s still answers after Close", env.AbstractName)
	}
	if n := runtime.NumGoroutine(); n > goroutines {
		t.Fatalf("%d goroutines after Close, %d before Plant", n, goroutines)
	}
}

func dialRead(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func sampleOutcomes() []Outcome {
	var out []Outcome
	for _, l := range []moat.Level{moat.LevelContainer, moat.LevelSubprocess} {
		for _, a := range All {
			out = append(out, Outcome{Level: l, Attack: a}.blocked("timeout", "exit 137"))
		}
	}
	out[1] = out[1].gotThrough("", "marker") // container, memory
	out[2] = out[2].inconclusive("not started", "")
	return out
}

func TestJSON(t *testing.T) {
	var b bytes.Buffer
	if err := JSON(&b, sampleOutcomes()); err != nil {
		t.Fatal(err)
	}
	var doc map[string][]map[string]any
	if err := json.Unmarshal(b.Bytes(), &doc); err != nil {
		t.Fatalf("%v in %s", err, b.Bytes())
	}
	if len(doc) != 1 || len(doc["results"]) != 2*len(All) {
		t.Fatalf("want one key results with %d entries: %s", 2*len(All), b.Bytes())
	}
	r := doc["results"][1]
	want := map[string]any{"level": "container", "attack": "memory", "verdict": "got_through", "blocked": false, "how": "", "detail": "marker"}
	if fmt.Sprint(r) != fmt.Sprint(want) {
		t.Fatalf("results[1] = %v, want %v", r, want)
	}
	if _, ok := doc["results"][2]["detail"]; ok {
		t.Fatalf("an empty detail is printed: %v", doc["results"][2])
	}
	b.Reset()
	if err := JSON(&b, nil); err != nil || strings.TrimSpace(b.String()) != "{\n  \"results\": []\n}" {
		t.Fatalf("no outcomes: %q, %v", b.String(), err)
	}
}

func TestScoreboard(t *testing.T) {
	var b bytes.Buffer
	if err := Scoreboard(&b, sampleOutcomes()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	if len(lines) != 1+len(All)+1 {
		t.Fatalf("want a header, %d attacks and a total:\n%s", len(All), b.String())
	}
	fields := func(line string) []string { return regexp.MustCompile(`\s{2,}`).Split(strings.TrimSpace(line), -1) }
	want := [][]string{
		{"attack", "subprocess", "container"}, // lightest level first
		{"loop", "blocked (timeout)", "blocked (timeout)"},
		{"memory", "blocked (timeout)", "GOT THROUGH"},
		{"fork_flood", "blocked (timeout)", "inconclusive (not started)"},
		{"disk", "blocked (timeout)", "blocked (timeout)"},
		{"credentials", "blocked (timeout)", "blocked (timeout)"},
		{"network", "blocked (timeout)", "blocked (timeout)"},
	}
	for _, a := range All[len(want)-1:] {
		want = append(want, []string{string(a), "blocked (timeout)", "blocked (timeout)"})
	}
	n := len(All)
	want = append(want, []string{"blocked", fmt.Sprintf("%d/%d", n, n), fmt.Sprintf("%d/%d", n-2, n)})
	for i, w := range want {
		if got := fields(lines[i]); fmt.Sprint(got) != fmt.Sprint(w) {
			t.Errorf("line %d = %q, want %q\n%s", i, got, w, b.String())
		}
	}
	// Columns line up.
	col := strings.Index(lines[0], "container")
	for _, l := range lines[1:] {
		if len(l) < col || l[col-1] != ' ' || l[col] == ' ' {
			t.Fatalf("column 3 does not start at %d in %q", col, l)
		}
	}
}

func TestBreaches(t *testing.T) {
	outcomes := sampleOutcomes()
	if got := Breaches(outcomes, nil); len(got) != 2 || got[0].Attack != Memory || got[1].Attack != ForkFlood {
		t.Fatalf("claiming everything: %+v", got)
	}
	noMemory := func(l moat.Level, a Name) bool { return a != Memory }
	if got := Breaches(outcomes, noMemory); len(got) != 1 || got[0].Attack != ForkFlood {
		t.Fatalf("claiming all but memory: %+v", got)
	}
	if got := Breaches(outcomes, func(moat.Level, Name) bool { return false }); len(got) != 0 {
		t.Fatalf("claiming nothing: %+v", got)
	}
}

func TestParseName(t *testing.T) {
	for _, n := range All {
		if got, err := ParseName(string(n)); err != nil || got != n {
			t.Errorf("ParseName(%q) = %q, %v", n, got, err)
		}
	}
	if _, err := ParseName("fork-flood"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ParseName(fork-flood) = %v, want ErrInvalid", err)
	}
}

// FuzzScanner checks that how a stream is cut into writes changes nothing:
// the scanner finds a needle exactly when the stream contains it, and the
// same error reports.
func FuzzScanner(f *testing.F) {
	nonce := "0123456789abcdef0123456789abcdef"
	f.Add([]byte(marker(kindOK, nonce)+"\n"+marker(kindErr, nonce)+" no_space /tmp\n"), uint8(3), uint8(7))
	f.Add([]byte("MOAT-MOAT-OK:0123456789abcdef0123456789abcdef"), uint8(1), uint8(1))
	f.Add([]byte("secret-token"), uint8(0), uint8(5))
	f.Fuzz(func(t *testing.T, data []byte, a, b uint8) {
		needles := []string{marker(kindOK, nonce), "secret-token", "x"}
		whole := newScanner(nonce, needles...)
		whole.Write(data)
		whole.finish()
		cut := newScanner(nonce, needles...)
		for rest, step := data, 1+int(a); len(rest) > 0; step = 1 + (step*int(b)+int(a))%61 {
			n := min(step, len(rest))
			if got, _ := cut.Write(rest[:n]); got != n {
				t.Fatalf("Write returned %d, want %d", got, n)
			}
			rest = rest[n:]
		}
		cut.finish()
		for i, nd := range needles {
			want := bytes.Contains(data, []byte(nd))
			if whole.found[i] != want || cut.found[i] != want {
				t.Fatalf("needle %q: whole %v, cut %v, want %v", nd, whole.found[i], cut.found[i], want)
			}
		}
		if fmt.Sprint(whole.errs) != fmt.Sprint(cut.errs) {
			t.Fatalf("errs differ: %v vs %v", whole.errs, cut.errs)
		}
	})
}
