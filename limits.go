package moat

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// Limits bound what one run may use. The operator sets them (config file,
// flags, this struct); the code never does. A zero field means the default
// in [DefaultLimits]; use [Limits.WithDefaults] to fill them in.
type Limits struct {
	// WallTime is the longest a run may take, start to end. When it passes,
	// the whole process tree is killed and the Reason is ReasonTimeout.
	// Zero means 10s.
	WallTime Duration `json:"wall_time,omitempty"`
	// CPUTime is the most CPU time the run's processes may use. Zero means
	// 10s.
	CPUTime Duration `json:"cpu_time,omitempty"`
	// Memory is the most memory the run may use, all its processes
	// together. Zero means 256MiB.
	Memory Bytes `json:"memory,omitempty"`
	// Pids is the most processes and threads the run may have at once.
	// Zero means 64.
	Pids int `json:"pids,omitempty"`
	// FileSize is the largest file the run may write. Zero means 16MiB.
	FileSize Bytes `json:"file_size,omitempty"`
	// Disk is the most the run may write in all its files together. Zero
	// means 64MiB.
	Disk Bytes `json:"disk,omitempty"`
	// Output is the most of each output stream (stdout, stderr) that moat
	// keeps and passes on: to the Result and to Request.Stdout and Stderr
	// alike, which see the same bytes. The cut is at a byte count, even
	// inside a multi-byte character. The first byte past it ends the run:
	// moat kills it as at the wall time, drops the rest of what was on its
	// way, and the Result is marked truncated, with ReasonOutput and exit
	// code 137 (SIGKILL), even if the code had exited by the time the kill
	// came. Zero means 1MiB.
	Output Bytes `json:"output,omitempty"`
	// OpenFiles is the most file descriptors each process may hold open.
	// Zero means 256.
	OpenFiles int `json:"open_files,omitempty"`
}

// DefaultLimits returns the limits that apply when nothing is set.
func DefaultLimits() Limits {
	return Limits{
		WallTime:  Duration(10 * time.Second),
		CPUTime:   Duration(10 * time.Second),
		Memory:    256 * MiB,
		Pids:      64,
		FileSize:  16 * MiB,
		Disk:      64 * MiB,
		Output:    1 * MiB,
		OpenFiles: 256,
	}
}

// WithDefaults returns l with every zero field set to its default.
func (l Limits) WithDefaults() Limits {
	d := DefaultLimits()
	if l.WallTime == 0 {
		l.WallTime = d.WallTime
	}
	if l.CPUTime == 0 {
		l.CPUTime = d.CPUTime
	}
	if l.Memory == 0 {
		l.Memory = d.Memory
	}
	if l.Pids == 0 {
		l.Pids = d.Pids
	}
	if l.FileSize == 0 {
		l.FileSize = d.FileSize
	}
	if l.Disk == 0 {
		l.Disk = d.Disk
	}
	if l.Output == 0 {
		l.Output = d.Output
	}
	if l.OpenFiles == 0 {
		l.OpenFiles = d.OpenFiles
	}
	return l
}

// Validate reports whether l can be applied. Zero fields are valid (they
// mean the default); negative ones, and values too small to start Python,
// are not. The error wraps [ErrInvalid].
func (l Limits) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf(format, args...))
	}
	if l.WallTime < 0 {
		bad("wall time %v is negative", l.WallTime)
	}
	if l.CPUTime < 0 {
		bad("cpu time %v is negative", l.CPUTime)
	}
	if l.CPUTime != 0 && time.Duration(l.CPUTime) < time.Second {
		bad("cpu time %v is under the 1s granularity of the CPU limit", l.CPUTime)
	}
	if l.Memory != 0 && l.Memory < 16*MiB {
		bad("memory %v is below the 16MiB Python needs to start", l.Memory)
	}
	if l.Pids < 0 {
		bad("pids %d is negative", l.Pids)
	}
	if l.FileSize < 0 {
		bad("file size %v is negative", l.FileSize)
	}
	if l.Disk < 0 {
		bad("disk %v is negative", l.Disk)
	}
	if l.Output < 0 {
		bad("output %v is negative", l.Output)
	}
	if l.OpenFiles < 0 {
		bad("open files %d is negative", l.OpenFiles)
	}
	if l.OpenFiles != 0 && l.OpenFiles < 16 {
		bad("open files %d is below the 16 Python needs to start", l.OpenFiles)
	}
	if len(errs) > 0 {
		return fmt.Errorf("moat: limits: %w", Invalid(errors.Join(errs...)))
	}
	return nil
}

// Bytes is a size in bytes. It parses and prints with binary units ("256MiB",
// "16MiB", "1GiB", "512KiB", or a plain number of bytes), as text and in
// JSON.
type Bytes int64

// Binary size units.
const (
	KiB Bytes = 1 << 10
	MiB Bytes = 1 << 20
	GiB Bytes = 1 << 30
)

