package wire

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

func TestRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	frames := []struct {
		k Kind
		p []byte
	}{
		{KindHello, []byte(`{"kernel":"6.1"}`)},
		{KindStarted, nil},
		{KindStdout, []byte("\xff\x00out")},
		{KindStderr, bytes.Repeat([]byte("e"), 70000)},
		{KindExit, []byte(`{"exit_code":3}`)},
	}
	for _, f := range frames {
		if err := Write(&buf, f.k, f.p); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range frames {
		k, p, err := Read(&buf, 0)
		if err != nil || k != f.k || !bytes.Equal(p, f.p) {
			t.Fatalf("Read = %s, %d bytes, %v; want %s, %d bytes", k, len(p), err, f.k, len(f.p))
		}
	}
	if _, _, err := Read(&buf, 0); err != io.EOF {
		t.Errorf("Read at the end = %v, want io.EOF", err)
	}
}

func TestReadErrors(t *testing.T) {
	var buf bytes.Buffer
	Write(&buf, KindStdout, []byte("0123456789"))
	whole := buf.Bytes()
	if _, _, err := Read(bytes.NewReader(whole[:8]), 0); err != io.ErrUnexpectedEOF {
		t.Errorf("a frame cut short: %v, want io.ErrUnexpectedEOF", err)
	}
	if _, _, err := Read(bytes.NewReader(whole[:3]), 0); err != io.ErrUnexpectedEOF {
		t.Errorf("a header cut short: %v, want io.ErrUnexpectedEOF", err)
	}
	if _, _, err := Read(bytes.NewReader(whole), 9); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a frame over the limit: %v, want ErrTooLarge", err)
	}
	if err := Write(io.Discard, KindRun, make([]byte, MaxPayload+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("writing a frame over MaxPayload: %v, want ErrTooLarge", err)
	}
}

// The largest code a Run may carry fits in a frame with every limit at its
// widest, and a little more code does not.
func TestMaxCode(t *testing.T) {
	r := Run{Seed: make([]byte, 64), UnixNano: -1 << 63, CPUMS: -1 << 63, Memory: -1 << 63,
		Pids: -1 << 63, FileSize: -1 << 63, Disk: -1 << 63, OpenFiles: -1 << 63}
	r.Code = make([]byte, MaxCode)
	if err := WriteJSON(io.Discard, KindRun, r); err != nil {
		t.Errorf("a run of MaxCode bytes of code: %v", err)
	}
	r.Code = make([]byte, MaxPayload/4*3+1)
	if err := WriteJSON(io.Discard, KindRun, r); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a run whose base64 code passes MaxPayload: %v, want ErrTooLarge", err)
	}
}

// FuzzRead checks that any bytes from the guest (which runs hostile code)
// give a frame or an error, never a panic or an allocation past the limit,
// and that a frame read re-encodes to the bytes it came from.
func FuzzRead(f *testing.F) {
	var seed bytes.Buffer
	Write(&seed, KindExit, []byte(`{"exit_code":0}`))
	f.Add(seed.Bytes())
	f.Add([]byte{'O', 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		k, p, err := Read(bytes.NewReader(data), 1<<16)
		if err != nil {
			return
		}
		if len(p) > 1<<16 {
			t.Fatalf("payload of %d bytes past the limit", len(p))
		}
		var again bytes.Buffer
		Write(&again, k, p)
		if !bytes.HasPrefix(data, again.Bytes()) {
			t.Fatalf("frame %s of %d bytes does not re-encode to its input", k, len(p))
		}
	})
}

// A Data frame carries its operation's id before the bytes, and one from
// the guest holding MaxData bytes stays within MaxReport.
func TestData(t *testing.T) {
	p := DataPayload(0x0102030405060708, []byte("abc"))
	id, b, err := DataID(p)
	if err != nil || id != 0x0102030405060708 || string(b) != "abc" {
		t.Errorf("DataID = %#x, %q, %v", id, b, err)
	}
	if _, _, err := DataID(p[:7]); err == nil {
		t.Errorf("DataID of 7 bytes: no error")
	}
	if n := len(DataPayload(1, make([]byte, MaxData))); n != MaxReport {
		t.Errorf("a Data payload of MaxData bytes is %d bytes, want MaxReport (%d)", n, MaxReport)
	}
}
