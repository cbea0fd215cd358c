package helper

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The reaper: what the helper becomes once python3 runs.
//
// After it has started python3, the helper has one job left, the init's: to
// reap every process of the run's PID namespace until python3 ends, then
// kill and reap the rest, close its ends of the output and report python3's
// wait status and resource usage on its status pipe (helper.go). Done by the
// Go helper itself, that job kept a Go runtime alive for the run's whole
// life: about 2.7 MiB of private memory (the heap of every package's init in
// moat's binary, stacks, the runtime's own) and five threads, for each idle
// session's interpreter and each pooled run. So the helper execs a program
// of a few hundred bytes that does the same and nothing else, the reaper,
// whose whole cost is a process with a page of stack.
//
// The reaper is a static ELF executable written by hand (its source, with
// how to rebuild it, is testdata/reaper_amd64.S; TestReaperMatchesSource
// checks the bytes against it). The helper writes it into a sealed memfd
// before it restricts itself, so that no file of the host is involved and
// the code cannot reach it, and execs it as the last thing it does, as the
// same init of the same namespaces under the same restrictions (its uid,
// cgroups, rlimits, no_new_privs, Landlock, seccomp, root), with
// python3's pid as its argument. What moat sees is unchanged: the same
// process (pid, cgroup, Pdeathsig), the same end of the output, the same
// report, the wait status the kernel gave a process outside the code's
// reach. Where there is no reaper (an architecture without one) or the exec
// fails (a kernel refusing to exec a memfd), the Go helper does the job
// itself, as before: only the memory differs.

// ReaperArg0 is the reaper's argv[0]; argv[1] is python3's pid.
const ReaperArg0 = "moat-reaper"

// The report, on the status pipe, once python3 has ended:
//
//	[0, 8)        reportMagic
//	[8, 12)       the wait status (int32, native byte order)
//	[12, 16)      zero
//	[16, ReportLen) struct rusage, as wait4(2) filled it
//
// It is binary because the reaper, which writes it, does not format
// numbers; the Go helper writes the same.
const reportMagic = "moatend\n"

var ReportLen = 16 + int(unsafe.Sizeof(syscall.Rusage{}))

// EncodeReport is the report of python3's end with status ws and usage ru.
func EncodeReport(ws syscall.WaitStatus, ru *syscall.Rusage) []byte {
	b := make([]byte, ReportLen)
	copy(b, reportMagic)
	binary.NativeEndian.PutUint32(b[8:], uint32(ws))
	copy(b[16:], unsafe.Slice((*byte)(unsafe.Pointer(ru)), unsafe.Sizeof(*ru)))
	return b
}

// DecodeReport reads a report; ok is false if b is not one.
func DecodeReport(b []byte) (ws syscall.WaitStatus, ru syscall.Rusage, ok bool) {
	if len(b) != ReportLen || string(b[:len(reportMagic)]) != reportMagic {
		return 0, ru, false
	}
	ws = syscall.WaitStatus(binary.NativeEndian.Uint32(b[8:]))
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&ru)), unsafe.Sizeof(ru)), b[16:])
	return ws, ru, true
}

// loadReaper writes the reaper into a sealed memfd and returns a read-only
// descriptor of it (close-on-exec), or -1 when there is none for this
// architecture or it cannot be made. It must run before the helper
// restricts itself and enters the run's root: it reopens the memfd through
// the host's /proc.
func loadReaper() int {
	if len(ReaperELF) == 0 {
		return -1
	}
	// MFD_EXEC: executable even where vm.memfd_noexec seals memfds
	// against it by default; kernels before 6.3 do not know the flag.
	fd, err := unix.MemfdCreate(ReaperArg0, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_EXEC)
	if err == unix.EINVAL {
		fd, err = unix.MemfdCreate(ReaperArg0, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	}
	if err != nil {
		return -1
	}
	defer unix.Close(fd)
	if n, err := unix.Write(fd, ReaperELF); err != nil || n != len(ReaperELF) {
		return -1
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SEAL|unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE); err != nil {
		return -1
	}
	// A file open for writing cannot be executed (ETXTBSY): the exec
	// goes through a read-only descriptor of its own.
	ro, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1
	}
	// Executable, not readable, by its owner: an exec by a process that
	// cannot read the file leaves the new program non-dumpable (execReaper
	// drops the capabilities that read it anyway), so the reaper's
	// descriptors, memory and ptrace are not open to the code's uid where
	// that is the helper's (hardening=tutorial).
	if err := unix.Fchmod(ro, 0o100); err != nil {
		unix.Close(ro)
		return -1
	}
	return ro
}

// dropReadCaps drops, from the calling thread's effective set, the
// capabilities that let it read a file its mode does not (CAP_DAC_OVERRIDE,
// CAP_DAC_READ_SEARCH).
func dropReadCaps() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("subprocess: capget: %w", err)
	}
	data[0].Effective &^= 1<<unix.CAP_DAC_OVERRIDE | 1<<unix.CAP_DAC_READ_SEARCH
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("subprocess: capset: %w", err)
	}
	return nil
}

// reaperCaps are the only capabilities the reaper keeps: CAP_KILL, for
// kill(-1, SIGKILL) of the run's processes, which run under another uid.
// Waiting, closing and writing its own descriptors need none.
const reaperCaps = 1 << unix.CAP_KILL

// dropBoundingExcept drops every capability but those of keep from the
// bounding set, which bounds what a root exec grants: the helper itself
// keeps what it holds, the program it execs gets keep at most.
func dropBoundingExcept(keep uint64) error {
	for c := 0; c < 64; c++ {
		if keep&(1<<c) != 0 {
			continue
		}
		err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0)
		if err == unix.EINVAL { // past the kernel's last capability
			return nil
		}
		if err != nil {
			return fmt.Errorf("subprocess: drop capability %d from the bounding set: %w", c, err)
		}
	}
	return nil
}

// execReaper makes the helper the reaper of python3 (pid): it returns only
// if the exec failed, with the helper as it was but for its bounding set.
// The reaper holds CAP_KILL alone (reaperCaps), not the helper's root
// capabilities: if the code ever reached it, it would find nothing else.
func execReaper(fd, pid int) error {
	// Only a root exec grants capabilities (the memfd has no file
	// capabilities); a helper that is not root holds none to drop.
	if unix.Geteuid() == 0 {
		if err := dropBoundingExcept(reaperCaps); err != nil {
			return err
		}
	}
	if err := dropReadCaps(); err != nil {
		return err
	}
	// The status pipe is the reaper's fd 3; every other descriptor above
	// 2 is close-on-exec (closeOnExecFrom).
	if _, err := unix.FcntlInt(StatusFD, unix.F_SETFD, 0); err != nil {
		return err
	}
	err := syscall.Exec(fmt.Sprintf("/proc/self/fd/%d", fd), []string{ReaperArg0, strconv.Itoa(pid)}, []string{})
	unix.FcntlInt(StatusFD, unix.F_SETFD, unix.FD_CLOEXEC)
	return err
}
