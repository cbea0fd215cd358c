package subprocess

import (
	"strings"
	"testing"
)

// TestSeenWriter checks that the string is found however the stream is
// cut into writes, and not found when it is not there whole.
func TestSeenWriter(t *testing.T) {
	stream := "Traceback...\nOSError: ./x.so: " + loaderNoexec + "\n"
	for cut := 1; cut <= len(stream); cut++ {
		w := newSeenWriter(loaderNoexec)
		for s := stream; s != ""; {
			n := min(cut, len(s))
			w.Write([]byte(s[:n]))
			s = s[n:]
		}
		if !w.Seen() {
			t.Fatalf("writes of %d bytes: not seen", cut)
		}
	}
	w := newSeenWriter(loaderNoexec)
	w.Write([]byte(loaderNoexec[:10]))
	w.Write([]byte(strings.Repeat("x", 100)))
	w.Write([]byte(loaderNoexec[10:]))
	if w.Seen() {
		t.Error("seen in two halves apart")
	}
	if len(w.carry) >= len(loaderNoexec) {
		t.Errorf("keeps %d bytes", len(w.carry))
	}
	if nativeNotes(w) != nil || len(nativeNotes(newSeenWriterSeen())) != 1 {
		t.Error("nativeNotes")
	}
}

func newSeenWriterSeen() *seenWriter {
	w := newSeenWriter(loaderNoexec)
	w.Write([]byte(loaderNoexec))
	return w
}
