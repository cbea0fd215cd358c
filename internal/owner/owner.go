// Package owner names the moat process that owns things it leaves on the
// host while it runs (working directories, cgroups), so that a later moat can
// tell a live owner's things from a dead one's and reap only the latter.
//
// A pid cannot do this: pids are reused, and a moat in another PID namespace
// has a pid that means nothing here. Instead each process takes a random id
// and holds an exclusive flock(2) on a file of that name in a shared
// directory for as long as it lives. The kernel drops the lock when the
// process dies, however it dies; a file that can be locked, or that is gone,
// belongs to a dead owner. Ids are never reused.
package owner

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
)

var (
	mu   sync.Mutex
	mine = map[string]string{} // dir -> this process's id there
	held []*os.File            // the locked files, kept open for life
)

// Self returns this process's owner id in dir, creating and locking its file
// on first use. Names of owned things start with the id and a "-".
func Self(dir string) (string, error) {
	mu.Lock()
	defer mu.Unlock()
	if id, ok := mine[dir]; ok {
		return id, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("owner: %w", err)
	}
	var b [8]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	f, err := os.OpenFile(filepath.Join(dir, id), os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return "", fmt.Errorf("owner: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return "", fmt.Errorf("owner: lock %s: %w", f.Name(), err)
	}
	fmt.Fprintf(f, "%d\n", os.Getpid()) // for humans; never trusted
	held = append(held, f)
	mine[dir] = id
	return id, nil
}

// Of returns the owner id at the start of name ("<id>-<anything>").
func Of(name string) (string, bool) {
	id, _, ok := strings.Cut(name, "-")
	if !ok || len(id) != 16 {
		return "", false
	}
	if _, err := hex.DecodeString(id); err != nil {
		return "", false
	}
	return id, true
}

// Alive reports whether the owner id in dir is a live process. When it is
// not, Alive removes its file, so the caller must reap what it owned.
func Alive(dir, id string) bool {
	mu.Lock()
	for _, m := range mine {
		if m == id {
			mu.Unlock()
			return true
		}
	}
	mu.Unlock()
	path := filepath.Join(dir, id)
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false
	}
	if err != nil {
		return true // unknown: never reap on doubt
	}
	defer f.Close()
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return true
	}
	if err != nil {
		return true
	}
	os.Remove(path)
	return false
}
