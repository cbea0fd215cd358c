package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
)

// lseek's whence values for sparse files (Linux).
const (
	seekData = 3
	seekHole = 4
)

// Guest memory shared copy-on-write. With a QEMU whose memory-backend-file
// takes readonly=on (QEMU.SharedRAM), a saved VM is two files: its RAM,
// a sparse file of the guest's memory size, and a migration stream of its
// devices alone. The VM that is saved had the RAM file mapped shared
// (share=on) and so wrote its memory into it; its migration, with
// x-ignore-shared, leaves that RAM out of the stream. Once the VM is gone
// the file becomes root's, mode 0444, synced, and no VM uid can write it
// again. Every VM restored from it gets the file as a descriptor moat
// opened read-only and maps it share=off,readonly=on,rom=off: private,
// copy-on-write. The pages it only reads are the page cache's, one copy
// for every VM of that state; the pages it writes are its own. A VM never
// writes the file: its descriptor and its reopening through /proc are
// read-only, the kernel refusing a write open of a 0444 root file to
// any other uid.

// ramFile is the RAM file's name in a template's or a saved state's
// directory.
const ramFile = "ram"

// qemuSharedRAM says whether bin's memory-backend-file takes readonly and
// rom (QEMU 8.2 and later), which a copy-on-write mapping of a read-only
// file needs.
func qemuSharedRAM(ctx context.Context, bin string) bool {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-object", "memory-backend-file,help")
	cmd.Env = []string{}
	out, _ := cmd.CombinedOutput()
	var ro, rom bool
	for _, l := range strings.Split(string(out), "\n") {
		l = strings.TrimSpace(l)
		ro = ro || strings.HasPrefix(l, "readonly=")
		rom = rom || strings.HasPrefix(l, "rom=")
	}
	return ro && rom
}

// protectedHardlinks is the sysctl fs.protected_hardlinks, by which the
// kernel refuses a hard link to a file whose caller neither owns it nor
// may write it. A sealed RAM file is readable by the VMs that map it (and
// the template's by every uid): without the sysctl any VM's uid could link
// the template's file, or a fork its state's (linkat of /proc/self/fd/N),
// into a directory of its own. checkRAM refuses a file with two links, so
// no sandbox could use that template or state again until an operator
// removed the link, and the state's memory would be readable there.
var protectedHardlinks = "/proc/sys/fs/protected_hardlinks"

// ramSharing says whether VMs restored from one saved state may share its
// RAM file here: bin maps one read-only (qemuSharedRAM) and the kernel
// protects hard links. When not, it says why, and each VM copies the
// memory (the path of QEMU 7.2).
func ramSharing(ctx context.Context, bin string) (bool, string) {
	if !qemuSharedRAM(ctx, bin) {
		return false, "it cannot map a read-only memory file: QEMU 8.2 or later can"
	}
	b, err := os.ReadFile(protectedHardlinks)
	if err != nil || strings.TrimSpace(string(b)) != "1" {
		return false, "fs.protected_hardlinks is not 1 (" + strings.TrimSpace(string(b)) + "): any uid could hard-link a sealed RAM file"
	}
	return true, ""
}

// createRAM creates the RAM file of a VM that writes it (a template's
// boot, a state's conversion), owned by uid while the VM runs.
func createRAM(path string, uid, gid int) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("microvm: ram file: %w", err)
	}
	if err := f.Chown(uid, gid); err != nil {
		f.Close()
		os.Remove(path)
		return nil, fmt.Errorf("microvm: ram file: %w", err)
	}
	return f, nil
}

// reclaimRAM makes a RAM file that createRAM gave to a VM's uid root's,
// mode 0400, through moat's own descriptor of it, once that VM is gone
// and before its uid is released: from then on no process of that uid
// (the next VM to lease it) can open it. 0400 is neither sealed form
// (0444, or a state's copy at 0600, see openRAM): only sealRAM makes it
// one. A file that cannot be taken back is emptied, so that sealRAM
// refuses it.
func reclaimRAM(f *os.File) {
	if f.Chown(0, 0) != nil || f.Chmod(0o400) != nil {
		f.Truncate(0)
	}
}

// sealRAM makes the RAM file that a VM, now gone, wrote root's and
// read-only for everyone (0444), and syncs it. The caller has killed
// every process of the VM's uid: none holds a descriptor of it.
func sealRAM(path string, size int64) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("microvm: ram file: %w", err)
	}
	defer f.Close()
	err = f.Chown(0, 0)
	if err == nil {
		err = f.Chmod(0o444)
	}
	if err == nil {
		err = f.Sync()
	}
	if err != nil {
		return fmt.Errorf("microvm: ram file: %w", err)
	}
	return checkRAM(f, size)
}

