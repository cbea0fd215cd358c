package moat

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Level names an isolation level. Levels are interchangeable behind
// [Sandbox]: an operator swaps one for another without touching the agent.
type Level string

// The isolation levels, from the lightest to the strongest.
const (
	// LevelSubprocess runs each piece of code in a child process with
	// rlimits, cgroups, a dedicated uid, Landlock and seccomp. It shares the
	// host kernel.
	LevelSubprocess Level = "subprocess"
	// LevelContainer runs each piece of code in a hardened Docker container.
	LevelContainer Level = "container"
	// LevelGVisor runs each piece of code under gVisor's user-space kernel.
	LevelGVisor Level = "gvisor"
	// LevelMicroVM runs each piece of code in a virtual machine with its own
	// kernel.
	LevelMicroVM Level = "microvm"
)

// Levels lists every level moat knows, lightest first.
var Levels = []Level{LevelSubprocess, LevelContainer, LevelGVisor, LevelMicroVM}

// ParseLevel returns the level named s, or an error wrapping [ErrInvalid].
func ParseLevel(s string) (Level, error) {
	for _, l := range Levels {
		if string(l) == s {
			return l, nil
		}
	}
	return "", fmt.Errorf("moat: unknown level %q (known: subprocess, container, gvisor, microvm): %w", s, ErrInvalid)
}

// Request is one piece of code to run.
type Request struct {
	// Code is the Python source to run. It must not be empty. It may hold
	// any bytes; code that is not valid Python is the code's failure, reported
	// in the Result.
	Code []byte

	// Stdout and Stderr, when not nil, receive what the code writes to the
	// stream, as it is written, up to the output cap ([Limits.Output]):
	// exactly the bytes the Result keeps, nothing past the cap. The first
	// byte past it ends the run (see [ReasonOutput]). A slow writer slows the
	// run down; it does not make the sandbox buffer without bound. Writes
	// happen from a goroutine of the sandbox, never concurrently for one
	// stream.
	Stdout io.Writer
	Stderr io.Writer

	// Tenant names whom the run is for (moat serve gives each API token's
	// name); the operator's code sets it, never the code nor the model
	// that wrote it. It changes nothing unless the level recycles
	// instances (its "recycle" setting, off by default): then consecutive
	// runs of one non-empty Tenant may reuse an instance an earlier run of
	// the same Tenant used, reset between them (see the level's docs), and
	// the Result's notes say so. Runs of different tenants, and runs
	// without one, never share an instance.
	Tenant string
}

// Sandbox runs untrusted code at one isolation level.
//
// Run is safe for concurrent use: every call gets a fresh, private
// environment (processes, files, working directory) and nothing of one run is
// visible to another. Cancelling ctx kills the run and everything it started;
// Run then returns the Result so far with Reason [ReasonCanceled] when the
// code had started, or ctx's error when it had not. When Run returns, nothing
// of the run is left: no process, file, container or VM.
//
// Run returns an error only when the sandbox itself failed or refused to run
// (errors.Is(err, ErrUnavailable) when a promised protection cannot be
// applied, ErrInvalid for a bad request, ErrClosed after Close). The code's
// own failures — a non-zero exit, a crash, a limit hit — are Results.
//
// Close releases what the sandbox holds and makes later Runs fail with
// ErrClosed. It waits for runs in progress to finish. It may be called more
// than once; calls after the first return nil.
type Sandbox interface {
	Run(ctx context.Context, req Request) (*Result, error)
	Level() Level
	Close() error
}

// PoolStats says how a sandbox's pool of instances prepared ahead of runs
// (a helper with python3 started, a container, a gVisor sandbox, a VM
// restored) has served them.
type PoolStats struct {
	// Size is how many instances the pool keeps prepared now; zero means
	// the sandbox keeps none. It grows under a burst of runs that found
	// none ready, up to Max, and shrinks back when they stop.
	Size int `json:"size"`
	Max  int `json:"max"`
	// Ready is how many are prepared now.
	Ready int `json:"ready"`
	// Hits counts the runs that took a prepared instance, and Misses those
	// that found none and prepared their own on their path.
	Hits   int64 `json:"hits"`
	Misses int64 `json:"misses"`
	// Recycled counts the runs served by an instance an earlier run of
	// the same tenant used (the level's recycle setting), and Parked is
	// how many such instances wait, reset, for their tenant's next run.
	Recycled int64 `json:"recycled,omitempty"`
	Parked   int   `json:"parked,omitempty"`
}

// PoolReporter is implemented by sandboxes that keep a pool of prepared
// instances. PoolStats is safe for concurrent use.
type PoolReporter interface {
	PoolStats() PoolStats
}

// Availability says whether a level can run on this machine, and if not, why
// and what to do about it. It is what `moat doctor` prints.
type Availability struct {
	Level     Level    `json:"level"`
	Available bool     `json:"available"`
	Reason    string   `json:"reason,omitempty"`  // why not, or a caveat when available
	Remedy    string   `json:"remedy,omitempty"`  // what the operator can do
	Details   []string `json:"details,omitempty"` // facts checked, one per line
}

// Unavailable returns the Availability of level l when checking it failed
// with err: the reason and remedy of an *UnavailableError, or err's text.
func Unavailable(l Level, err error) Availability {
	a := Availability{Level: l, Reason: err.Error()}
	var ue *UnavailableError
	if errors.As(err, &ue) {
		a.Reason, a.Remedy = ue.Reason, ue.Remedy
		if ue.Err != nil {
			a.Reason += ": " + ue.Err.Error()
		}
	}
	return a
}

// Describer is implemented by sandboxes that can say in one line how they
// are set up — the runtime's version, the accelerator a VM uses, what is
// kept ready ahead of runs — for `moat bench` to print beside their
// figures, without knowing the level's type.
type Describer interface {
	Describe() string
}
