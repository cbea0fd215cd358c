package moat_test

import (
	"encoding/json"
	"errors"
	"flag"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func TestParseBytes(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want moat.Bytes // when ok
		ok   bool
	}{
		// Plain numbers of bytes.
		{"0", 0, true},
		{"1", 1, true},
		{"4096", 4096, true},
		{"+5", 5, true},
		{"-0", 0, true},
		{"0B", 0, true},
		{"17B", 17, true},
		// Binary units, long and short.
		{"1KiB", moat.KiB, true},
		{"512KiB", 512 * moat.KiB, true},
		{"256MiB", 256 * moat.MiB, true},
		{"1GiB", moat.GiB, true},
		{"3K", 3 * moat.KiB, true},
		{"3M", 3 * moat.MiB, true},
		{"3G", 3 * moat.GiB, true},
		// Decimal units.
		{"2kB", 2000, true},
		{"2KB", 2000, true},
		{"2MB", 2000000, true},
		{"2GB", 2000000000, true},
		// Whitespace around the size and between number and unit.
		{"64 MiB", 64 * moat.MiB, true},
		{"  64MiB  ", 64 * moat.MiB, true},
		{"\t2MiB\n", 2 * moat.MiB, true},
		{"1 B", 1, true},
		// Fractions, cut down to a whole byte.
		{"1.5KiB", 1536, true},
		{".5KiB", 512, true},
		{"1.KiB", 1024, true},
		{"0.5GiB", 512 * moat.MiB, true},
		{"1.5B", 1, true},
		{"0.5", 0, true},
		// What strconv.ParseFloat takes, it takes.
		{"1e3", 1000, true},
		{"1e3KiB", 1000 * moat.KiB, true},
		{"1E3", 1000, true},
		// Integers are exact, however large: no float64 rounding.
		{"9007199254740993", 1<<53 + 1, true},
		{"4611686018427387903", 1<<62 - 1, true},
		{"9223372036854775807", math.MaxInt64, true},
		{"9223372036854775807B", math.MaxInt64, true},
		{"8589934591GiB", 8589934591 * moat.GiB, true},
		{"8796093022207KiB", 8796093022207 * moat.KiB, true},

		// No number.
		{"", 0, false},
		{"   ", 0, false},
		{"B", 0, false},
		{"MiB", 0, false},
		{" GiB", 0, false},
		// Negative.
		{"-1", 0, false},
		{"-1MiB", 0, false},
		{"-0.5KiB", 0, false},
		{"-9223372036854775808", 0, false},
		// Too large for an int64.
		{"9223372036854775808", 0, false},
		{"9223372036854775808B", 0, false},
		{"8589934592GiB", 0, false},
		{"99999999999GiB", 0, false},
		{"99999999999999999999999999", 0, false},
		{"1e19", 0, false},
		{"1e400", 0, false},
		{"inf", 0, false},
		{"+Inf", 0, false},
		{"infinity", 0, false},
		// Not a number, or not a unit moat knows.
		{"NaN", 0, false},
		{"nan", 0, false},
		{"abc", 0, false},
		{"1 2", 0, false},
		{"1..5K", 0, false},
		{"99999999999PiB", 0, false},
		{"1TiB", 0, false},
		{"1T", 0, false},
		{"1kib", 0, false},
		{"1mib", 0, false},
		{"1gb", 0, false},
		{"1k", 0, false},
		{"1b", 0, false},
		{"1 k", 0, false},
		{"1iB", 0, false},
		{"1KiBKiB", 0, false},
		{"1GiBB", 0, false},
		{"KiB1", 0, false},
		{"1MiB 2", 0, false},
		{"0x10", 0, false},
		{"1,000", 0, false},
	} {
		got, err := moat.ParseBytes(tt.in)
		switch {
		case tt.ok && err != nil:
			t.Errorf("ParseBytes(%q) = %v, want %d", tt.in, err, int64(tt.want))
		case tt.ok && got != tt.want:
			t.Errorf("ParseBytes(%q) = %d, want %d", tt.in, int64(got), int64(tt.want))
		case !tt.ok && err == nil:
			t.Errorf("ParseBytes(%q) = %d, want an error", tt.in, int64(got))
		case !tt.ok && !errors.Is(err, moat.ErrInvalid):
			t.Errorf("ParseBytes(%q) = %v, want an error wrapping ErrInvalid", tt.in, err)
		case !tt.ok && !strings.HasPrefix(err.Error(), "moat: ") || !tt.ok && !strings.Contains(err.Error(), tt.in):
			t.Errorf("ParseBytes(%q): error %q should start with \"moat: \" and quote the input", tt.in, err)
		}
	}
}

