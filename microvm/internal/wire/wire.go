// Package wire is the framed protocol between moat (the host) and its guest
// agent, spoken over one virtio-serial port.
//
// A frame is a one-byte kind, a four-byte big-endian payload length and the
// payload. The conversation of one VM:
//
//	guest → host  Hello    the agent is ready (sent once, at boot, before the
//	                       template is saved)
//	host → guest  Run      the code, the limits, the time and fresh randomness
//	guest → host  Started  python3 runs
//	guest → host  Stdout, Stderr   output chunks, as they come
//	guest → host  Exit     how the code ended
//	guest → host  Fail     the agent could not do what was asked
//
// The payloads of Hello, Run and Exit are JSON; Stdout and Stderr are raw
// bytes; Fail is text. A VM serves one Run and is then thrown away.
package wire

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Kind says what a frame carries.
type Kind byte

// The frame kinds.
const (
	KindHello   Kind = 'H'
	KindRun     Kind = 'R'
	KindStarted Kind = 'S'
	KindStdout  Kind = 'O'
	KindStderr  Kind = 'E'
	KindExit    Kind = 'X'
	KindFail    Kind = 'F'
)

func (k Kind) String() string {
	switch k {
	case KindHello:
		return "hello"
	case KindRun:
		return "run"
	case KindStarted:
		return "started"
	case KindStdout:
		return "stdout"
	case KindStderr:
		return "stderr"
	case KindExit:
		return "exit"
	case KindFail:
		return "fail"
	}
	return fmt.Sprintf("kind(%#x)", byte(k))
}

// MaxPayload is the largest payload either side accepts. It bounds the code
// of one run (see [MaxCode]).
const MaxPayload = 32 << 20

// MaxCode is the most code one Run carries: the Run frame is JSON, in which
// the code is base64 (4 bytes for every 3), and the rest of the frame needs
// a little room.
const MaxCode = (MaxPayload - 64<<10) / 4 * 3

// MaxReport is the largest payload the host accepts from the guest, and so
// the most output the agent puts in one Stdout or Stderr frame. The guest
// runs hostile code and may be compromised: a frame it sends must not make
// the host allocate more than this. Hello, Exit and Fail are far smaller.
const MaxReport = 64 << 10

// ErrTooLarge is returned for a frame whose payload passes the reader's
// limit.
var ErrTooLarge = errors.New("wire: frame too large")

// Write writes one frame. It is one Write call on w, so that frames from one
// goroutine at a time never interleave.
func Write(w io.Writer, k Kind, payload []byte) error {
	if len(payload) > MaxPayload {
		return fmt.Errorf("%w: %d bytes", ErrTooLarge, len(payload))
	}
	buf := make([]byte, 5+len(payload))
	buf[0] = byte(k)
	binary.BigEndian.PutUint32(buf[1:5], uint32(len(payload)))
	copy(buf[5:], payload)
	_, err := w.Write(buf)
	return err
}

// WriteJSON writes one frame whose payload is v as JSON.
func WriteJSON(w io.Writer, k Kind, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("wire: %w", err)
	}
	return Write(w, k, b)
}

// Read reads one frame whose payload is at most max bytes (0 means
// [MaxPayload]). A stream that ends between frames gives io.EOF; one that
// ends inside a frame gives io.ErrUnexpectedEOF.
func Read(r io.Reader, max int) (Kind, []byte, error) {
	if max <= 0 || max > MaxPayload {
		max = MaxPayload
	}
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if uint64(n) > uint64(max) {
		return 0, nil, fmt.Errorf("%w: %s frame of %d bytes, limit %d", ErrTooLarge, Kind(hdr[0]), n, max)
	}
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return Kind(hdr[0]), p, nil
}

// Hello is what the agent says once it is ready.
type Hello struct {
	// Kernel is the guest kernel's release (uname -r).
	Kernel string `json:"kernel"`
	// BootMS is how long the guest took from kernel start to ready, by its
	// own monotonic clock.
	BootMS int64 `json:"boot_ms"`
}

// Run asks the agent to run code once.
type Run struct {
	Code []byte `json:"code"`
	// UnixNano is the host's wall clock; the agent sets the guest's.
	UnixNano int64 `json:"unix_nano"`
	// Seed is fresh randomness from the host; the agent mixes it into the
	// guest's pool and reseeds the kernel's generator, so that clones of
	// one template do not share their random numbers.
	Seed []byte `json:"seed"`

	WallMS    int64 `json:"wall_ms"`
	CPUMS     int64 `json:"cpu_ms"`
	Memory    int64 `json:"memory"`
	Pids      int64 `json:"pids"`
	FileSize  int64 `json:"file_size"`
	Disk      int64 `json:"disk"`
	OpenFiles int64 `json:"open_files"`
}

// Exit says how the code ended. Reason uses moat's reason names, for the
// reasons the guest can see (timeout, memory, pids, filesize, disk,
// signal); the host adds output and canceled.
type Exit struct {
	ExitCode int    `json:"exit_code"`
	Signal   int    `json:"signal,omitempty"`
	Reason   string `json:"reason,omitempty"`
	CPUMS    int64  `json:"cpu_ms"`
	WallMS   int64  `json:"wall_ms"`
}
