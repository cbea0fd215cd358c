package subprocess

import (
	"bytes"
	"sync"
)

// loaderNoexec is what glibc's loader says (through dlopen, ctypes or an
// extension module's import) when mmap refuses to map a shared object's
// code: the file is on a noexec mount. At this level every directory the
// run may write (its working directory) is noexec, so the message means a
// shared object the run wrote or uploaded, never one of the host's.
const loaderNoexec = "failed to map segment from shared object"

// noexecNote is the note a run gets when its stderr shows loaderNoexec.
const noexecNote = "a shared object could not be loaded (" + `"` + loaderNoexec + `"` + "): the run's working directory is mounted noexec at the subprocess level, " +
	"so native code the run writes or uploads (a .so, a binary) cannot be mapped executable or run; native code must come from the host's packages " +
	"(apt install python3-numpy on the host), or run at the gvisor or microvm level, whose own kernel confines it"

// seenWriter watches a stream for one byte string, across writes, and
// remembers whether it went by. It keeps no more than the string's length
// of the stream. It is safe for concurrent use.
type seenWriter struct {
	pat []byte

	mu    sync.Mutex
	carry []byte // the last len(pat)-1 bytes written, when not seen
	seen  bool
}

func newSeenWriter(pat string) *seenWriter { return &seenWriter{pat: []byte(pat)} }

func (w *seenWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seen {
		return len(p), nil
	}
	buf := append(w.carry, p...)
	if bytes.Contains(buf, w.pat) {
		w.seen, w.carry = true, nil
		return len(p), nil
	}
	keep := min(len(buf), len(w.pat)-1)
	w.carry = append(w.carry[:0:0], buf[len(buf)-keep:]...)
	return len(p), nil
}

// Seen reports whether the string went by.
func (w *seenWriter) Seen() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seen
}

// nativeNotes are the notes the run's stderr, as watched by w, calls for.
// They are hints for the reader: they decide no verdict.
func nativeNotes(w *seenWriter) []string {
	if w != nil && w.Seen() {
		return []string{noexecNote}
	}
	return nil
}