func TestBytesString(t *testing.T) {
	for _, tt := range []struct {
		b    moat.Bytes
		want string
	}{
		{0, "0B"},
		{1, "1B"},
		{1023, "1023B"},
		{moat.KiB, "1KiB"},
		{1536, "1536B"},
		{1025 * moat.KiB, "1025KiB"},
		{moat.MiB, "1MiB"},
		{1536 * moat.KiB, "1536KiB"},
		{256 * moat.MiB, "256MiB"},
		{moat.GiB, "1GiB"},
		{1024 * moat.GiB, "1024GiB"},
		{2000000000, "1953125KiB"},
		{math.MaxInt64, "9223372036854775807B"},
		{-moat.MiB, "-1MiB"},
		{-1, "-1B"},
	} {
		if got := tt.b.String(); got != tt.want {
			t.Errorf("Bytes(%d).String() = %q, want %q", int64(tt.b), got, tt.want)
		}
		if got, _ := tt.b.MarshalText(); string(got) != tt.want {
			t.Errorf("Bytes(%d).MarshalText() = %q, want %q", int64(tt.b), got, tt.want)
		}
	}
}

// Every size that is not negative prints as text that parses back to it:
// as a flag, in a config file and in JSON.
func TestBytesRoundTrip(t *testing.T) {
	for _, b := range []moat.Bytes{
		0, 1, 1023, moat.KiB, moat.KiB + 1, moat.MiB, 256 * moat.MiB, moat.GiB, 3*moat.GiB + 1,
		1<<53 - 1, 1 << 53, 1<<53 + 1, 1<<62 - 1, 1 << 62, 1<<62 + 1, math.MaxInt64 - 1, math.MaxInt64,
		math.MaxInt64 &^ (moat.GiB - 1), math.MaxInt64 &^ (moat.KiB - 1),
	} {
		s := b.String()
		if got, err := moat.ParseBytes(s); err != nil || got != b {
			t.Errorf("ParseBytes(Bytes(%d).String() = %q) = %d, %v; want it back", int64(b), s, int64(got), err)
		}
		var v moat.Bytes
		if err := v.Set(s); err != nil || v != b {
			t.Errorf("Set(%q) = %d, %v; want %d", s, int64(v), err, int64(b))
		}
		j, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		v = 0
		if err := json.Unmarshal(j, &v); err != nil || v != b {
			t.Errorf("JSON %s of %d reads back as %d, %v", j, int64(b), int64(v), err)
		}
	}
}

func TestBytesJSON(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want moat.Bytes
		ok   bool
	}{
		{`"256MiB"`, 256 * moat.MiB, true},
		{`"64 MiB"`, 64 * moat.MiB, true},
		{`"1.5KiB"`, 1536, true},
		{`"4096"`, 4096, true},
		{`4096`, 4096, true},
		{`0`, 0, true},
		{`"0"`, 0, true},
		{`9223372036854775807`, math.MaxInt64, true},
		{`"\u0031KiB"`, moat.KiB, true},

		{`-1`, 0, false},
		{`"-1"`, 0, false},
		{`9223372036854775808`, 0, false},
		{`1.5`, 0, false},
		{`1e3`, 0, false},
		{`""`, 0, false},
		{`"lots"`, 0, false},
		{`true`, 0, false},
		{`{}`, 0, false},
		{`[1]`, 0, false},
	} {
		var got moat.Bytes
		err := json.Unmarshal([]byte(tt.in), &got)
		switch {
		case tt.ok && (err != nil || got != tt.want):
			t.Errorf("Unmarshal(%s) = %d, %v; want %d", tt.in, int64(got), err, int64(tt.want))
		case !tt.ok && !errors.Is(err, moat.ErrInvalid):
			t.Errorf("Unmarshal(%s) = %d, %v; want an error wrapping ErrInvalid", tt.in, int64(got), err)
		}
	}
	// Inside a struct, the size prints as a string with a unit.
	out, err := json.Marshal(struct {
		M moat.Bytes `json:"m"`
	}{3 * moat.MiB})
	if err != nil || string(out) != `{"m":"3MiB"}` {
		t.Errorf("Marshal = %s, %v; want {\"m\":\"3MiB\"}", out, err)
	}
}

