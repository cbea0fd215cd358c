package container_test

// Hostile review of recycling with the runc driver (moat issue 15): probes
// that attack runc_recycle.go, runc_reset.go and recycle_server.py. Each
// probe names the claim of the design (the doc at the top of
// runc_recycle.go) it attacks.
//
// On 1b66f64 these fail: TestReviewRecycledRunc/SchedSlice,
// TestReviewRecycledRunc/KillKeeper/prlimit, TestReviewRecycledRunc/KillKeeper/oom,
// TestReviewIPCClearThreadExit (recycle_review_internal_test.go) and, in
// about one run of three, TestReviewResetKeepsOthers. TestReviewExplore is
// a tool of the review's, skipped unless REVIEW_CODE names a file of
// programs.

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/sandboxtest"
)

// reviewLog is a log safe for concurrent writes.
type reviewLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *reviewLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *reviewLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// reviewTenant is one tenant's runs in a recycling runc Sandbox.
type reviewTenant struct {
	t    *testing.T
	sb   moat.Sandbox
	pr   moat.PoolReporter
	logs *reviewLog
}

// newReviewTenant makes a recycling Sandbox with limits l and primes the
// tenant's instance, as sandboxtest's recycling suite does: after it, the
// tenant's runs are recycled.
func newReviewTenant(t *testing.T, l moat.Limits) *reviewTenant {
	t.Helper()
	needRunc(t)
	logs := &reviewLog{}
	sb, err := moatcontainer.New(moatcontainer.Config{Limits: l, Driver: moatcontainer.DriverRunc, Recycle: true,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatalf("container.New with the runc driver, recycling: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	r := &reviewTenant{t: t, sb: sb, pr: sb, logs: logs}
	r.mustRun("print(1)")
	r.mustRun("print(1)")
	if !r.waitParked() {
		t.Fatalf("no instance parked: %s", logs.String())
	}
	if res := r.mustRun("print(1)"); string(res.Stdout) != "1\n" {
		t.Fatalf("priming run: %+v", res)
	}
	if !r.waitParked() {
		t.Fatalf("not parked again: %s", logs.String())
	}
	return r
}

// run runs code as the tenant.
func (r *reviewTenant) run(code string) (*moat.Result, error) {
	return r.sb.Run(context.Background(), moat.Request{Code: []byte(code), Tenant: "review"})
}

func (r *reviewTenant) mustRun(code string) *moat.Result {
	r.t.Helper()
	res, err := r.run(code)
	if err != nil {
		r.t.Fatalf("run: %v\nlogs: %s", err, tail(r.logs.String(), 5))
	}
	return res
}

// waitParked waits until an instance is parked (true) or a reset failed
// (false).
func (r *reviewTenant) waitParked() bool {
	r.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for r.pr.PoolStats().Parked == 0 {
		if strings.Contains(r.logs.String(), "reset failed") {
			return false
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("nothing parked after 60s: %s", tail(r.logs.String(), 5))
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

func tail(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

func logRes(t *testing.T, what string, res *moat.Result) {
	t.Helper()
	t.Logf("%s: exit %d reason %q recycled %v stdout %q stderr %q", what, res.ExitCode, res.Reason, sandboxtest.Recycled(res), clipS(res.Stdout), clipS(res.Stderr))
}

func clipS(b []byte) string {
	if len(b) > 800 {
		return string(b[:800]) + "..."
	}
	return string(b)
}

// TestReviewExplore runs the programs of the file $REVIEW_CODE (separated by
// lines "----") one after the other as one tenant: a tool for the review,
// skipped without the variable.
func TestReviewExplore(t *testing.T) {
	file := os.Getenv("REVIEW_CODE")
	if file == "" {
		t.Skip("REVIEW_CODE is not set")
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var l moat.Limits
	mib := func(k string) moat.Bytes {
		n, _ := strconv.Atoi(os.Getenv(k))
		return moat.Bytes(n) * moat.MiB
	}
	dur := func(k string) moat.Duration {
		d, _ := time.ParseDuration(os.Getenv(k))
		return moat.Duration(d)
	}
	l.Memory, l.Disk, l.CPUTime, l.WallTime = mib("REVIEW_MEM"), mib("REVIEW_DISK"), dur("REVIEW_CPU"), dur("REVIEW_WALL")
	r := newReviewTenant(t, l)
	for i, code := range strings.Split(string(b), "\n----\n") {
		if os.Getenv("REVIEW_FRESH") == "1" {
			res, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(code)})
			if err == nil {
				logRes(t, "fresh", res)
			}
		}
		start := time.Now()
		res, err := r.run(code)
		if err != nil {
			t.Logf("run %d: error after %v: %v", i, time.Since(start), err)
		} else {
			logRes(t, "run", res)
		}
		if !r.waitParked() {
			t.Logf("run %d: reset failed: %s", i, tail(r.logs.String(), 3))
		}
	}
}

// TestReviewRecycledRunc runs the review's level-neutral probes
// (sandboxtest.RunRecycledReview) with the runc driver.
func TestReviewRecycledRunc(t *testing.T) {
	needRunc(t)
	sandboxtest.RunRecycledReview(t, func(t *testing.T, l moat.Limits, logs io.Writer) moat.Sandbox {
		sb, err := moatcontainer.New(moatcontainer.Config{Limits: l, Driver: moatcontainer.DriverRunc, Recycle: true,
			Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		if err != nil {
			t.Fatalf("container.New with the runc driver, recycling: %v", err)
		}
		return sb
	})
	// Claim 4: every Sandbox is closed by now, whatever its runs did to
	// their containers; nothing of them is left on the host.
	if left := moatcontainer.RuncLeftovers(); len(left) > 0 {
		t.Fatalf("left on the host after every recycling Sandbox closed: %v", left)
	}
}

// TestReviewResetKeepsOthers: a reset clears the container's IPC objects
// from an OS thread that joined its IPC namespace and is then let die
// (ipcClear locks it and never unlocks it), while every runc container is
// started under util-linux's unshare with Pdeathsig SIGKILL (startWith),
// which the kernel sends when the OS thread that forked it exits, not the
// process. A reset whose goroutine lands on a thread that once started a
// container thus kills that container: the tenant's own recycled one, or
// another run's in progress, whoever's it is. So runs of other tenants and
// the recycled tenant's own must all end as they would with no reset going
// on: none fails the sandbox, every one prints what it should.
func TestReviewResetKeepsOthers(t *testing.T) {
	r := newReviewTenant(t, moat.Limits{})
	var wg sync.WaitGroup
	stop := make(chan struct{})
	errs := make(chan string, 100)
	// Other runs, no tenant: fresh containers, started from whatever OS
	// thread the engine's goroutines run on.
	for i := range 3 {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				res, err := r.sb.Run(context.Background(), moat.Request{Code: []byte("import time; time.sleep(1); print('ok')")})
				switch {
				case err != nil:
					errs <- "other run " + strconv.Itoa(i) + "/" + strconv.Itoa(n) + ": " + err.Error()
				case string(res.Stdout) != "ok\n" || res.ExitCode != 0:
					errs <- "other run " + strconv.Itoa(i) + "/" + strconv.Itoa(n) + ": exit " + strconv.Itoa(res.ExitCode) + " " + string(res.Reason) + " " + string(res.Stdout)
				}
			}
		})
	}
	recycled := 0
	for n := range 120 {
		res, err := r.run("print(6 * 7)")
		switch {
		case err != nil:
			errs <- "tenant run " + strconv.Itoa(n) + ": " + err.Error()
		case string(res.Stdout) != "42\n":
			errs <- "tenant run " + strconv.Itoa(n) + ": " + string(res.Stdout)
		case sandboxtest.Recycled(res):
			recycled++
		}
		// Let the reset run, and a new instance be made if it failed.
		for deadline := time.Now().Add(5 * time.Second); r.pr.PoolStats().Parked == 0 && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
	}
	close(stop)
	wg.Wait()
	close(errs)
	var bad []string
	for e := range errs {
		bad = append(bad, e)
	}
	for _, l := range strings.Split(r.logs.String(), "\n") {
		if strings.Contains(l, "server ended") || strings.Contains(l, "could not start") || strings.Contains(l, "reset failed") {
			bad = append(bad, "log: "+l)
		}
	}
	t.Logf("%d of 120 tenant runs recycled", recycled)
	if len(bad) > 0 {
		t.Fatalf("with resets going on, runs failed or containers died:\n%s", strings.Join(bad, "\n"))
	}
}
