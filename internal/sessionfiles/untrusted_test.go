package sessionfiles

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// The instance is not trusted: these tests answer for it.

// canned is an Exec that writes out, then forever (if endless) more of
// repeat, and returns err.
func canned(out string, repeat string, err error) Exec {
	return func(ctx context.Context, argv []string, stdin io.Reader, stdout io.Writer) error {
		if stdin != nil {
			io.Copy(io.Discard, stdin)
		}
		if _, werr := io.WriteString(stdout, out); werr != nil {
			return werr
		}
		for repeat != "" {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if _, werr := io.WriteString(stdout, repeat); werr != nil {
				return werr
			}
		}
		return err
	}
}

func fake(exec Exec) *files {
	return New(exec, Options{Dir: "/work", FileSize: 1000, MaxList: 10}).(*files)
}

func TestUntrustedAnswers(t *testing.T) {
	ctx := context.Background()
	entry := func(n string) string { return fmt.Sprintf(`{"k":"entry","n":%q,"s":1,"m":33188,"t":0}`+"\n", n) }
	for _, c := range []struct {
		name   string
		exec   Exec
		op     func(f *files) error
		sentry error // the error must wrap it; nil: it must wrap none of moat's classes
	}{
		{"garbage", canned("hello\n", "", nil), stat, nil},
		{"no answer", canned("", "", nil), stat, nil},
		{"endless line", canned("", "x", nil), stat, nil},
		{"endless lines", canned("", "{\"k\":\"entry\",\"n\":\"a\",\"s\":1,\"m\":1,\"t\":0}\n", nil), stat, nil},
		{"unknown field", canned(`{"k":"ok","evil":1}`+"\n", "", nil), mkdir, nil},
		{"two objects on a line", canned(`{"k":"ok"}{"k":"ok"}`+"\n", "", nil), mkdir, nil},
		{"wrong kind", canned(`{"k":"file","size":1}`+"\n", "", nil), mkdir, nil},
		{"ok then the exec failed", canned(`{"k":"ok"}`+"\n", "", errors.New("exit status 1")), mkdir, nil},
		{"exec failed", canned("", "", fmt.Errorf("no such file: %w", fs.ErrNotExist)), mkdir, nil},
		{"exec unavailable", canned("", "", fmt.Errorf("gone: %w", moat.ErrUnavailable)), mkdir, moat.ErrUnavailable},
		{"ENOENT", canned(`{"k":"err","e":"ENOENT"}`+"\n", "", nil), stat, fs.ErrNotExist},
		{"ELOOP", canned(`{"k":"err","e":"ELOOP"}`+"\n", "", nil), stat, moat.ErrInvalid},
		{"unknown errno", canned(`{"k":"err","e":"EWHATEVER"}`+"\n", "", nil), stat, nil},
		{"errno with text", canned(`{"k":"err","e":"you have been \u001b[31mpwned"}`+"\n", "", nil), stat, nil},
		{"negative size", canned(`{"k":"entry","n":"","s":-1,"m":33188,"t":0}`+"\n", "", nil), stat, nil},
		{"write ok past the limit", canned(`{"k":"ok"}`+"\n", "", nil), func(f *files) error {
			return f.WriteFile(ctx, "x", bytes.NewReader(make([]byte, 1001)))
		}, moat.ErrInvalid},
		{"read announces past the limit", canned(`{"k":"file","size":1001}`+"\n", "x", nil), readAll, moat.ErrInvalid},
		{"read announces a negative size", canned(`{"k":"file","size":-1}`+"\n", "", nil), readAll, nil},
		{"read ends early", canned(`{"k":"file","size":10}`+"\n"+"12345", "", nil), readAll, nil},
		{"read sends more", canned(`{"k":"file","size":3}`+"\n"+"123456\n"+`{"k":"ok"}`+"\n", "", nil), readAll, nil},
		{"read sends forever", canned(`{"k":"file","size":1000}`+"\n", "x", nil), readAll, nil},
		{"read without trailer", canned(`{"k":"file","size":3}`+"\n"+"123", "", nil), readAll, nil},
		{"read trailer error", canned(`{"k":"file","size":3}`+"\n"+"123"+`{"k":"err","e":"SHRANK"}`+"\n", "", nil), readAll, nil},
		{"list dotdot", canned(entry("../etc"), "", nil), list, nil},
		{"list absolute", canned(entry("/etc"), "", nil), list, nil},
		{"list dot", canned(entry("."), "", nil), list, nil},
		{"list empty element", canned(entry("a//b"), "", nil), list, nil},
		{"list empty name", canned(entry(""), "", nil), list, nil},
		{"list past the cap", canned(strings.Repeat(entry("a"), 11)+`{"k":"ok"}`+"\n", "", nil), list, moat.ErrInvalid},
		{"list forever", canned("", entry("a"), nil), list, moat.ErrInvalid},
		{"list without ok", canned(entry("a"), "", nil), list, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			done := make(chan error, 1)
			go func() { done <- c.op(fake(c.exec)) }()
			var err error
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("the operation did not return")
			}
			switch {
			case err == nil:
				t.Fatal("the operation succeeded, want an error")
			case c.sentry != nil && !errors.Is(err, c.sentry):
				t.Errorf("got %v, want an error wrapping %v", err, c.sentry)
			case c.sentry == nil && (errors.Is(err, moat.ErrInvalid) || errors.Is(err, fs.ErrNotExist) || errors.Is(err, moat.ErrUnavailable)):
				t.Errorf("got %v, want an error of no class moat defines", err)
			case strings.Contains(err.Error(), "pwned") || strings.ContainsRune(err.Error(), 0x1b):
				t.Errorf("the instance's text reached the error: %q", err)
			}
			t.Log(err)
		})
	}
}

