package gvisor

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

// hostFilesOn is the host file operations of a session whose working
// directory is dir, without a sandbox: they need none.
func hostFilesOn(dir string) hostFiles {
	return hostFiles{&session{b: &backend{limits: moat.Limits{}.WithDefaults()}, bt: &booted{work: dir}}}
}

// TestHostListBounded: the code controls the tree ListFiles walks; a deep
// chain of directories with long names makes the listing's names grow with
// the square of its depth (each entry names all its parents), so within
// the disk's inodes it could take more of the host's memory than there is.
// The listing is refused past the same caps as sessionfiles'.
func TestHostListBounded(t *testing.T) {
	dir := t.TempDir()
	long := strings.Repeat("d", 255)
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	// Deep enough that the names add up to more than maxListBytes:
	// 256*n*n/2 bytes.
	n := 800
	for i := 0; i < n; i++ {
		if err := os.Mkdir("/proc/self/fd/"+strconv.Itoa(int(d.Fd()))+"/"+long, 0o700); err != nil {
			t.Fatal(err)
		}
		next, err := os.Open("/proc/self/fd/" + strconv.Itoa(int(d.Fd())) + "/" + long)
		d.Close()
		if err != nil {
			t.Fatal(err)
		}
		d = next
	}
	d.Close()
	list, err := hostFilesOn(dir).ListFiles(context.Background())
	if !errors.Is(err, moat.ErrInvalid) {
		total := 0
		for _, fi := range list {
			total += len(fi.Name)
		}
		t.Fatalf("listing a %d-deep tree: %d entries, %d bytes of names, err %v; want it refused with moat.ErrInvalid", n, len(list), total, err)
	}
}