// openRAM opens a sealed RAM file for a restore, read-only, and checks
// that it is still sealed: a regular file of root's, mode 0444, one link.
//
// A copy of a suspended state (a server's snapshot) holds it as root's
// 0600: that is sealed too, and made 0444 here, which the VM's uid needs
// to reopen it read-only (its directory stays root's alone).
func openRAM(path string) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("microvm: restore: %w", err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err == nil &&
		st.Mode&syscall.S_IFMT == syscall.S_IFREG && st.Uid == 0 && st.Gid == 0 && st.Mode&0o7777 == 0o600 && st.Nlink == 1 {
		f.Chmod(0o444)
	}
	if err := checkRAM(f, -1); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// checkRAM refuses, with moat.ErrInvalid, a RAM file that any uid but
// root's could write or that is not size bytes long (size < 0: any).
func checkRAM(f *os.File, size int64) error {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("microvm: ram file: %w", err)
	}
	switch {
	case st.Mode&syscall.S_IFMT != syscall.S_IFREG:
		return fmt.Errorf("microvm: ram file %s is not a regular file: %w", f.Name(), moat.ErrInvalid)
	case st.Uid != 0 || st.Gid != 0 || st.Mode&0o7777 != 0o444 || st.Nlink != 1:
		return fmt.Errorf("microvm: ram file %s is not root's and read-only (uid %d, gid %d, mode %o, %d links): %w",
			f.Name(), st.Uid, st.Gid, st.Mode&0o7777, st.Nlink, moat.ErrInvalid)
	case size >= 0 && st.Size != size:
		return fmt.Errorf("microvm: ram file %s holds %d bytes, the guest's memory is %d: %w", f.Name(), st.Size, size, moat.ErrInvalid)
	}
	return nil
}

// hashSparse returns the SHA-256 of a sparse file's extents map and data,
// reading only its data extents (SEEK_DATA, SEEK_HOLE): a RAM file is
// mostly holes, which read as zeros, and the digest of (offset, length,
// bytes) for each extent plus the size identifies the same bytes. A file
// system without SEEK_DATA reads the whole file as one extent.
func hashSparse(f *os.File) (string, error) {
	st, err := f.Stat()
	if err != nil {
		return "", err
	}
	size := st.Size()
	h := sha256.New()
	fmt.Fprintf(h, "sparse v1 size=%d\n", size)
	fd := int(f.Fd())
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; {
		data, err := syscall.Seek(fd, off, seekData)
		if errors.Is(err, syscall.ENXIO) {
			break // holes to the end
		}
		if err != nil {
			return "", err
		}
		hole, err := syscall.Seek(fd, data, seekHole)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "extent %d %d\n", data, hole-data)
		if _, err := io.CopyBuffer(h, io.NewSectionReader(f, data, hole-data), buf); err != nil {
			return "", err
		}
		off = hole
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// hashFile is hashSparse of the file at path.
func hashFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	return hashSparse(f)
}

// verified remembers the files whose digest this process checked, by
// path and fileVersion: a sealed file does not change.
var verified sync.Map

// fileVersion identifies one version of a file: another file under its
// name, a write (its modification time), a truncation or growth, a hole
// punched, a change of owner, mode or links (its change time) all make
// another.
type fileVersion struct {
	dev, ino     uint64
	size         int64
	mtime, ctime syscall.Timespec
}

func versionOf(f *os.File) (fileVersion, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return fileVersion{}, fmt.Errorf("microvm: %w", err)
	}
	return fileVersion{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim, ctime: st.Ctim}, nil
}

// errChanged: a file is not the version whose digest was checked. A
// template made again (after a prune) is another version too: restore
// checks the new one's digests before it uses it.
var errChanged = fmt.Errorf("%w: changed since checked", moat.ErrInvalid)

// checkVersion refuses, with moat.ErrInvalid, a file opened for a VM that is
// not the version of it that was verified (want; nil: not checked). It is
// one fstat of the descriptor QEMU gets: a change after the digest was
// taken (verifyRAM, verifyDigest) is refused before QEMU starts, without a
// digest per VM.
func checkVersion(f *os.File, want *fileVersion) error {
	if want == nil {
		return nil
	}
	got, err := versionOf(f)
	if err != nil {
		return err
	}
	if got != *want {
		return fmt.Errorf("microvm: %s changed since its digest was checked: %w", f.Name(), errChanged)
	}
	return nil
}

// verifyRAM checks that the RAM file at path is sealed, size bytes long,
// and has the digest sum (hashSparse), once per process and file version,
// and returns the version checked: a damaged or replaced file is refused
// with moat.ErrInvalid before any VM maps it.
func verifyRAM(path string, size int64, sum string) (fileVersion, error) {
	f, err := os.Open(path)
	if err != nil {
		return fileVersion{}, fmt.Errorf("microvm: ram file: %w", err)
	}
	defer f.Close()
	if err := checkRAM(f, size); err != nil {
		return fileVersion{}, err
	}
	return verifyDigest(f, sum)
}

// verifyDigest checks that f has the digest sum (hashSparse), once per
// process and file version, and returns the version checked.
func verifyDigest(f *os.File, sum string) (fileVersion, error) {
	id, err := versionOf(f)
	if err != nil {
		return fileVersion{}, err
	}
	key := fmt.Sprintf("%s\x00%v", f.Name(), id)
	if v, ok := verified.Load(key); ok && v == sum {
		return id, nil
	}
	if sum == "" {
		return fileVersion{}, fmt.Errorf("microvm: %s has no recorded digest: %w", f.Name(), moat.ErrInvalid)
	}
	got, err := hashSparse(f)
	if err != nil {
		return fileVersion{}, fmt.Errorf("microvm: %s: %w", f.Name(), err)
	}
	if got != sum {
		return fileVersion{}, fmt.Errorf("microvm: %s is damaged (sha-256 %s, recorded %s): %w", f.Name(), got, sum, moat.ErrInvalid)
	}
	verified.Store(key, sum)
	return id, nil
}
