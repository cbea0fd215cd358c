package sessionfiles_test

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/internal/sessionfiles"
)

// TestSwappedUnderTheWalk: code that swaps a directory on the way for a
// link out, and back, as fast as it can, while the file operations walk
// through it, never gets one of them to read, write, make or remove
// anything outside.
func TestSwappedUnderTheWalk(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	f, ctx := e.files, context.Background()
	d, lnk := filepath.Join(e.work, "d"), filepath.Join(e.work, "d.link")
	e.plant(t, "d", func(p string) error { return os.Mkdir(p, 0o755) })
	e.plant(t, "d/secret", file("inside"))
	e.plant(t, "d.link", link(e.outside))
	if e.uid >= 0 {
		// The program could write outside: only the walk keeps it in.
		if err := os.Chown(e.outside, e.uid, e.uid); err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	var swaps atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			// d is in turn the real directory and a link out, exchanged
			// atomically: the name is never missing.
			err := unix.Renameat2(unix.AT_FDCWD, d, unix.AT_FDCWD, lnk, unix.RENAME_EXCHANGE)
			if err != nil {
				t.Errorf("swap: %v", err)
				return
			}
			swaps.Add(1)
		}
	})
	deadline := time.Now().Add(3 * time.Second)
	reads := 0
	for time.Now().Before(deadline) {
		if rc, err := f.ReadFile(ctx, "d/secret"); err == nil {
			reads++
			b, _ := io.ReadAll(rc)
			rc.Close()
			if string(b) != "inside" {
				t.Errorf("ReadFile(d/secret) read %q through the link", b)
				break
			}
		}
		f.WriteFile(ctx, "d/new", strings.NewReader("x"))
		f.Mkdir(ctx, "d/newdir")
		f.RemoveFile(ctx, "d/secret-copy")
		f.Rename(ctx, "d/new", "d/moved")
	}
	close(stop)
	wg.Wait()
	t.Logf("%d swaps, %d whole reads", swaps.Load(), reads)
	ents, _ := os.ReadDir(e.outside)
	if len(ents) != 1 {
		var names []string
		for _, en := range ents {
			names = append(names, en.Name())
		}
		t.Errorf("the directory outside holds %q, want only secret", names)
	}
	if b, _ := os.ReadFile(filepath.Join(e.outside, "secret")); string(b) != "secret" {
		t.Errorf("the file outside holds %q", b)
	}
}