func stat(f *files) error  { _, err := f.Stat(context.Background(), "x"); return err }
func mkdir(f *files) error { return f.Mkdir(context.Background(), "x") }
func list(f *files) error  { _, err := f.ListFiles(context.Background()); return err }
func readAll(f *files) error {
	rc, err := f.ReadFile(context.Background(), "x")
	if err != nil {
		return err
	}
	defer rc.Close()
	n, err := io.Copy(io.Discard, rc)
	if n > int64(f.o.FileSize) {
		return fmt.Errorf("read %d bytes, past the file size limit %d", n, f.o.FileSize)
	}
	return err
}

// TestProgramRefusesEscapes sends the program the names the Go side never
// sends: it refuses them by itself.
func TestProgramRefusesEscapes(t *testing.T) {
	dir := t.TempDir()
	run := func(ctx context.Context, argv []string, stdin io.Reader, stdout io.Writer) error {
		cmd := exec.CommandContext(ctx, "/usr/bin/python3", argv[1:]...)
		cmd.Stdin, cmd.Stdout, cmd.Env = stdin, stdout, []string{}
		return cmd.Run()
	}
	f := New(run, Options{Dir: dir}).(*files)
	if err := os.WriteFile(dir+"/../outside", []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"..", "../outside", "a/../../outside", "/etc/passwd", "", ".", "a//b"} {
		for _, op := range []struct {
			op   string
			args []string
		}{
			{"stat", []string{name}}, {"remove", []string{name}}, {"mkdir", []string{name}},
			{"read", []string{name, "100"}}, {"rename", []string{name, "x"}}, {"rename", []string{"x", name}},
		} {
			_, err := f.do(context.Background(), nil, "ok", op.op, name, op.args...)
			if !errors.Is(err, moat.ErrInvalid) || !strings.Contains(err.Error(), "not a name inside") {
				t.Errorf("the program's %s %q = %v, want its own refusal", op.op, op.args, err)
			}
		}
	}
	if _, err := os.Stat(dir + "/../outside"); err != nil {
		t.Errorf("the file outside: %v", err)
	}
}
