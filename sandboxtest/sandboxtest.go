package sandboxtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// Factory returns a new sandbox with the given limits. The suite has already
// applied [moat.Limits.WithDefaults], so every field is set. The suite closes
// the sandbox when the subtest that asked for it ends. A factory that cannot
// build the sandbox calls t.Fatal.
type Factory func(t *testing.T, limits moat.Limits) moat.Sandbox

// Options tune the suite for one level. The zero value runs every check with
// the defaults.
type Options struct {
	// Leftovers, when set, returns the host-side things of the level that
	// are still present: container ids, VM pids, directories. The suite calls
	// it after each subtest, once every sandbox of that subtest is closed,
	// and fails if it returns anything. Nil means only the generic checks
	// (processes carrying a run's marker, children of the test process,
	// files named by a run's marker, goroutines).
	Leftovers func() []string

	// Parallel is how many runs the concurrency test starts at once. Zero
	// means 20.
	Parallel int

	// Dirs lists host directories, besides the usual temporary and state
	// directories (os.TempDir, /var/tmp, /dev/shm, /run/moat,
	// /var/lib/moat, the user's cache and state dirs), where the level keeps
	// the files of runs. The suite searches them, a few levels deep, for
	// files a run created and that should be gone. Nil means the usual
	// directories only.
	Dirs []string
}

// Run runs the conformance suite against the sandboxes newSandbox builds.
// Each check is a subtest with a stable name (Streams/Stdout, Limits/Memory,
// Cancel/WhileRunning, ...), so one can be run alone with -run.
//
// Run must not be called from a parallel test: it sets environment variables
// with t.Setenv and watches the test process's children and goroutines.
func Run(t *testing.T, newSandbox Factory, opts Options) {
	t.Helper()
	if opts.Parallel == 0 {
		opts.Parallel = 20
	}
	s := &suite{newSandbox: newSandbox, opts: opts}
	s.goroutinesBefore = goroutineIDs()
	kids, err := childrenOf(procRoot, os.Getpid())
	if err != nil {
		t.Fatalf("sandboxtest: list the test process's children: %v", err)
	}
	s.childrenBefore = make(map[int]bool)
	for _, p := range kids {
		s.childrenBefore[p.PID] = true
	}

	for _, c := range cases {
		s.leaf(t, c.name, c.fn)
	}
	t.Run("NoLeaks", s.noLeaks)
}

// A testCase is one leaf subtest of the suite.
type testCase struct {
	name string
	fn   func(t *testing.T, s *suite)
}

// cases lists the leaf subtests in the order they run. Names are paths: the
// part before the slash groups related checks.
var cases = []testCase{
	{"Streams/Stdout", testStdout},
	{"Streams/Stderr", testStderr},
	{"ExitCode/SystemExit", testExitSystemExit},
	{"ExitCode/Exception", testExitException},
	{"ExitCode/Zero", testExitZero},
	{"Result/LevelAndDuration", testLevelAndDuration},
	{"Request/EmptyCode", testEmptyCode},
	{"Request/NULBytes", testNULBytes},
	{"Request/InvalidUTF8", testInvalidUTF8},
	{"Request/BinaryOutput", testBinaryOutput},
	{"Environment/Variables", testEnvVariables},
	{"Environment/OtherProcesses", testEnvOtherProcesses},
	{"Environment/Stdin", testStdin},
	{"WorkDir/Writable", testWorkDirWritable},
	{"WorkDir/FreshPerRun", testWorkDirFresh},
	{"WorkDir/NoTraceOnHost", testWorkDirNoTrace},
	{"Limits/WallTime", testWallTime},
	{"Limits/CPUTime", testCPUTime},
	{"Limits/CPUTimeAcrossProcesses", testCPUTimeTree},
	{"Limits/Memory", testMemory},
	{"Limits/MemoryAcrossProcesses", testMemoryTree},
	{"Limits/Pids", testPids},
	{"Limits/FileSize", testFileSize},
	{"Limits/Disk", testDisk},
	{"Limits/Output", testOutput},
	{"Limits/OutputForever", testOutputForever},
	{"Limits/OpenFiles", testOpenFiles},
	{"Signal", testSignal},
	{"Signal/XCPUForged", testSignalXCPUForged},
	{"Cancel/Before", testCancelBefore},
	{"Cancel/AfterDelay", testCancelAfterDelay},
	{"Cancel/WhileRunning", testCancelWhileRunning},
	{"Concurrency", testConcurrency},
	{"Close/RunAfterClose", testRunAfterClose},
	{"Close/Twice", testCloseTwice},
	{"Close/WaitsForRuns", testCloseWaits},
}

