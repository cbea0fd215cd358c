// Package wire is the framed protocol between moat (the host) and its guest
// agent, spoken over one virtio-serial port.
//
// A frame is a one-byte kind, a four-byte big-endian payload length and the
// payload. A VM restored from the template serves either one run or one
// session. One run:
//
//	guest → host  Hello    the agent is ready (sent once, at boot, before the
//	                       template is saved)
//	host → guest  Refresh  the time and fresh randomness, as soon as the VM
//	                       is restored (it then waits in the host's pool)
//	guest → host  Idle     the agent has reseeded the guest and started the
//	                       run's python3 afresh, after the reseed
//	host → guest  Run      the code, the limits, the time and fresh randomness
//	guest → host  Started  python3 runs the code
//	guest → host  Stdout, Stderr   output chunks, as they come
//	guest → host  Exit     the evidence of how the code ended
//	guest → host  Fail     the agent could not do what was asked
//
// A session begins with Session (the time, randomness, the disk limit),
// which the agent answers with Idle; then any number of Runs, each answered
// as above and followed by Idle once the agent has made the next run's
// python3 ready (the host pauses the VM then), and file operations (File,
// with Data frames for a write's contents) answered by FileReply (with Data
// frames for a read's). Kill asks the agent to end the run in progress.
// Refresh (the time and fresh randomness, as in Session) comes first to a
// session's VM restored from its own saved state (a suspended session, or
// one of its forks), and the agent answers it with Idle.
//
// Refresh, Session, and a Run that comes first each tell the agent that
// the VM is a new copy of a saved state: the python3 waiting in that state
// (and in every other copy of it) holds one string hash secret, so the
// agent replaces it with one started after the reseed before any code runs
// — except a session's live interpreter that has run code, which is the
// session's memory.
//
// The payloads of Hello, Run, Session, Exit, File and FileReply are JSON;
// Refresh is JSON too; Stdout and Stderr are raw bytes; Data is an 8-byte big-endian operation
// id and raw bytes; Fail is text; Started, Kill and Idle are empty.
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
	KindSession Kind = 'P'
	KindIdle    Kind = 'I'
	KindKill    Kind = 'K'
	KindFile    Kind = 'Q'
	KindReply   Kind = 'A'
	KindData    Kind = 'D'
	KindRefresh Kind = 'T'
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
	case KindSession:
		return "session"
	case KindIdle:
		return "idle"
	case KindKill:
		return "kill"
	case KindFile:
		return "file"
	case KindReply:
		return "reply"
	case KindData:
		return "data"
	case KindRefresh:
		return "refresh"
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
	// Net says how the agent configured the VM's network device, "" when
	// the VM has none.
	Net string `json:"net,omitempty"`
}

// Egress is what the code of a VM with a network gets besides the network
// itself: the environment the egress proxy's run gives it (the proxy's
// address, the CA bundle's path, the secrets' placeholders) and the CA
// bundle, which the agent places read-only at /etc/moat/ca.pem.
type Egress struct {
	Env      []string `json:"env,omitempty"`
	CABundle string   `json:"ca_bundle,omitempty"`
}

// Run asks the agent to run code once. The wall time is the host's to
// keep: it kills the VM (one run) or sends Kill (a session) when it passes.
type Run struct {
	Code []byte `json:"code"`
	// UnixNano is the host's wall clock; the agent sets the guest's.
	UnixNano int64 `json:"unix_nano"`
	// Seed is fresh randomness from the host; the agent mixes it into the
	// guest's pool and reseeds the kernel's generator, so that clones of
	// one template do not share their random numbers.
	Seed []byte `json:"seed"`

	CPUMS     int64 `json:"cpu_ms"`
	Memory    int64 `json:"memory"`
	Pids      int64 `json:"pids"`
	FileSize  int64 `json:"file_size"`
	Disk      int64 `json:"disk"`
	OpenFiles int64 `json:"open_files"`
	// Egress, in the one Run of a VM with a network, is its code's; a
	// session's comes in its Session.
	Egress *Egress `json:"egress,omitempty"`
}

// Session makes the VM a session's: the agent sizes the writable layer to
// Disk once, keeps the working directory from run to run and serves Runs
// and file operations until the VM is killed.
type Session struct {
	UnixNano int64  `json:"unix_nano"`
	Seed     []byte `json:"seed"`
	Disk     int64  `json:"disk"`
	FileSize int64  `json:"file_size"`
	// Interpreter keeps one python3 alive from run to run, its globals
	// kept; a run that ends it (a kill, os._exit) makes the next run's a
	// fresh one.
	Interpreter bool `json:"interpreter,omitempty"`
	// Egress, for a VM with a network, is every run's.
	Egress *Egress `json:"egress,omitempty"`
}

