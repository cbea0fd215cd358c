package server

import (
	"bytes"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// copyState copies a state's files with their holes kept as holes (a VM's
// memory file is mostly holes: a snapshot takes its data, not its nominal
// size), their bytes equal, their modes kept but never above 0644, and
// counts the data copied.
func TestCopyStateKeepsHoles(t *testing.T) {
	src := filepath.Join(t.TempDir(), "state")
	if err := os.MkdirAll(filepath.Join(src, "files"), 0o700); err != nil {
		t.Fatal(err)
	}
	ram := filepath.Join(src, "ram")
	f, err := os.OpenFile(ram, os.O_RDWR|os.O_CREATE, 0o444)
	if err != nil {
		t.Fatal(err)
	}
	const size = 256 << 20
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	page := bytes.Repeat([]byte{7}, 4096)
	for _, off := range []int64{0, 100 << 20, size - 4096} {
		if _, err := f.WriteAt(page, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	if err := os.WriteFile(filepath.Join(src, "files", "a"), []byte("a file"), 0o755); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "copy")
	n, err := copyState(src, dst)
	if err != nil {
		t.Fatal(err)
	}
	if n > 1<<20 {
		t.Errorf("copyState counted %d bytes for 12 KiB of data", n)
	}
	want, _ := os.ReadFile(ram)
	got, err := os.ReadFile(filepath.Join(dst, "ram"))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the copy's memory file differs (%d bytes, err %v)", len(got), err)
	}
	fi, err := os.Stat(filepath.Join(dst, "ram"))
	if err != nil {
		t.Fatal(err)
	}
	if disk := fi.Sys().(*syscall.Stat_t).Blocks * 512; disk > 1<<20 {
		t.Errorf("the copy takes %d bytes on disk for 12 KiB of data: its holes were filled", disk)
	}
	if fi.Mode().Perm() != 0o444 {
		t.Errorf("the copy's memory file is %v, want 0444 as saved", fi.Mode().Perm())
	}
	if fi, err := os.Stat(filepath.Join(dst, "files", "a")); err != nil || fi.Mode().Perm() != 0o644 {
		t.Errorf("a saved 0755 file's copy: %v %v, want 0644", fi.Mode(), err)
	}
}
