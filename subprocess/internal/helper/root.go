package helper

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// The run's own view of the filesystem (strict hardening).
//
// Landlock decides what the code may read and write, but not every way a
// path reaches something: a unix socket file is reached by connect(2) or
// sendto(2) on its path (with a socketpair end re-aimed, even without
// socket()), and stat(2) shows any inode. So the helper gives python3 a
// root of its own: in a private mount namespace, a small tmpfs holding
// read-only bind mounts of the system directories, a few device nodes, the
// run's working directory at its usual path, and a procfs of the run's own
// PID namespace. Nothing else of the host (its /run, /tmp, /var, /home, /dev,
// /sys, the other runs' directories, any socket file anywhere) exists there
// by any name, so no path can reach it, whatever Landlock's ABI governs.
// Together with the network namespace every helper gets (helperproc.go), which
// holds only a loopback that is down, abstract unix names and the host's
// interfaces are out of reach too.

// RootSpec describes the run's root. Paths are the host's; each appears at
// the same path in the new root.
type RootSpec struct {
	// Mount is an empty directory of the host on which the new root's
	// tmpfs is mounted, in the helper's private mount namespace only.
	Mount string `json:"mount"`
	// ReadOnly are directories and files bound read-only, nosuid and
	// nodev, with every mount of the host below them, and symlinks copied
	// as they are (Debian's /bin -> usr/bin). Missing ones are skipped.
	ReadOnly []string `json:"ro"`
	// Devices are device nodes bound as they are (/dev/null).
	Devices []string `json:"dev"`
	// Work is the run's working directory, bound read-write.
	Work string `json:"work"`
}

// devLinks are the usual /dev symlinks into the run's own procfs.
var devLinks = [][2]string{
	{"/dev/fd", "/proc/self/fd"},
	{"/dev/stdin", "/proc/self/fd/0"},
	{"/dev/stdout", "/proc/self/fd/1"},
	{"/dev/stderr", "/proc/self/fd/2"},
}

// enterRoot moves the calling thread into a private mount namespace whose
// root is built from r. The thread must be locked (the helper's is): mount
// namespaces and the root directory are per thread here, and python3 is
// forked from this thread.
func enterRoot(r *RootSpec) error {
	if r.Mount == "" || r.Work == "" {
		return errors.New("incomplete root spec")
	}
	// A UTS namespace of the thread's own, made here so that the host
	// name set below can never be the host's: the host's name is not the
	// run's business.
	if err := unix.Unshare(unix.CLONE_NEWUTS); err != nil {
		return fmt.Errorf("unshare UTS namespace: %w", err)
	}
	if err := unix.Sethostname([]byte("moat")); err != nil {
		return fmt.Errorf("set the run's host name: %w", err)
	}
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare mount namespace: %w", err)
	}
	// Nothing done below may reach the host's namespace.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	root := r.Mount
	if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=1m,nr_inodes=1024,mode=0755"); err != nil {
		return fmt.Errorf("mount the root's tmpfs: %w", err)
	}
	for _, p := range r.ReadOnly {
		if err := bindInto(root, p, true); err != nil {
			return err
		}
	}
	for _, p := range r.Devices {
		if err := bindInto(root, p, false); err != nil {
			return err
		}
	}
	if err := bindInto(root, r.Work, false); err != nil {
		return err
	}
	if err := mountProc(filepath.Join(root, "proc")); err != nil {
		return err
	}
	for _, l := range devLinks {
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(l[0])), 0o755); err != nil {
			return err
		}
		if err := os.Symlink(l[1], filepath.Join(root, l[0])); err != nil {
			return err
		}
	}
	// pivot_root(".", "."): the old root ends up stacked on the new one,
	// and is then detached with everything under it.
	if err := unix.Chdir(root); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the host's root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	// The skeleton itself is read-only too: the code writes only in its
	// working directory.
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("make the root read-only: %w", err)
	}
	return nil
}

// bindInto makes the host's path p appear at the same path under root: a
// symlink is copied, a directory or file is bound (read-only if ro). A
// missing p is skipped.
func bindInto(root, p string, ro bool) error {
	st, err := os.Lstat(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	dst := filepath.Join(root, p)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	switch {
	case st.Mode()&os.ModeSymlink != 0:
		target, err := os.Readlink(p)
		if err != nil {
			return err
		}
		return os.Symlink(target, dst)
	case st.IsDir():
		if err := os.Mkdir(dst, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
	default:
		f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		f.Close()
	}
	if err := unix.Mount(p, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s: %w", p, err)
	}
	if !ro {
		return nil
	}
	// Read-only, nosuid and nodev (the system directories need neither),
	// on the bind and on every mount of the host below it, which the
	// recursive bind brought along: a bind remount would change the top
	// mount only, leaving a submount under /usr writable and its device
	// nodes openable. mount_setattr (Linux 5.12, older than the Landlock
	// strict hardening requires) only adds these flags, keeping a host
	// mount's own noexec and the like.
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	if err := unix.MountSetattr(unix.AT_FDCWD, dst, unix.AT_RECURSIVE|unix.AT_SYMLINK_NOFOLLOW, &attr); err != nil {
		return fmt.Errorf("make %s and the mounts below it read-only: %w", p, err)
	}
	return nil
}

// mountProc mounts a procfs of the calling thread's PID namespace (the
// run's own: the helper is its init) that shows only processes of the
// caller's own uid (hidepid) and only the per-process entries where the
// kernel allows (subset=pid, Linux 5.8+).
func mountProc(dir string) error {
	if err := os.Mkdir(dir, 0o555); err != nil {
		return err
	}
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	err := unix.Mount("proc", dir, "proc", flags, "hidepid=invisible,subset=pid")
	if errors.Is(err, unix.EINVAL) {
		err = unix.Mount("proc", dir, "proc", flags, "hidepid=2")
	}
	if err != nil {
		return fmt.Errorf("mount the run's procfs: %w", err)
	}
	return nil
}