// Refresh sets the guest's clock and reseeds its random generator, in a VM
// just restored from the template (before its one Run) or from a session's
// saved state: the state holds the time and the random state of the moment
// it was saved, and a python3 started before, the same in every VM
// restored from it.
type Refresh struct {
	UnixNano int64  `json:"unix_nano"`
	Seed     []byte `json:"seed"`
}

// Exit is the evidence of how a run ended, as the agent saw it from outside
// the code: python3's wait status and what the run's cgroup and files show.
// The host decides the reason from it. Exactly one of ExitCode and Signal
// describes the status: Signal is 0 when python3 exited by itself (with
// ExitCode 0..255), and ExitCode is 0 when a signal (1..64) ended it.
type Exit struct {
	ExitCode int `json:"exit_code"`
	Signal   int `json:"signal,omitempty"`
	// CPU: the agent's CPU watch killed the run at its CPU time, or
	// RLIMIT_CPU's SIGKILL came with the cgroup past it.
	CPU bool `json:"cpu,omitempty"`
	// OOM: the memory cgroup killed a process of the run.
	OOM bool `json:"oom,omitempty"`
	// Pids: the pids cgroup refused a fork or a thread.
	Pids bool `json:"pids,omitempty"`
	// FileSize: a file the run changed reached the file size limit.
	FileSize bool `json:"file_size,omitempty"`
	// Disk: the writable layer has no space or no inode left.
	Disk bool `json:"disk,omitempty"`
	// CPUMS and WallMS are what the run used.
	CPUMS  int64 `json:"cpu_ms"`
	WallMS int64 `json:"wall_ms"`
	// Only in a session with a live interpreter: Fresh says the run had a
	// new interpreter, not the one the previous run left (which had
	// ended); Ended says the interpreter ended with the run, so that the
	// next run gets a fresh one.
	Fresh bool `json:"fresh,omitempty"`
	Ended bool `json:"ended,omitempty"`
}

// The file operations of a session, in File.Op. Names are relative to the
// working directory, checked by the host; the agent resolves them beneath
// it and never follows a symbolic link.
const (
	OpStat   = "stat"   // FileReply.Info
	OpList   = "list"   // FileReply.Entries, over several replies (More)
	OpRead   = "read"   // a reply with Size and More, Data frames, a last reply
	OpMkdir  = "mkdir"  // with the missing parents
	OpRename = "rename" // Name to To
	OpRemove = "remove" // a file, a link itself, or an empty directory
	OpWrite  = "write"  // opens a new file beside Name; Data frames follow
	OpCommit = "commit" // the write of ID is complete: move it onto Name
	OpAbort  = "abort"  // the write of ID is dropped
)

// File asks the agent for one file operation. Every operation but write
// and abort gets exactly one last FileReply (More false) with its ID; write
// is answered at its commit.
type File struct {
	ID   uint64 `json:"id"`
	Op   string `json:"op"`
	Name string `json:"name,omitempty"`
	To   string `json:"to,omitempty"`
}

// FileReply answers a File. Errno is the error number of what failed (0:
// none), which the host maps to moat's error classes.
type FileReply struct {
	ID      uint64      `json:"id"`
	Errno   int         `json:"errno,omitempty"`
	Info    *FileEntry  `json:"info,omitempty"`
	Entries []FileEntry `json:"entries,omitempty"`
	// Size is a read file's size when it was opened: the Data that
	// follows holds at most that much.
	Size int64 `json:"size,omitempty"`
	// More says further replies to ID follow.
	More bool `json:"more,omitempty"`
}

// FileEntry describes one file, as Go's fs.FileMode and the modification
// time in nanoseconds since 1970.
type FileEntry struct {
	Name    string `json:"name"`
	Size    int64  `json:"size"`
	Mode    uint32 `json:"mode"`
	ModNano int64  `json:"mod_nano"`
}

// MaxData is the most file content one Data frame carries, so that a
// frame from the guest stays within MaxReport.
const MaxData = MaxReport - 8

// DataID splits a Data payload into its operation id and bytes.
func DataID(p []byte) (uint64, []byte, error) {
	if len(p) < 8 {
		return 0, nil, fmt.Errorf("wire: data frame of %d bytes has no id", len(p))
	}
	return binary.BigEndian.Uint64(p[:8]), p[8:], nil
}

// DataPayload is the payload of a Data frame of operation id.
func DataPayload(id uint64, b []byte) []byte {
	p := make([]byte, 8+len(b))
	binary.BigEndian.PutUint64(p, id)
	copy(p[8:], b)
	return p
}
