package sandboxtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// This file holds the checks of a sandbox's life: cancelling, running
// concurrently, closing.

// cancelWall is the wall time of the cancel checks: long enough that a
// prompt return can only be the cancellation's doing.
const cancelWall = 20 * time.Second

func testCancelBefore(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{WallTime: moat.Duration(cancelWall)})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res, elapsed, err := b.runGuarded(ctx, moat.Request{Code: []byte("import time; time.sleep(60)")})
	switch {
	case err != nil && !errors.Is(err, context.Canceled):
		t.Errorf("Run with a cancelled context returned %v, want an error wrapping context.Canceled (or a Result with reason canceled)", err)
	case err != nil && res != nil:
		t.Errorf("Run with a cancelled context returned both an error (%v) and a Result (%s)", err, describe(res))
	case err == nil && (res == nil || res.Reason != moat.ReasonCanceled):
		t.Errorf("Run with a cancelled context: got %s\nwant reason canceled (or an error wrapping context.Canceled)", describe(res))
	case err == nil:
		for _, p := range b.problems(res, elapsed) {
			t.Error(p)
		}
	}
	if elapsed > cancelWall/4 {
		t.Errorf("Run with a cancelled context took %v, want well under the %v wall time", elapsed, cancelWall)
	}
}

func testCancelAfterDelay(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{WallTime: moat.Duration(cancelWall)})
	marker := token("moatcancel")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	timer := time.AfterFunc(300*time.Millisecond, cancel)
	defer timer.Stop()
	res, elapsed, err := b.runGuarded(ctx, moat.Request{Code: []byte("import os, sys\n" + sleeperPy(marker, "sleeping"))})
	// Whether the code had started when the context was cancelled depends on
	// the level's start-up time: accept either answer the contract allows.
	switch {
	case err != nil && (!errors.Is(err, context.Canceled) || res != nil):
		t.Errorf("Run cancelled after 300ms returned %s, %v; want a Result with reason canceled, or a nil Result and an error wrapping context.Canceled", describe(res), err)
	case err == nil && (res == nil || res.Reason != moat.ReasonCanceled):
		t.Errorf("Run cancelled after 300ms: got %s\nwant reason canceled (or an error wrapping context.Canceled)", describe(res))
	case err == nil:
		for _, p := range b.problems(res, elapsed) {
			t.Error(p)
		}
	}
	if elapsed > cancelWall/4 {
		t.Errorf("Run cancelled after 300ms returned after %v, want well under the %v wall time", elapsed, cancelWall)
	}
	if left := remainingWith(marker, settle); len(left) > 0 {
		t.Errorf("processes of the cancelled run outlived it by %v (killed now):\n\t%s", settle, strings.Join(left, "\n\t"))
	}
}

func testCancelWhileRunning(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{WallTime: moat.Duration(cancelWall)})
	marker := token("moatcancel")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Cancel once the sleeping program has said it runs: the code has
	// started, so the contract wants a Result with reason canceled.
	var cancelled time.Time
	var mu sync.Mutex
	out := &stream{on: map[string]func(){"sleeping": func() {
		mu.Lock()
		cancelled = time.Now()
		mu.Unlock()
		cancel()
	}}}
	res := b.runReq(t, ctx, moat.Request{Stdout: out, Code: []byte("import os, sys\n" + sleeperPy(marker, "sleeping"))})
	returned := time.Now()
	mu.Lock()
	at := cancelled
	mu.Unlock()
	if at.IsZero() {
		t.Fatalf("the Request.Stdout writer never received \"sleeping\" (flushed by the code), so the suite never cancelled the run: %s", describe(res))
	}
	if res.Reason != moat.ReasonCanceled || !strings.Contains(string(res.Stdout), "sleeping") {
		t.Errorf("a run cancelled while its code sleeps: got %s\nwant reason canceled and the output so far (\"sleeping\")", describe(res))
	}
	if d := returned.Sub(at); d > cancelWall/4 {
		t.Errorf("Run returned %v after its context was cancelled, want well under the %v wall time", d, cancelWall)
	}
	if left := remainingWith(marker, settle); len(left) > 0 {
		t.Errorf("processes of the cancelled run outlived it by %v (killed now):\n\t%s", settle, strings.Join(left, "\n\t"))
	}
}

func testConcurrency(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)})
	n := s.opts.Parallel
	// Each run writes its index to a file of the same name, waits for the
	// others to do the same, and reads it back: runs that shared a working
	// directory would read each other's.
	var wg sync.WaitGroup
	start := make(chan struct{})
	problems := make([][]string, n)
	for i := range n {
		wg.Go(func() {
			<-start
			res, elapsed, err := b.runGuarded(context.Background(), moat.Request{Code: []byte(fmt.Sprintf(
				"import time\nopen('owner', 'w').write('run-%d')\ntime.sleep(0.3)\nprint(open('owner').read())", i))})
			if err != nil {
				problems[i] = []string{fmt.Sprintf("Run: %v", err)}
				return
			}
			problems[i] = b.problems(res, elapsed)
			if want := fmt.Sprintf("run-%d\n", i); res != nil && (string(res.Stdout) != want || res.ExitCode != 0 || res.Reason != "") {
				problems[i] = append(problems[i], fmt.Sprintf("got %s\nwant stdout %q, exit 0, no reason", describe(res), want))
			}
		})
	}
	close(start)
	wg.Wait()
	for i, ps := range problems {
		for _, p := range ps {
			t.Errorf("run %d of %d at once: %s", i, n, p)
		}
	}
}

func testRunAfterClose(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	if err := b.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	res, err := b.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
	if !errors.Is(err, moat.ErrClosed) || res != nil {
		t.Errorf("Run after Close = %s, %v; want a nil Result and an error wrapping moat.ErrClosed", describe(res), err)
	}
}

func testCloseTwice(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	b.run(t, "print(1)")
	if err := b.Close(); err != nil {
		t.Fatalf("the first Close: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("the second Close = %v, want nil", err)
	}
	// The suite's cleanup closes it a third time, and checks that too.
}

func testCloseWaits(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{WallTime: moat.Duration(10 * time.Second)})
	started := make(chan struct{})
	out := &stream{on: map[string]func(){"started": func() { close(started) }}}
	type outcome struct {
		res *moat.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, _, err := b.runGuarded(context.Background(), moat.Request{Stdout: out, Code: []byte(
			"import time\nprint('started', flush=True)\ntime.sleep(1)\nprint('fin' + 'ished')")})
		done <- outcome{res, err}
	}()
	select {
	case <-started:
	case o := <-done:
		t.Fatalf("the run ended before its Request.Stdout writer received \"started\" (flushed by the code): %s, %v", describe(o.res), o.err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("Close with a run in progress: %v", err)
	}
	// The writer has every byte of a run before Run returns; if Close
	// waited for the run, the code's last line is there already. (Run's
	// own return reaches this goroutine through others, a moment later.)
	if !strings.Contains(string(out.bytes()), "finished") {
		t.Error("Close returned before the run in progress finished: its last line had not been written")
	}
	o := <-done
	if o.err != nil || o.res == nil || o.res.Reason != "" || !strings.Contains(string(o.res.Stdout), "finished") {
		t.Errorf("a run in progress when Close was called: got %s, %v\nwant it to finish normally (\"finished\", no reason)", describe(o.res), o.err)
	}
}