// A JSON null leaves a size as it was, as it does a Duration and as
// encoding/json does for its own types: a config layered over another one
// does not reset a limit by naming it null.
func TestBytesJSONNull(t *testing.T) {
	b := 3 * moat.MiB
	if err := json.Unmarshal([]byte(`null`), &b); err != nil || b != 3*moat.MiB {
		t.Errorf("Unmarshal(null) over 3MiB = %v, %v; want 3MiB left as it was", b, err)
	}
	l := moat.Limits{Memory: moat.GiB, WallTime: moat.Duration(time.Minute)}
	if err := json.Unmarshal([]byte(`{"memory":null,"wall_time":null}`), &l); err != nil ||
		l.Memory != moat.GiB || l.WallTime != moat.Duration(time.Minute) {
		t.Errorf("Unmarshal of nulls over %+v: %v; want the limits left as they were", l, err)
	}
}

func TestBytesFlag(t *testing.T) {
	var b moat.Bytes
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(new(strings.Builder))
	fs.Var(&b, "memory", "")
	if err := fs.Parse([]string{"-memory", "512MiB"}); err != nil || b != 512*moat.MiB {
		t.Errorf("-memory 512MiB: %v, %v", b, err)
	}
	if err := fs.Parse([]string{"-memory", "lots"}); err == nil {
		t.Errorf("-memory lots: no error")
	}
	if b != 512*moat.MiB {
		t.Errorf("a failed Set changed the value to %v", b)
	}
	if err := b.UnmarshalText([]byte("2G")); err != nil || b != 2*moat.GiB {
		t.Errorf("UnmarshalText(2G) = %v, %v", b, err)
	}
}

func TestDurationSet(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"10s", 10 * time.Second, true},
		{"500ms", 500 * time.Millisecond, true},
		{"1m30s", 90 * time.Second, true},
		{"1.5h", 90 * time.Minute, true},
		{"0", 0, true},
		{"0s", 0, true},
		{"-0s", 0, true},
		{" 2m ", 2 * time.Minute, true},
		{"1ns", 1, true},
		{"2562047h47m16.854775807s", math.MaxInt64, true},

		{"", 0, false},
		{"10", 0, false},
		{"-1s", 0, false},
		{"-1ns", 0, false},
		{"ten seconds", 0, false},
		{"1d", 0, false},
		{"9999999999h", 0, false},
		{"2562047h47m16.854775808s", 0, false},
	} {
		var d moat.Duration
		err := d.Set(tt.in)
		switch {
		case tt.ok && (err != nil || time.Duration(d) != tt.want):
			t.Errorf("Set(%q) = %v, %v; want %v", tt.in, d, err, tt.want)
		case !tt.ok && !errors.Is(err, moat.ErrInvalid):
			t.Errorf("Set(%q) = %v, %v; want an error wrapping ErrInvalid", tt.in, d, err)
		}
	}
}

func TestDurationJSON(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		want string
	}{
		{0, `"0s"`},
		{1, `"1ns"`},
		{1500 * time.Microsecond, `"1.5ms"`},
		{10 * time.Second, `"10s"`},
		{90 * time.Second, `"1m30s"`},
		{math.MaxInt64, `"2562047h47m16.854775807s"`},
	} {
		out, err := json.Marshal(moat.Duration(tt.d))
		if err != nil || string(out) != tt.want {
			t.Errorf("Marshal(%v) = %s, %v; want %s", tt.d, out, err, tt.want)
			continue
		}
		var back moat.Duration
		if err := json.Unmarshal(out, &back); err != nil || time.Duration(back) != tt.d {
			t.Errorf("Unmarshal(%s) = %v, %v; want %v", out, back, err, tt.d)
		}
	}
	for _, in := range []string{`"-1s"`, `"10"`, `""`, `"soon"`, `10`, `1.5`, `true`, `{}`} {
		d := moat.Duration(time.Second)
		if err := json.Unmarshal([]byte(in), &d); err == nil {
			t.Errorf("Unmarshal(%s) = %v, want an error", in, d)
		}
	}
	// A string that fails to parse is ErrInvalid; a JSON number is
	// encoding/json's type error, not a number of nanoseconds.
	var d moat.Duration
	if err := json.Unmarshal([]byte(`"-1s"`), &d); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("Unmarshal(\"-1s\"): %v, want ErrInvalid", err)
	}
	var typeErr *json.UnmarshalTypeError
	if err := json.Unmarshal([]byte(`10`), &d); !errors.As(err, &typeErr) || d != 0 {
		t.Errorf("Unmarshal(10) = %v, %v; want a *json.UnmarshalTypeError and nothing set", d, err)
	}
}

