package sandboxtest

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// SuspendOptions tune [TestSuspend] for one level.
type SuspendOptions struct {
	// Memory says the level saves a session's memory when it suspends it
	// (a live interpreter's variables come back). The suite then requires
	// SuspendInfo.Memory and the variables; without it, it requires the
	// files alone and a fresh interpreter, said in the info's notes.
	Memory bool
	// NoInterpreter says the level keeps no live interpreter.
	NoInterpreter bool
}

// TestSuspend is the conformance suite of suspended sessions
// ([moat.Suspender], [moat.Resumer]) at one level: a session's files (and
// with Memory its variables) survive a suspend and a resume; a suspend
// waits for the run in progress and loses nothing of it; a suspended
// session holds nothing (its Run fails with ErrClosed); its state is 0700
// and refused when damaged (a byte changed, a file truncated, missing or
// added), and the refusal starts nothing; one state resumed twice gives two
// sessions that do not see each other's writes (forks).
func TestSuspend(t *testing.T, newSandbox Factory, opts SuspendOptions) {
	t.Helper()
	sb := newSandbox(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)})
	t.Cleanup(func() { sb.Close() })
	ser, ok := sb.(moat.Sessioner)
	if !ok {
		t.Fatal("the sandbox keeps no sessions")
	}
	res, ok := sb.(moat.Resumer)
	if !ok {
		t.Fatal("the sandbox does not resume sessions (moat.Resumer)")
	}
	ctx := context.Background()
	modes := []bool{false}
	if !opts.NoInterpreter {
		modes = append(modes, true)
	}
	for _, interp := range modes {
		name := "plain"
		if interp {
			name = "interpreter"
		}
		t.Run(name, func(t *testing.T) {
			s, err := ser.NewSession(ctx, moat.SessionOptions{Interpreter: interp})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			blob := bytes.Repeat([]byte{0, 1, 2, 255, '\n'}, 40000)
			if err := s.WriteFile(ctx, "data/blob.bin", bytes.NewReader(blob)); err != nil {
				t.Fatal(err)
			}
			if err := s.Mkdir(ctx, "empty/dir"); err != nil {
				t.Fatal(err)
			}
			out := runIn(t, s, "x = 41\nopen('made.txt', 'w').write('by the code')\nprint('ok')")
			if out != "ok\n" {
				t.Fatalf("first run: %q", out)
			}
			// A suspend while a run is in progress waits for it.
			slow := make(chan string, 1)
			go func() {
				slow <- runIn(t, s, "import time\ntime.sleep(1)\nopen('late.txt', 'w').write('after the sleep')\nprint('slept')")
			}()
			time.Sleep(300 * time.Millisecond)
			dir := filepath.Join(t.TempDir(), "suspended")
			sp, ok := s.(moat.Suspender)
			if !ok {
				t.Fatal("the session cannot be suspended (moat.Suspender)")
			}
			info, err := sp.Suspend(ctx, dir)
			if err != nil {
				t.Fatalf("Suspend: %v", err)
			}
			if got := <-slow; got != "slept\n" {
				t.Errorf("the run in progress at Suspend: %q, want it run to its end", got)
			}
			t.Logf("suspended: %+v", info)
			if info.Level != sb.Level() || info.Interpreter != interp || info.Bytes <= 0 {
				t.Errorf("SuspendInfo = %+v", info)
			}
			if interp && info.Memory != opts.Memory {
				t.Errorf("SuspendInfo.Memory = %v, the level says %v", info.Memory, opts.Memory)
			}
			if st, err := os.Stat(dir); err != nil || st.Mode().Perm() != 0o700 {
				t.Errorf("the state's directory: %v %v, want mode 0700", st, err)
			}
			if _, err := s.Run(ctx, moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrClosed) {
				t.Errorf("Run on a suspended session: %v, want ErrClosed", err)
			}
			if _, err := sp.Suspend(ctx, dir+"2"); err == nil {
				t.Error("a second Suspend of the same session succeeded")
			}

			// Resumed twice: two sessions with the files, not sharing writes.
			a := resume(t, res, dir)
			b := resume(t, res, dir)
			for i, r := range []moat.Session{a, b} {
				got, err := readAll(r, "data/blob.bin")
				if err != nil || !bytes.Equal(got, blob) {
					t.Errorf("resumed %d: data/blob.bin: %d bytes, %v; want the %d written", i, len(got), err, len(blob))
				}
				for file, want := range map[string]string{"made.txt": "by the code", "late.txt": "after the sleep"} {
					if got, err := readAll(r, file); err != nil || string(got) != want {
						t.Errorf("resumed %d: %s = %q, %v; want %q", i, file, got, err, want)
					}
				}
				if fi, err := r.Stat(ctx, "empty/dir"); err != nil || !fi.IsDir {
					t.Errorf("resumed %d: empty/dir: %+v, %v", i, fi, err)
				}
				if interp {
					code := "try:\n print(x + 1)\nexcept NameError:\n print('fresh')"
					want := "fresh\n"
					if opts.Memory {
						want = "42\n"
					}
					if got := runIn(t, r, code); got != want {
						t.Errorf("resumed %d: the variable: %q, want %q", i, got, want)
					}
				}
			}
			if runIn(t, a, "open('made.txt', 'w').write('a wrote this')\nprint('ok')") != "ok\n" {
				t.Fatal("a write in the first fork")
			}
			if got, _ := readAll(b, "made.txt"); string(got) != "by the code" {
				t.Errorf("the second fork sees the first's write: %q", got)
			}
			a.Close()
			b.Close()

			// Damage is refused, and starts nothing.
			for what, damage := range map[string]func(dir string) error{
				"a byte changed": func(d string) error { return flipByte(d) },
				"a file truncated": func(d string) error {
					f, err := biggest(d)
					if err != nil {
						return err
					}
					return os.Truncate(f, 1)
				},
				"a file removed": func(d string) error {
					f, err := biggest(d)
					if err != nil {
						return err
					}
					return os.Remove(f)
				},
				"a file added": func(d string) error {
					return os.WriteFile(filepath.Join(d, "extra"), []byte("x"), 0o600)
				},
			} {
				c := filepath.Join(t.TempDir(), "copy")
				if err := os.CopyFS(c, os.DirFS(dir)); err != nil {
					t.Fatal(err)
				}
				if err := damage(c); err != nil {
					t.Fatal(err)
				}
				if r, _, err := res.ResumeSession(ctx, c); !errors.Is(err, moat.ErrInvalid) {
					if r != nil {
						r.Close()
					}
					t.Errorf("%s: ResumeSession = %v, want an error wrapping ErrInvalid", what, err)
				}
			}
			if _, _, err := res.ResumeSession(ctx, filepath.Join(t.TempDir(), "none")); err == nil {
				t.Error("ResumeSession of a missing directory succeeded")
			}
		})
	}
}