// procRoot is where the suite reads the host's processes.
const procRoot = "/proc"

// settle is how long the suite waits for things that end asynchronously (a
// killed process to be reaped, a goroutine to return) before it calls them
// leaked.
const settle = 3 * time.Second

// suite is the state shared by the subtests of one Run.
type suite struct {
	newSandbox Factory
	opts       Options

	goroutinesBefore map[int64]bool // goroutines alive when Run began
	childrenBefore   map[int]bool   // children of the test process when Run began
}

// leaf runs fn as the subtest name, then checks that nothing the subtest
// made outlived it.
func (s *suite) leaf(t *testing.T, name string, fn func(*testing.T, *suite)) {
	t.Helper()
	t.Run(name, func(t *testing.T) {
		// Registered first, so it runs last: after the sandboxes close.
		t.Cleanup(func() { s.checkNothingLeft(t) })
		fn(t, s)
	})
}

// checkNothingLeft fails t if the level reports leftovers or the test process
// has children it did not have when the suite began.
func (s *suite) checkNothingLeft(t *testing.T) {
	t.Helper()
	if s.opts.Leftovers != nil {
		left := eventually(settle, s.opts.Leftovers)
		if len(left) > 0 {
			t.Errorf("the level reports leftovers after every sandbox closed:\n\t%s", strings.Join(left, "\n\t"))
		}
	}
	stray := eventually(settle, func() []string {
		kids, err := childrenOf(procRoot, os.Getpid())
		if err != nil {
			return []string{err.Error()}
		}
		var stray []string
		for _, p := range kids {
			if !s.childrenBefore[p.PID] {
				stray = append(stray, p.String())
			}
		}
		return stray
	})
	if len(stray) > 0 {
		t.Errorf("the test process has children left after every sandbox closed (state Z means nobody waited for it):\n\t%s", strings.Join(stray, "\n\t"))
	}
}