var byteUnits = []struct {
	suffix string
	mult   Bytes
}{
	{"GiB", GiB}, {"MiB", MiB}, {"KiB", KiB},
	{"G", GiB}, {"M", MiB}, {"K", KiB},
	{"GB", 1000 * 1000 * 1000}, {"MB", 1000 * 1000}, {"KB", 1000}, {"kB", 1000},
	{"B", 1},
}

// ParseBytes parses a size such as "256MiB", "1G", "4096" or "64 MiB".
// Units, in this case: B, KiB/K, MiB/M, GiB/G (binary) and kB/KB, MB, GB
// (decimal). A whole number is exact; a fraction ("1.5GiB") is cut down to
// a whole byte. A negative size, and one past math.MaxInt64 bytes, is an
// error wrapping [ErrInvalid]. What [Bytes.String] prints of a size that is
// not negative parses back to it.
func ParseBytes(s string) (Bytes, error) {
	t := strings.TrimSpace(s)
	mult := Bytes(1)
	// Longest suffixes are listed first in each family; check two-letter
	// and three-letter suffixes before one-letter ones.
	best := ""
	for _, u := range byteUnits {
		if strings.HasSuffix(t, u.suffix) && len(u.suffix) > len(best) {
			best, mult = u.suffix, u.mult
		}
	}
	num := strings.TrimSpace(strings.TrimSuffix(t, best))
	if num == "" {
		return 0, fmt.Errorf("moat: size %q has no number: %w", s, ErrInvalid)
	}
	tooLarge := func() (Bytes, error) { return 0, fmt.Errorf("moat: size %q is too large: %w", s, ErrInvalid) }
	// A whole number is exact: a float64 would round one past 2^53, and
	// every size must read back from its String.
	i, err := strconv.ParseInt(num, 10, 64)
	switch {
	case err == nil && i >= 0:
		if i > math.MaxInt64/int64(mult) {
			return tooLarge()
		}
		return Bytes(i) * mult, nil
	case errors.Is(err, strconv.ErrRange) && !strings.HasPrefix(num, "-"):
		return tooLarge()
	}
	n, err := strconv.ParseFloat(num, 64)
	if err != nil || n < 0 || n != n {
		return 0, fmt.Errorf("moat: size %q does not parse (want e.g. 256MiB): %w", s, ErrInvalid)
	}
	v := n * float64(mult)
	if v >= 1<<63 { // not an int64; float64(math.MaxInt64) is 1<<63
		return tooLarge()
	}
	return Bytes(v), nil
}

// String prints b with the largest binary unit that divides it.
func (b Bytes) String() string {
	switch {
	case b != 0 && b%GiB == 0:
		return fmt.Sprintf("%dGiB", b/GiB)
	case b != 0 && b%MiB == 0:
		return fmt.Sprintf("%dMiB", b/MiB)
	case b != 0 && b%KiB == 0:
		return fmt.Sprintf("%dKiB", b/KiB)
	}
	return fmt.Sprintf("%dB", int64(b))
}

// Set parses s into b; with String it makes Bytes a flag.Value.
func (b *Bytes) Set(s string) error {
	v, err := ParseBytes(s)
	if err != nil {
		return err
	}
	*b = v
	return nil
}

// MarshalText prints b as String does.
func (b Bytes) MarshalText() ([]byte, error) { return []byte(b.String()), nil }

// UnmarshalJSON accepts a string such as "256MiB" or a number of bytes.
// A JSON null leaves b as it was, as encoding/json does for its own types.
func (b *Bytes) UnmarshalJSON(data []byte) error {
	if string(data) == "null" {
		return nil
	}
	var n int64
	if err := json.Unmarshal(data, &n); err == nil {
		if n < 0 {
			return fmt.Errorf("moat: size %d is negative: %w", n, ErrInvalid)
		}
		*b = Bytes(n)
		return nil
	}
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		return fmt.Errorf("moat: size must be a string like \"256MiB\" or a number of bytes: %w", ErrInvalid)
	}
	return b.Set(s)
}

// Duration is a time.Duration that reads and prints as "10s", "1m30s", as
// text and in JSON.
type Duration time.Duration

// String prints d as time.Duration does.
func (d Duration) String() string { return time.Duration(d).String() }

// Set parses s ("10s", "500ms", "2m") into d; with String it makes Duration a
// flag.Value.
func (d *Duration) Set(s string) error {
	v, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("moat: duration %q does not parse (want e.g. 10s): %w", s, ErrInvalid)
	}
	if v < 0 {
		return fmt.Errorf("moat: duration %q is negative: %w", s, ErrInvalid)
	}
	*d = Duration(v)
	return nil
}

// MarshalText prints d as String does.
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText parses d as Set does.
func (d *Duration) UnmarshalText(text []byte) error { return d.Set(string(text)) }

// UnmarshalText parses b as Set does, for config files read as text.
func (b *Bytes) UnmarshalText(text []byte) error { return b.Set(string(text)) }
