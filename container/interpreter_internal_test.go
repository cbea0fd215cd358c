package container

import (
	"bytes"
	"strings"
	"testing"
)

// TestRouter: the router passes a run's output up to its marker, however
// the stream is cut, reads the status after it, drops a late marker of the
// previous run, and hands what comes between runs to the next.
func TestRouter(t *testing.T) {
	mark := func(c byte) []byte { return append(bytes.Clone(markPrefix), strings.Repeat(string(c), nonceLen)...) }
	a, b := mark('a'), mark('b')
	stream := string("out\x00MOA") + "T-not-a-marker " + string(a) + " 7\n" + "between " + string(a) + " 0\n" + "more" + string(b) + " 3\n" + "tail"
	for _, size := range []int{1, 2, 5, 36, 1000} {
		r := &router{status: true}
		var first, second bytes.Buffer
		ends := 0
		r.set(&first, a, nil, func() { ends++ })
		s := []byte(stream)
		for len(s) > 0 && ends == 0 {
			n := min(size, len(s))
			r.Write(s[:n])
			s = s[n:]
		}
		if got := first.String(); got != "out\x00MOAT-not-a-marker " || ends != 1 || r.exitCode() != 7 {
			t.Fatalf("cut in %d: the first run got %q, %d ends, status %d", size, got, ends, r.exitCode())
		}
		r.Write(s[:min(len("between "), len(s))]) // between runs
		s = s[min(len("between "), len(s)):]
		r.set(&second, b, a, func() { ends++ })
		for len(s) > 0 {
			n := min(size, len(s))
			r.Write(s[:n])
			s = s[n:]
		}
		if got := second.String(); got != "between more" || ends != 2 || r.exitCode() != 3 {
			t.Errorf("cut in %d: the second run got %q, %d ends, status %d; want the output between runs, the late marker dropped", size, got, ends, r.exitCode())
		}
	}
}