func TestLimitsValidate(t *testing.T) {
	for _, tt := range []struct {
		name string
		l    moat.Limits
		bad  []string // what the error must mention; nil when valid
	}{
		{"zero", moat.Limits{}, nil},
		{"defaults", moat.DefaultLimits(), nil},
		{"floors", moat.Limits{WallTime: 1, CPUTime: moat.Duration(time.Second), Memory: 16 * moat.MiB, Pids: 1,
			FileSize: 1, Disk: 1, Output: 1, OpenFiles: 16}, nil},
		{"large", moat.Limits{WallTime: math.MaxInt64, CPUTime: math.MaxInt64, Memory: math.MaxInt64, Pids: math.MaxInt,
			FileSize: math.MaxInt64, Disk: math.MaxInt64, Output: math.MaxInt64, OpenFiles: math.MaxInt}, nil},

		{"negative wall time", moat.Limits{WallTime: -1}, []string{"wall time"}},
		{"negative cpu time", moat.Limits{CPUTime: moat.Duration(-time.Second)}, []string{"cpu time"}},
		{"cpu time under 1s", moat.Limits{CPUTime: moat.Duration(999 * time.Millisecond)}, []string{"cpu time", "granularity"}},
		{"cpu time of 1ns", moat.Limits{CPUTime: 1}, []string{"cpu time"}},
		{"memory under 16MiB", moat.Limits{Memory: 16*moat.MiB - 1}, []string{"memory"}},
		{"memory of 1B", moat.Limits{Memory: 1}, []string{"memory"}},
		{"negative memory", moat.Limits{Memory: -moat.GiB}, []string{"memory"}},
		{"negative pids", moat.Limits{Pids: -1}, []string{"pids"}},
		{"negative file size", moat.Limits{FileSize: -1}, []string{"file size"}},
		{"negative disk", moat.Limits{Disk: -1}, []string{"disk"}},
		{"negative output", moat.Limits{Output: -1}, []string{"output"}},
		{"negative open files", moat.Limits{OpenFiles: -1}, []string{"open files"}},
		{"open files under 16", moat.Limits{OpenFiles: 15}, []string{"open files"}},
		{"several", moat.Limits{WallTime: -1, Memory: 1, OpenFiles: 3},
			[]string{"wall time", "memory", "open files"}},
	} {
		err := tt.l.Validate()
		if tt.bad == nil {
			if err != nil {
				t.Errorf("%s: Validate(%+v) = %v, want nil", tt.name, tt.l, err)
			}
			continue
		}
		if !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("%s: Validate(%+v) = %v, want an error wrapping ErrInvalid", tt.name, tt.l, err)
			continue
		}
		if !strings.HasPrefix(err.Error(), "moat: limits: ") {
			t.Errorf("%s: error %q should start with \"moat: limits: \"", tt.name, err)
		}
		for _, w := range tt.bad {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q does not mention %q", tt.name, err, w)
			}
		}
	}
}

// Every numeric field of Limits refuses a negative value, including fields
// added after this test was written.
func TestLimitsValidateEveryFieldNegative(t *testing.T) {
	typ := reflect.TypeFor[moat.Limits]()
	for i := range typ.NumField() {
		var l moat.Limits
		f := reflect.ValueOf(&l).Elem().Field(i)
		if !f.CanInt() {
			t.Errorf("Limits.%s is a %s: extend this test", typ.Field(i).Name, f.Type())
			continue
		}
		f.SetInt(-1)
		if err := l.Validate(); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Limits.%s = -1: Validate = %v, want ErrInvalid", typ.Field(i).Name, err)
		}
	}
}

