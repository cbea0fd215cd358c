package container

import (
	"errors"
	"path"
	"strings"
	"sync"
	"syscall"
)

// The kernel logs the first fork that the pids controller refuses in each
// cgroup: "cgroup: fork rejected by pids controller in /docker/<id>". The
// record is written by the refused fork itself, before the program can do
// anything else, and stays in the kernel's log after the container and its
// cgroup are gone; so it is a host-side signal of a pids limit hit that no
// timing can lose, unlike the cgroup's own counter, which Docker removes
// with the cgroup. Reading /dev/kmsg needs root (CAP_SYSLOG); without it the
// level relies on the counter alone.
const forkRejected = "fork rejected by pids controller in "

// kmsgReader reads the kernel log from where it was when first opened.
type kmsgReader struct {
	mu      sync.Mutex      // guards refused and the reads of fd
	fd      int             // /dev/kmsg, non-blocking; a raw descriptor, out of Go's poller
	refused map[string]bool // last path element of the cgroups named
}

var (
	kmsgOnce sync.Once
	kmsgR    *kmsgReader // nil when /dev/kmsg cannot be read
)

// kernelLog returns the process's kernel log reader, opening it at the
// current end of the log on first use; nil if it cannot be read.
func kernelLog() *kmsgReader {
	kmsgOnce.Do(func() {
		fd, err := syscall.Open("/dev/kmsg", syscall.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
		if err != nil {
			return
		}
		if _, err := syscall.Seek(fd, 0, 2); err != nil { // SEEK_END: only what comes next
			syscall.Close(fd)
			return
		}
		kmsgR = &kmsgReader{fd: fd, refused: map[string]bool{}}
	})
	return kmsgR
}

// forkRefused reports whether the kernel logged a refused fork in the
// cgroup of container id, and forgets it.
func (k *kmsgReader) forkRefused(id string) bool {
	if k == nil {
		return false
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.drain()
	for _, name := range []string{id, "docker-" + id + ".scope"} {
		if k.refused[name] {
			delete(k.refused, name)
			return true
		}
	}
	return false
}

// drain reads every record logged so far. Each read returns one record;
// EAGAIN means none is left; EPIPE means records were overwritten before
// they were read, and the next read goes on with the oldest one left.
func (k *kmsgReader) drain() {
	buf := make([]byte, 8192)
	for {
		n, err := syscall.Read(k.fd, buf)
		if errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil || n <= 0 {
			return
		}
		// A record is "prio,seq,time,flags;message\n", then continuation
		// lines that start with a space.
		for _, line := range strings.Split(string(buf[:n]), "\n") {
			if _, cg, ok := strings.Cut(line, forkRejected); ok && !strings.HasPrefix(line, " ") {
				k.refused[path.Base(strings.TrimSpace(cg))] = true
			}
		}
	}
}