// noLeaks checks, once every subtest is done, that the level left no
// goroutine behind.
func (s *suite) noLeaks(t *testing.T) {
	s.checkNothingLeft(t)
	var leaked []goroutine
	deadline := time.Now().Add(settle)
	for {
		leaked = leakedGoroutines(s.goroutinesBefore, allGoroutines())
		if len(leaked) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if len(leaked) > 0 {
		var b strings.Builder
		for _, g := range leaked {
			fmt.Fprintf(&b, "\n%s\n", g.Stack)
		}
		t.Errorf("%d goroutines started during the suite are still running %v after every sandbox closed:%s", len(leaked), settle, b.String())
	}
}

// eventually calls f until it returns nothing or d has passed, and returns
// its last answer.
func eventually(d time.Duration, f func() []string) []string {
	deadline := time.Now().Add(d)
	for {
		got := f()
		if len(got) == 0 || time.Now().After(deadline) {
			return got
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// box is a sandbox under test with the limits it was built with.
type box struct {
	moat.Sandbox
	limits moat.Limits
}

// sandbox builds a sandbox with limits (zero fields mean defaults) and closes
// it when t ends; the close must succeed, and may be the second one.
func (s *suite) sandbox(t *testing.T, limits moat.Limits) *box {
	t.Helper()
	limits = limits.WithDefaults()
	if err := limits.Validate(); err != nil {
		t.Fatalf("sandboxtest: bad limits in the suite: %v", err)
	}
	sb := s.newSandbox(t, limits)
	if sb == nil {
		t.Fatal("the factory returned a nil sandbox")
	}
	t.Cleanup(func() {
		done := make(chan error, 1)
		go func() { done <- sb.Close() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Close: %v", err)
			}
		case <-time.After(hangGuard(limits) + abandon):
			t.Errorf("Close did not return within %v; abandoned", hangGuard(limits)+abandon)
		}
	})
	return &box{Sandbox: sb, limits: limits}
}

// hangGuard is how long the suite lets one Run take, past the wall time,
// before it calls the run hung and cancels it.
func hangGuard(l moat.Limits) time.Duration {
	return 3*time.Duration(l.WallTime) + 30*time.Second
}

// run runs code with no writers and a background context, checks the
// invariants every Result must meet, and fails t now if Run returned an
// error.
func (b *box) run(t *testing.T, code string) *moat.Result {
	t.Helper()
	return b.runReq(t, context.Background(), moat.Request{Code: []byte(code)})
}

// runReq is run with a request and a context of the caller's.
func (b *box) runReq(t *testing.T, ctx context.Context, req moat.Request) *moat.Result {
	t.Helper()
	res, elapsed, err := b.runGuarded(ctx, req)
	if err != nil {
		t.Fatalf("Run returned an error, want a Result: %v", err)
	}
	for _, p := range b.problems(res, elapsed) {
		t.Error(p)
	}
	if res == nil {
		t.FailNow()
	}
	return res
}

// runGuarded calls Run under a hang guard and says how long it took. If the
// guard had to cancel the run, it says so in the error; if Run ignores even
// that, runGuarded abandons it (its goroutine leaks, which NoLeaks reports)
// so that the suite fails instead of hanging.
func (b *box) runGuarded(ctx context.Context, req moat.Request) (*moat.Result, time.Duration, error) {
	return runGuarded(ctx, b.limits, b.Run, req)
}

// runGuarded is box.runGuarded for any Run: a sandbox's or a session's.
func runGuarded(ctx context.Context, limits moat.Limits, run func(context.Context, moat.Request) (*moat.Result, error), req moat.Request) (*moat.Result, time.Duration, error) {
	guard := hangGuard(limits)
	ctx, cancel := context.WithTimeoutCause(ctx, guard, errHung)
	defer cancel()
	type outcome struct {
		res *moat.Result
		err error
	}
	done := make(chan outcome, 1)
	start := time.Now()
	go func() {
		res, err := run(ctx, req)
		done <- outcome{res, err}
	}()
	var o outcome
	select {
	case o = <-done:
	case <-time.After(guard + abandon):
		return nil, time.Since(start), fmt.Errorf("run still going %v after the suite cancelled it for exceeding %v with a wall time of %v; abandoned: %w",
			abandon, guard, limits.WallTime, errHung)
	}
	elapsed := time.Since(start)
	if context.Cause(ctx) == errHung {
		return o.res, elapsed, fmt.Errorf("run still going after %v with a wall time of %v, cancelled by the suite (result %s): %w", guard, limits.WallTime, describe(o.res), errHung)
	}
	return o.res, elapsed, o.err
}

// abandon is how long the suite waits for Run or Close to return after it
// has given up on them, before it fails the test and moves on.
const abandon = 10 * time.Second

var errHung = fmt.Errorf("sandboxtest: run hung")

// problems lists what is wrong with a Result whatever the code did: it must
// name the sandbox's level, have a duration within what the caller measured,
// keep no more output than the limit and give a known reason.
func (b *box) problems(res *moat.Result, elapsed time.Duration) []string {
	if res == nil {
		return []string{"Run returned a nil Result and no error"}
	}
	var ps []string
	if res.Level != b.Level() {
		ps = append(ps, fmt.Sprintf("Result.Level = %q, want the sandbox's level %q", res.Level, b.Level()))
	}
	if res.Duration <= 0 {
		ps = append(ps, fmt.Sprintf("Result.Duration = %v, want > 0", res.Duration))
	}
	if res.Duration > elapsed {
		ps = append(ps, fmt.Sprintf("Result.Duration = %v, longer than the %v the caller waited for Run", res.Duration, elapsed))
	}
	for _, s := range []struct {
		name string
		out  []byte
	}{{"Stdout", res.Stdout}, {"Stderr", res.Stderr}} {
		if moat.Bytes(len(s.out)) > b.limits.Output {
			ps = append(ps, fmt.Sprintf("len(Result.%s) = %d, over the output limit %d", s.name, len(s.out), int64(b.limits.Output)))
		}
	}
	if !slices.Contains(reasons, res.Reason) {
		ps = append(ps, fmt.Sprintf("Result.Reason = %q, not one moat defines", res.Reason))
	}
	if res.Reason == moat.ReasonOutput && !res.Truncated {
		ps = append(ps, "Result.Reason is output but Truncated is false")
	}
	return ps
}

var reasons = []moat.Reason{
	moat.ReasonNone, moat.ReasonTimeout, moat.ReasonMemory, moat.ReasonPids,
	moat.ReasonFileSize, moat.ReasonDisk, moat.ReasonOutput, moat.ReasonSignal,
	moat.ReasonCanceled,
}

// describe prints a Result for a failure message, its output shortened.
func describe(res *moat.Result) string {
	if res == nil {
		return "<nil>"
	}
	return fmt.Sprintf("exit=%d reason=%q signal=%q truncated=%v duration=%v\n\tstdout: %s\n\tstderr: %s",
		res.ExitCode, res.Reason, res.Signal, res.Truncated, res.Duration, shorten(res.Stdout), shorten(res.Stderr))
}

// shorten quotes b, keeping its start and end when it is long.
func shorten(b []byte) string {
	const keep = 1500
	if len(b) <= 2*keep {
		return fmt.Sprintf("%q", b)
	}
	return fmt.Sprintf("%q ...(%d bytes)... %q", b[:keep], len(b)-2*keep, b[len(b)-keep:])
}

// token returns a random string of letters and digits, unique to this call,
// to name files and mark processes so that the suite finds them on the host.
func token(prefix string) string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return prefix + hex.EncodeToString(b[:])
}

// split returns a Python expression that evaluates to s without s appearing
// in the source, so that a traceback echoing the source cannot fake the
// marker in the output.
func split(s string) string {
	h := len(s) / 2
	return fmt.Sprintf("%q + %q", s[:h], s[h:])
}

// stream is a Request.Stdout or Request.Stderr writer. It keeps every byte,
// counts concurrent writes (which the Request contract forbids) and, for
// each key of on, runs the function once, from the writing goroutine, when
// the bytes first contain the key.
type stream struct {
	on map[string]func()

	mu       sync.Mutex
	buf      bytes.Buffer
	busy     atomic.Bool
	overlaps atomic.Int64
}

func (w *stream) Write(p []byte) (int, error) {
	if !w.busy.CompareAndSwap(false, true) {
		w.overlaps.Add(1)
	}
	defer w.busy.Store(false)
	w.mu.Lock()
	w.buf.Write(p)
	var fire []func()
	for key, f := range w.on {
		if bytes.Contains(w.buf.Bytes(), []byte(key)) {
			fire = append(fire, f)
			delete(w.on, key)
		}
	}
	w.mu.Unlock()
	for _, f := range fire {
		f()
	}
	return len(p), nil
}

// bytes returns a copy of what was written.
func (w *stream) bytes() []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return bytes.Clone(w.buf.Bytes())
}

// lastLine returns the last non-empty line of b, trimmed.
func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}
