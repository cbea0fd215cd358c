package moat_test

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/moatsandbox/moat"
)

// ParseBytes never panics, fails only with ErrInvalid, never gives a
// negative size, and what it gives prints as text that parses back to the
// same size, through String, MarshalText and JSON alike.
func FuzzParseBytes(f *testing.F) {
	for _, s := range []string{
		"0", "4096", "256MiB", "64 MiB", " 1G ", "1.5KiB", ".5K", "2kB", "2KB", "3MB", "4GB", "1e3", "1E3KiB",
		"-1", "-0", "+5", "", "B", "NaN", "inf", "0x1p4", "1_000", "99999999999PiB", "99999999999GiB",
		"9007199254740993", "9223372036854775807", "9223372036854775808", "8589934591.9GiB", "1e-400",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := moat.ParseBytes(s)
		if err != nil {
			if !errors.Is(err, moat.ErrInvalid) {
				t.Fatalf("ParseBytes(%q) = %v, want an error wrapping ErrInvalid", s, err)
			}
			return
		}
		if b < 0 {
			t.Fatalf("ParseBytes(%q) = %d, negative", s, int64(b))
		}
		text := b.String()
		if again, err := moat.ParseBytes(text); err != nil || again != b {
			t.Fatalf("ParseBytes(%q) = %d, prints as %q, which parses as %d, %v", s, int64(b), text, int64(again), err)
		}
		j, err := json.Marshal(b)
		if err != nil {
			t.Fatalf("Marshal(%d): %v", int64(b), err)
		}
		var back moat.Bytes
		if err := json.Unmarshal(j, &back); err != nil || back != b {
			t.Fatalf("ParseBytes(%q) = %d, JSON %s reads back as %d, %v", s, int64(b), j, int64(back), err)
		}
	})
}

// A Duration read from JSON is never negative, and prints as JSON that
// reads back to the same Duration.
func FuzzDurationJSON(f *testing.F) {
	for _, s := range []string{
		`"10s"`, `"0s"`, `"0"`, `"1m30s"`, `"1.5h"`, `"500ms"`, `"1ns"`, `"-1s"`, `"-0s"`, `" 2m "`,
		`"2562047h47m16.854775807s"`, `"2562047h47m16.854775808s"`, `"1.0000000001s"`, `"9999999999h"`,
		`10`, `null`, `""`, `"\u0031s"`, `true`, `{}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var d moat.Duration
		if err := json.Unmarshal(data, &d); err != nil {
			return
		}
		if d < 0 {
			t.Fatalf("Unmarshal(%q) = %v, negative", data, d)
		}
		j, err := json.Marshal(d)
		if err != nil {
			t.Fatalf("Marshal(%d): %v", int64(d), err)
		}
		var back moat.Duration
		if err := json.Unmarshal(j, &back); err != nil || back != d {
			t.Fatalf("Unmarshal(%q) = %v, JSON %s reads back as %v, %v", data, d, j, back, err)
		}
	})
}

// Limits read from JSON never make Validate panic; Validate fails only with
// ErrInvalid; and limits it accepts print as JSON that reads back to the
// same limits, which it accepts again, with their defaults too.
func FuzzLimitsJSON(f *testing.F) {
	for _, s := range []string{
		`{}`,
		`{"wall_time":"30s","cpu_time":"5s","memory":"512MiB","pids":32,"file_size":1048576,"disk":"1 GiB","output":"64KiB","open_files":128}`,
		`{"memory":16777216}`, `{"memory":16777215}`, `{"memory":"9223372036854775807"}`, `{"memory":9223372036854775807}`,
		`{"disk":9007199254740993}`, `{"cpu_time":"999ms"}`, `{"wall_time":"-1s"}`, `{"open_files":15}`, `{"pids":-1}`,
		`{"output":null}`, `{"memory":"1.5GiB"}`, `[]`, `null`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var l moat.Limits
		if err := json.Unmarshal(data, &l); err != nil {
			return
		}
		if err := l.Validate(); err != nil {
			if !errors.Is(err, moat.ErrInvalid) {
				t.Fatalf("Validate(%+v) = %v, want an error wrapping ErrInvalid", l, err)
			}
			return
		}
		j, err := json.Marshal(l)
		if err != nil {
			t.Fatalf("Marshal(%+v): %v", l, err)
		}
		var back moat.Limits
		if err := json.Unmarshal(j, &back); err != nil || back != l {
			t.Fatalf("limits %+v from %q print as %s, which reads back as %+v, %v", l, data, j, back, err)
		}
		if err := back.Validate(); err != nil {
			t.Fatalf("limits %+v read back from %s: Validate = %v", back, j, err)
		}
		if err := l.WithDefaults().Validate(); err != nil {
			t.Fatalf("valid limits %+v with defaults: Validate = %v", l, err)
		}
	})
}