func TestLimitsWithDefaults(t *testing.T) {
	d := moat.DefaultLimits()
	if got := (moat.Limits{}).WithDefaults(); got != d {
		t.Errorf("zero limits with defaults = %+v, want DefaultLimits %+v", got, d)
	}
	if err := d.Validate(); err != nil {
		t.Errorf("DefaultLimits().Validate() = %v", err)
	}
	if got := d.WithDefaults(); got != d {
		t.Errorf("defaults with defaults = %+v, want them unchanged", got)
	}
	// The documented defaults.
	want := moat.Limits{
		WallTime: moat.Duration(10 * time.Second), CPUTime: moat.Duration(10 * time.Second),
		Memory: 256 * moat.MiB, Pids: 64, FileSize: 16 * moat.MiB, Disk: 64 * moat.MiB,
		Output: moat.MiB, OpenFiles: 256,
	}
	if d != want {
		t.Errorf("DefaultLimits() = %+v, want %+v as documented", d, want)
	}

	// Each field on its own: a set value stays, a zero one takes the
	// default, a negative one stays for Validate to refuse. Every field of
	// Limits has a non-zero default, including fields added later.
	typ := reflect.TypeFor[moat.Limits]()
	dv := reflect.ValueOf(d)
	for i := range typ.NumField() {
		name := typ.Field(i).Name
		if dv.Field(i).IsZero() {
			t.Errorf("DefaultLimits().%s is zero: a zero field must mean a default", name)
		}
		for _, v := range []int64{7, -3} {
			l := moat.Limits{}
			reflect.ValueOf(&l).Elem().Field(i).SetInt(v)
			got := reflect.ValueOf(l.WithDefaults())
			for j := range typ.NumField() {
				wantField := dv.Field(j).Int()
				if j == i {
					wantField = v
				}
				if got.Field(j).Int() != wantField {
					t.Errorf("Limits{%s: %d}.WithDefaults().%s = %d, want %d", name, v, typ.Field(j).Name, got.Field(j).Int(), wantField)
				}
			}
		}
	}
}

func TestLimitsJSON(t *testing.T) {
	var l moat.Limits
	in := `{"wall_time":"30s","cpu_time":"5s","memory":"512MiB","pids":32,"file_size":1048576,
		"disk":"1 GiB","output":"64KiB","open_files":128}`
	if err := json.Unmarshal([]byte(in), &l); err != nil {
		t.Fatal(err)
	}
	want := moat.Limits{
		WallTime: moat.Duration(30 * time.Second), CPUTime: moat.Duration(5 * time.Second),
		Memory: 512 * moat.MiB, Pids: 32, FileSize: moat.MiB, Disk: moat.GiB, Output: 64 * moat.KiB, OpenFiles: 128,
	}
	if l != want {
		t.Errorf("Unmarshal = %+v, want %+v", l, want)
	}
	out, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	const wantOut = `{"wall_time":"30s","cpu_time":"5s","memory":"512MiB","pids":32,"file_size":"1MiB",` +
		`"disk":"1GiB","output":"64KiB","open_files":128}`
	if string(out) != wantOut {
		t.Errorf("Marshal = %s\nwant      %s", out, wantOut)
	}
	// Zero fields, which mean the defaults, are left out.
	if out, _ := json.Marshal(moat.Limits{}); string(out) != `{}` {
		t.Errorf("Marshal(Limits{}) = %s, want {}", out)
	}
	if out, _ := json.Marshal(moat.Limits{Pids: 2}); string(out) != `{"pids":2}` {
		t.Errorf("Marshal(Limits{Pids: 2}) = %s, want {\"pids\":2}", out)
	}

	for _, bad := range []string{
		`{"wall_time":10}`,
		`{"wall_time":"-1s"}`,
		`{"memory":"-1"}`,
		`{"memory":-1}`,
		`{"memory":"lots"}`,
		`{"memory":1.5}`,
		`{"pids":"64"}`,
		`{"pids":1.5}`,
		`{"open_files":99999999999999999999}`,
	} {
		var l moat.Limits
		if err := json.Unmarshal([]byte(bad), &l); err == nil {
			t.Errorf("Unmarshal(%s) = %+v, want an error", bad, l)
		}
	}
}
