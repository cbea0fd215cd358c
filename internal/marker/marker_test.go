package marker

import (
	"bytes"
	"io"
	"testing"
)

// TestSinkEveryCut feeds a stream cut at every size: the run gets exactly
// what came before its marker, without the previous run's marker, and
// nothing after it.
func TestSinkEveryCut(t *testing.T) {
	stream := []byte("a<OLD>bc<NEW>after")
	for size := 1; size <= len(stream); size++ {
		var out bytes.Buffer
		m := NewSink([]byte("<NEW>"), []byte("<OLD>"), &out)
		for p := stream; len(p) > 0; {
			n := min(size, len(p))
			m.feed(p[:n])
			p = p[n:]
		}
		select {
		case <-m.Seen():
		default:
			t.Fatalf("cut %d: marker not seen", size)
		}
		if out.String() != "abc" {
			t.Errorf("cut %d: %q, want %q", size, out.String(), "abc")
		}
	}
}

func TestSinkFlushWithoutMarker(t *testing.T) {
	var out bytes.Buffer
	m := NewSink([]byte("<NEW>"), nil, &out)
	m.feed([]byte("xy<NE"))
	if out.String() != "xy" {
		t.Fatalf("before flush: %q", out.String())
	}
	m.Flush()
	if out.String() != "xy<NE" {
		t.Fatalf("after flush: %q", out.String())
	}
}

func TestRouterDropsBetweenRuns(t *testing.T) {
	r, w := io.Pipe()
	sr := NewRouter(r)
	var out bytes.Buffer
	m := NewSink([]byte("!"), nil, &out)
	sr.Set(m)
	w.Write([]byte("run!late"))
	<-m.Seen()
	sr.Set(nil)
	w.Write([]byte("between"))
	w.Close()
	<-sr.EOF()
	if out.String() != "run" {
		t.Fatalf("the run got %q", out.String())
	}
}