func resume(t *testing.T, r moat.Resumer, dir string) moat.Session {
	t.Helper()
	s, info, err := r.ResumeSession(context.Background(), dir)
	if err != nil {
		t.Fatalf("ResumeSession: %v", err)
	}
	t.Logf("resumed: %+v", info)
	t.Cleanup(func() { s.Close() })
	return s
}

func runIn(t *testing.T, s moat.Session, code string) string {
	t.Helper()
	res, err := s.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Errorf("Run: %v", err)
		return ""
	}
	if res.ExitCode != 0 {
		t.Errorf("Run: exit %d, stderr %q", res.ExitCode, res.Stderr)
	}
	return string(res.Stdout)
}

func readAll(s moat.Session, name string) ([]byte, error) {
	r, err := s.ReadFile(context.Background(), name)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return io.ReadAll(r)
}

// biggest is the largest regular file under dir.
func biggest(dir string) (string, error) {
	var best string
	var size int64 = -1
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() && fi.Size() > size && !strings.HasSuffix(p, "manifest.json") {
			best, size = p, fi.Size()
		}
		return err
	})
	return best, err
}

func flipByte(dir string) error {
	f, err := biggest(dir)
	if err != nil {
		return err
	}
	b, err := os.ReadFile(f)
	if err != nil {
		return err
	}
	b[len(b)/2] ^= 0x40
	return os.WriteFile(f, b, 0o600)
}
