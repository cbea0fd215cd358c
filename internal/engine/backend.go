// Package engine is moat's one run engine. It implements [moat.Sandbox] and
// [moat.Sessioner] once, over a small [Backend] that each isolation level
// provides: the level prepares instances and starts code in them; the engine
// owns the run's life around that — the checks of the request, the closed
// flag and the wait for runs in progress on Close, the pool of instances
// prepared ahead of runs, the output capture and its cap, the kill at the
// wall time and on cancellation, the one verdict that turns what the level
// saw into exit code, signal and reason, and the clean-up.
//
// A level is a Backend plus its configuration. The levels share one test
// suite (package sandboxtest), as containerd's snapshotters and gVisor's
// platforms do.
package engine

import (
	"context"
	"errors"
	"io"

	"github.com/moatsandbox/moat"
)

// Backend is one isolation level under the engine.
//
// Prepare makes an instance ready to run code, with everything that can be
// done before the code is known: a helper process waiting for its spec, a
// created container, a booted gVisor sandbox, a VM restored from its
// template. The engine calls it off the run's path to keep [Config.Warm]
// instances ready, and on the run's path when none is. It is called from
// several goroutines at once. An error means the level cannot run here now;
// it should wrap moat.ErrUnavailable when a promised protection cannot be
// applied.
//
// Close releases what the backend holds once the engine has discarded every
// instance and no run is in progress. Sessions outlive it (a sandbox's
// Close does not close its sessions): what a SessionInstance needs must
// stay until that session's own Close.
type Backend interface {
	Prepare(ctx context.Context) (Instance, error)
	Close() error
}

// Instance is one prepared environment. It serves at most one Start.
//
// Start starts code in the instance and returns as soon as the code runs,
// without waiting for it. What the code writes to its standard output and
// error goes to stdout and stderr, from goroutines of the backend, never
// concurrently for one stream; the writers may call Process.Kill (the output
// cap does). ctx bounds the start only: once Start has returned, the engine
// ends the run through the Process. An error means nothing of the code ran;
// one wrapping [ErrStale] says the instance went bad while it waited in the
// pool, and the engine retries once on a fresh one.
//
// Discard kills whatever of the instance still runs and removes everything
// of it: processes, files, cgroups, containers, VMs. The engine calls it
// once, after the run has ended or when the instance is not needed; it must
// not fail the run: what it cannot remove, the level's reaper removes later.
type Instance interface {
	Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error)
	Discard()
}

// Process is code running in an instance.
//
// Kill kills every process of the run, at once and without waiting for them
// to end. It is safe to call from any goroutine, more than once, and after
// the run has ended.
//
// Wait waits for the run to end — its every process gone and all its output
// written to the writers Start got — and returns the evidence of how it
// ended, all of it from outside the code: the host kernel's wait status, the
// host cgroup's counters, the records of a component the code cannot write
// to. The backend fills the fields of [Evidence] it can see; the engine adds
// its own (its kills, the output cap) before the verdict. An error means the
// sandbox itself failed and no verdict can be given (a helper that ended
// without a report, a sentry that crashed); the engine returns it as an error
// wrapping moat.ErrUnavailable. Once the engine has killed the run, it takes
// an error of no class as the consequence of its kill (a helper or VM killed
// before it could report) and gives the run its verdict; a failure that the
// kill does not explain (a kill that did not take, a crash, a report that
// disagrees) must wrap moat.ErrUnavailable, and stays an error. Wait is
// called once.
type Process interface {
	Kill()
	Wait() (Evidence, error)
}

// Ender is an optional interface of a Process. When the engine ends a run
// itself it calls End instead of Kill, with why: moat.ReasonTimeout (the
// wall time), moat.ReasonCanceled or moat.ReasonOutput, the first of them
// when several come. End must do what Kill does, and may be called as Kill
// may: from any goroutine (the output cap calls it from a backend's own
// writer goroutine), more than once, after the run has ended. It lets a
// backend say in Evidence.Notes why something that outlives a run (a
// session's live interpreter) ended with it, which only the engine knows
// before Wait returns.
type Ender interface {
	Process
	End(why moat.Reason)
}

// ErrStale says a pooled instance can no longer serve a run; see Instance.
var ErrStale = errors.New("engine: instance went stale")

// SessionBackend is implemented by backends whose level keeps sessions.
//
// NewSession makes one long-lived instance: its working directory (and, with
// opts.Interpreter, a live interpreter) lasts until Close. ctx bounds the
// creation only.
type SessionBackend interface {
	NewSession(ctx context.Context, opts moat.SessionOptions) (SessionInstance, error)
}

// SessionInstance is one session's instance at its level.
//
// Start starts one run of the session, as [Instance.Start] does, and may be
// called again once the previous run's Process.Wait has returned; the engine
// never starts two runs of one session at once. Between runs nothing of the
// session runs: the backend freezes what the code left behind (a cgroup
// freezer, a paused VM) when the run's Wait returns and thaws it at the next
// Start. The evidence of a run in a session may carry Notes (the interpreter
// ended, or was restarted) and Spent (the session's budget is used up).
//
// The file operations take names the engine has already checked with
// [CleanName]: relative, slash-separated, without "." or ".." elements. They
// act inside the instance (in the container, the gVisor sandbox, the guest)
// or through a handle that cannot leave the working directory, and never
// follow a symbolic link the code planted. They may run while a run is in
// progress; a file the code is still writing is read as it was at some
// moment, never torn past its size at that moment. Errors wrap
// fs.ErrNotExist for a missing file, moat.ErrInvalid for a name that is not
// a file of the session (a directory where a file was asked, a link out) or
// a write past the disk or file size limit. Each must return soon once its
// ctx is done; so must a Read of the reader ReadFile returned, which lives
// under ReadFile's ctx until it is closed.
//
// Close kills everything of the session and removes it. The engine calls it
// once, when nothing else of the instance is in use: it first ends the run
// in progress (through its Process), the file operations in progress (their
// ctx) and the readers still open (their ctx, then their Close), and waits
// for them; after Close it calls nothing of the instance.
type SessionInstance interface {
	Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error)
	moat.Files
	Close() error
}
