package uidpool

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
)

func TestNewRejectsBadRanges(t *testing.T) {
	for _, r := range [][2]int{{0, 10}, {-5, 10}, {1000, 0}, {1000, -1}, {1 << 31, 1}, {1<<31 - 10, 11}} {
		if _, err := New(r[0], r[1], t.TempDir()); err == nil {
			t.Errorf("New(%d, %d) succeeded", r[0], r[1])
		}
	}
}

// TestLeasesAreExclusive checks that two pools over one lock directory (two
// moat processes) never hand out a uid twice, that the range is used up to
// its end and no further, and that a released uid is handed out again.
func TestLeasesAreExclusive(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "uids")
	const first, count = 5000, 6
	a, err := New(first, count, dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(first, count, dir)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(dir); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("lock directory: %v, %v; want mode 0700", st, err)
	}
	held := map[int]*Lease{}
	for i := range count {
		p := a
		if i%2 == 1 {
			p = b
		}
		l, err := p.Acquire()
		if err != nil {
			t.Fatalf("lease %d: %v", i, err)
		}
		if l.UID < first || l.UID >= first+count {
			t.Fatalf("uid %d outside [%d, %d)", l.UID, first, first+count)
		}
		if held[l.UID] != nil {
			t.Fatalf("uid %d handed out twice", l.UID)
		}
		held[l.UID] = l
	}
	for _, p := range []*Pool{a, b} {
		if l, err := p.Acquire(); !errors.Is(err, ErrExhausted) {
			t.Fatalf("Acquire with every uid held: %v, %v; want ErrExhausted", l, err)
		}
	}
	freed := first + 3
	held[freed].Release()
	held[freed].Release() // twice is fine
	l, err := b.Acquire()
	if err != nil || l.UID != freed {
		t.Fatalf("Acquire after releasing %d: %v, %v", freed, l, err)
	}
	held[freed] = l
	for _, l := range held {
		l.Release()
	}
}

// TestLeaseOfADeadProcessIsFree checks that a uid locked by a process that
// died without releasing it is handed out again.
func TestLeaseOfADeadProcessIsFree(t *testing.T) {
	dir := t.TempDir()
	p, err := New(7000, 1, dir)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(7000)), os.O_RDONLY|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	// The child shares the lock; once this process's copy is closed, the
	// child alone holds it.
	cmd := exec.Command("/bin/sleep", "100")
	cmd.ExtraFiles = []*os.File{f}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := p.Acquire(); !errors.Is(err, ErrExhausted) {
		t.Fatalf("Acquire while another process holds the only uid: %v", err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	l, err := p.Acquire()
	if err != nil {
		t.Fatalf("Acquire after the holder died: %v", err)
	}
	l.Release()
}
