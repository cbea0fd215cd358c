package moat_test

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

func TestUnavailableError(t *testing.T) {
	for _, tt := range []struct {
		err  moat.UnavailableError
		want string
	}{
		{moat.UnavailableError{Level: moat.LevelGVisor, Reason: "runsc not found"},
			"gvisor: unavailable: runsc not found"},
		{moat.UnavailableError{Level: moat.LevelSubprocess, Reason: "landlock is not enabled", Remedy: "boot with lsm=landlock"},
			"subprocess: unavailable: landlock is not enabled (boot with lsm=landlock)"},
		{moat.UnavailableError{Level: moat.LevelMicroVM, Reason: "no kernel", Err: fs.ErrNotExist},
			"microvm: unavailable: no kernel: file does not exist"},
		{moat.UnavailableError{Level: moat.LevelContainer, Reason: "no docker", Remedy: "start dockerd", Err: errors.New("dial: refused")},
			"container: unavailable: no docker: dial: refused (start dockerd)"},
		{moat.UnavailableError{}, ": unavailable: "},
	} {
		e := &tt.err
		if got := e.Error(); got != tt.want {
			t.Errorf("Error() = %q, want %q", got, tt.want)
		}
		if !errors.Is(e, moat.ErrUnavailable) {
			t.Errorf("%q: errors.Is(ErrUnavailable) = false", e)
		}
		for _, other := range []error{moat.ErrInvalid, moat.ErrClosed, moat.ErrSpent, errors.New("sandbox unavailable")} {
			if errors.Is(e, other) {
				t.Errorf("%q: errors.Is(%q) = true", e, other)
			}
		}
		if errors.Unwrap(e) != tt.err.Err {
			t.Errorf("%q: Unwrap = %v, want %v", e, errors.Unwrap(e), tt.err.Err)
		}

		// Wrapped by a level, it still matches and can be taken apart.
		w := fmt.Errorf("gvisor: new: %w", e)
		var ue *moat.UnavailableError
		if !errors.Is(w, moat.ErrUnavailable) || !errors.As(w, &ue) || ue != e {
			t.Errorf("%q wrapped: Is = %v, As = %v", e, errors.Is(w, moat.ErrUnavailable), ue)
		}
	}

	// The underlying error is reachable through it.
	e := &moat.UnavailableError{Level: moat.LevelMicroVM, Reason: "no kvm", Err: fmt.Errorf("open /dev/kvm: %w", fs.ErrPermission)}
	if !errors.Is(e, fs.ErrPermission) || !errors.Is(e, moat.ErrUnavailable) {
		t.Errorf("errors.Is(%q, fs.ErrPermission) = %v, want true, and ErrUnavailable too", e, errors.Is(e, fs.ErrPermission))
	}
	var pe *fs.PathError
	inner := &moat.UnavailableError{Reason: "x", Err: &fs.PathError{Op: "open", Path: "/dev/kvm", Err: fs.ErrNotExist}}
	if !errors.As(inner, &pe) || pe.Path != "/dev/kvm" {
		t.Errorf("errors.As(*fs.PathError) = %v", pe)
	}
	// ErrUnavailable itself is not an UnavailableError.
	var ue *moat.UnavailableError
	if errors.As(moat.ErrUnavailable, &ue) {
		t.Errorf("errors.As(ErrUnavailable, *UnavailableError) = true")
	}
}

func TestSentinelsDistinct(t *testing.T) {
	errs := []error{moat.ErrUnavailable, moat.ErrInvalid, moat.ErrClosed, moat.ErrSpent}
	for i, a := range errs {
		for j, b := range errs {
			if (i == j) != errors.Is(a, b) {
				t.Errorf("errors.Is(%q, %q) = %v", a, b, errors.Is(a, b))
			}
		}
	}
}

func TestUnavailable(t *testing.T) {
	ue := &moat.UnavailableError{Level: moat.LevelGVisor, Reason: "runsc not found", Remedy: "install runsc", Err: fs.ErrNotExist}
	for _, tt := range []struct {
		err  error
		want moat.Availability
	}{
		{ue, moat.Availability{Level: moat.LevelGVisor, Reason: "runsc not found: file does not exist", Remedy: "install runsc"}},
		{fmt.Errorf("gvisor: probe: %w", ue), moat.Availability{Level: moat.LevelGVisor, Reason: "runsc not found: file does not exist", Remedy: "install runsc"}},
		{&moat.UnavailableError{Reason: "no kvm"}, moat.Availability{Level: moat.LevelGVisor, Reason: "no kvm"}},
		{errors.New("gvisor: something broke"), moat.Availability{Level: moat.LevelGVisor, Reason: "gvisor: something broke"}},
	} {
		got := moat.Unavailable(moat.LevelGVisor, tt.err)
		if got.Level != tt.want.Level || got.Available || got.Reason != tt.want.Reason || got.Remedy != tt.want.Remedy || got.Details != nil {
			t.Errorf("Unavailable(%q) = %+v, want %+v", tt.err, got, tt.want)
		}
	}
}

func TestParseLevel(t *testing.T) {
	for _, l := range moat.Levels {
		if got, err := moat.ParseLevel(string(l)); err != nil || got != l {
			t.Errorf("ParseLevel(%q) = %q, %v", l, got, err)
		}
	}
	for _, s := range []string{"", "Subprocess", " subprocess", "subprocess ", "docker", "vm", "gVisor"} {
		if got, err := moat.ParseLevel(s); !errors.Is(err, moat.ErrInvalid) || got != "" {
			t.Errorf("ParseLevel(%q) = %q, %v; want ErrInvalid", s, got, err)
		}
	}
	want := []moat.Level{moat.LevelSubprocess, moat.LevelContainer, moat.LevelGVisor, moat.LevelMicroVM}
	if len(moat.Levels) != len(want) {
		t.Fatalf("Levels = %v, want %v, lightest first", moat.Levels, want)
	}
	for i := range want {
		if moat.Levels[i] != want[i] {
			t.Errorf("Levels = %v, want %v, lightest first", moat.Levels, want)
		}
	}
}

// Invalid classes an error as ErrInvalid once: classing it again, on the
// way up, adds nothing to its message.
func TestInvalid(t *testing.T) {
	base := errors.New("open x.py: no such file")
	once := moat.Invalid(base)
	if !errors.Is(once, moat.ErrInvalid) || !errors.Is(once, base) {
		t.Fatalf("Invalid(%q) = %q: not ErrInvalid and base", base, once)
	}
	if want := "open x.py: no such file: invalid input"; once.Error() != want {
		t.Errorf("Invalid(%q) = %q, want %q", base, once, want)
	}
	for _, again := range []error{
		moat.Invalid(once),
		moat.Invalid(fmt.Errorf("config: %w", once)),
		moat.Invalid(moat.ErrInvalid),
	} {
		if n := strings.Count(again.Error(), moat.ErrInvalid.Error()); n != 1 {
			t.Errorf("%q says %q %d times", again, moat.ErrInvalid, n)
		}
	}
	if moat.Invalid(nil) != nil {
		t.Error("Invalid(nil) != nil")
	}
}
