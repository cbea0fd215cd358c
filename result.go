package moat

import (
	"encoding/json"
	"strings"
	"time"
)

// Reason says why a run ended abnormally. It is empty when the code simply
// exited, whatever its exit code.
type Reason string

// The reasons for an abnormal end. When several apply, a sandbox reports the
// first in this order. The output cap has no slack: the first byte past
// [Limits.Output] on either stream kills the run, by the kill the wall time
// uses, and the run reports output (exit 137, SIGKILL), never signal, unless
// a reason before it in this order applies too.
const (
	ReasonNone     Reason = ""
	ReasonCanceled Reason = "canceled" // the caller cancelled the run (or closed its session)
	ReasonTimeout  Reason = "timeout"  // the wall time or the CPU time ran out
	ReasonMemory   Reason = "memory"   // the memory limit was hit
	ReasonPids     Reason = "pids"     // the process/thread limit refused a fork or a thread
	ReasonFileSize Reason = "filesize" // a file reached the file size limit
	ReasonDisk     Reason = "disk"     // the writable space ran out
	ReasonOutput   Reason = "output"   // an output stream passed its cap: cut there, and the run killed
	ReasonSignal   Reason = "signal"   // the code was killed by a signal it did not get from moat
)

// Result is what a run produced. The code's failures are Results, not
// errors.
type Result struct {
	Level Level `json:"level"`
	// Stdout and Stderr hold what the code wrote, each cut at the output
	// limit: the same bytes Request.Stdout and Stderr received. They are raw
	// bytes, not necessarily UTF-8, and a cut may fall inside a character.
	Stdout []byte `json:"-"`
	Stderr []byte `json:"-"`
	// ExitCode is the code's exit status; 128+N when it was killed by
	// signal N, as a shell reports it. A run ended for its output
	// (ReasonOutput) reports 137 and SIGKILL at every level.
	ExitCode int `json:"exit_code"`
	// Duration is the wall time from the start of the run to its end,
	// set-up and clean-up included.
	Duration time.Duration `json:"-"`
	// Reason is why the run ended abnormally, or empty.
	Reason Reason `json:"reason"`
	// Truncated is true when stdout or stderr was cut at the output limit;
	// such a run was killed there (see [Limits.Output]).
	Truncated bool `json:"truncated"`
	// Signal names the signal that ended the code, e.g. "SIGKILL", if one
	// did.
	Signal string `json:"signal,omitempty"`
	// Notes are facts about how the run was isolated that a reader should
	// know: a protection that did not apply because the operator chose a
	// weaker profile, or that moat was not root; the accelerator a VM used.
	Notes []string `json:"notes,omitempty"`
}

// MarshalJSON prints the Result as `moat run --json` does: stdout and stderr
// as strings (each run of bytes that are not UTF-8 becomes one U+FFFD) and
// duration_ms, in milliseconds.
func (r Result) MarshalJSON() ([]byte, error) {
	type plain Result
	return json.Marshal(struct {
		plain
		Stdout     string  `json:"stdout"`
		Stderr     string  `json:"stderr"`
		DurationMS float64 `json:"duration_ms"`
	}{
		plain:      plain(r),
		Stdout:     strings.ToValidUTF8(string(r.Stdout), "\uFFFD"),
		Stderr:     strings.ToValidUTF8(string(r.Stderr), "\uFFFD"),
		DurationMS: float64(r.Duration.Microseconds()) / 1000,
	})
}
