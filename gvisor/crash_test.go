package gvisor

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/moatsandbox/moat"
)

// TestSentryFailure makes the sentry of a running sandbox fail for real,
// from the host, and checks that the run is an error wrapping
// moat.ErrUnavailable, not a result the code could be blamed or credited
// for: a Go panic (runsc's --panic-signal makes SIGUSR2 panic the sentry)
// and a SIGKILL from outside moat.
func TestSentryFailure(t *testing.T) {
	cfg := Config{StateDir: t.TempDir(), Warm: -1}
	if a := Check(context.Background(), cfg); !a.Available {
		if os.Getenv("CI") == "true" {
			t.Fatalf("the gvisor level cannot run here: %s; CI must test it", a.Reason)
		}
		t.Skipf("the gvisor level cannot run here: %s (%s)", a.Reason, a.Remedy)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.b.testFlags = []string{"--panic-signal=" + strconv.Itoa(int(syscall.SIGUSR2))}
	for _, c := range []struct {
		name string
		sig  syscall.Signal
		want string
	}{
		{"panic", syscall.SIGUSR2, "the sentry crashed: panic: Signal-induced panic"},
		{"killed from outside", syscall.SIGKILL, "the sentry ended without reporting"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var sent []int
			out := &onReady{do: func() {
				for _, pid := range sentryPids(s.b.runscRoot) {
					if syscall.Kill(pid, c.sig) == nil {
						sent = append(sent, pid)
					}
				}
			}}
			res, err := s.Run(context.Background(), moat.Request{
				Code:   []byte("import time; print('ready', flush=True); time.sleep(30); print('survived')"),
				Stdout: out,
			})
			if len(sent) != 1 {
				t.Fatalf("signalled sentries %v, want exactly one (result %+v, %v)", sent, res, err)
			}
			if !errors.Is(err, moat.ErrUnavailable) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Run = %+v, %v; want an error wrapping ErrUnavailable with %q", res, err, c.want)
			}
		})
	}
	// The level still works.
	res, err := s.Run(context.Background(), moat.Request{Code: []byte("print(6*7)")})
	if err != nil || string(res.Stdout) != "42\n" || res.ExitCode != 0 {
		t.Errorf("a run after the failures: %+v, %v", res, err)
	}
}

// onReady is a Request.Stdout that calls do once, when "ready" appears.
type onReady struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	do   func()
	done bool
}

func (o *onReady) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.buf.Write(p)
	if !o.done && strings.Contains(o.buf.String(), "ready") {
		o.done = true
		o.do()
	}
	return len(p), nil
}

// sentryPids returns the host pids of the sentries whose runsc root is
// root.
func sentryPids(root string) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) > 0 && args[0] == "runsc-sandbox" && strings.Contains(string(b), "\x00boot\x00") &&
			strings.Contains(string(b), "--root="+root+"\x00") {
			out = append(out, pid)
		}
	}
	return out
}
