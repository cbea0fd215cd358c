package engine

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// digestChunked names the digest of a manifest written by this version:
// SHA-256 over the SHA-256 of each 1 MiB chunk of the file, in order. A
// chunk the file system holds as a hole is not read: its digest is that of
// zeros, which is what reading it would give. The digest is of the file's
// bytes only, whatever its holes: a copy that fills them or makes more
// (cp --sparse) has the same one. A state's memory file (a VM's RAM, its
// nominal size the guest's, mostly holes) is checked at the cost of its
// data, not of its size.
const digestChunked = "sha256-chunks-1MiB"

const digestChunk = 1 << 20

// zeroChunk is the digest of a whole chunk of zeros, computed when first
// needed: as a package variable it would cost every process that links the
// engine (each subprocess helper, a re-exec of moat) a 1 MiB allocation and
// its hash at start.
var zeroChunk = sync.OnceValue(func() [sha256.Size]byte { return sha256.Sum256(make([]byte, digestChunk)) })

// digest returns p's size and its digest (digestChunked) and the bytes it
// takes on disk.
func digest(p string) (size int64, sum string, disk int64, err error) {
	f, err := os.Open(p)
	if err != nil {
		return 0, "", 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, "", 0, err
	}
	size = fi.Size()
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		disk = min(st.Blocks*512, size)
	} else {
		disk = size
	}
	top := sha256.New()
	buf := make([]byte, digestChunk)
	// data is the start of the next data at or after the current chunk,
	// or size when only holes are left.
	data := int64(-1)
	for off := int64(0); off < size; off += digestChunk {
		n := min(int64(digestChunk), size-off)
		if data < off {
			d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
			switch {
			case errors.Is(err, unix.ENXIO):
				d = size
			case err != nil:
				d = off // no SEEK_DATA here: read everything
			}
			data = d
		}
		if data >= off+n {
			if n == digestChunk {
				z := zeroChunk()
				top.Write(z[:])
			} else {
				s := sha256.Sum256(make([]byte, n))
				top.Write(s[:])
			}
			continue
		}
		if _, err := f.ReadAt(buf[:n], off); err != nil && !(errors.Is(err, io.EOF) && off+n == size) {
			return 0, "", 0, err
		}
		s := sha256.Sum256(buf[:n])
		top.Write(s[:])
	}
	return size, hex.EncodeToString(top.Sum(nil)), disk, nil
}

// digestWhole is the digest of a manifest without a digest name (states
// saved before digestChunked): SHA-256 of the whole file.
func digestWhole(p string) (int64, string, error) {
	f, err := os.Open(p)
	if err != nil {
		return 0, "", err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return 0, "", err
	}
	return n, hex.EncodeToString(h.Sum(nil)), nil
}
