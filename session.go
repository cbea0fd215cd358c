package moat

import (
	"context"
	"io"
	"io/fs"
	"time"
)

// Sessioner is implemented by sandboxes that can keep state between runs: a
// working directory whose files persist from one run to the next and,
// optionally, a live interpreter. Callers find it by type assertion:
//
//	if s, ok := sb.(moat.Sessioner); ok { ... }
//
// NewSession is safe for concurrent use. The session belongs to the caller,
// who must Close it; a sandbox's Close does not close its sessions.
type Sessioner interface {
	NewSession(ctx context.Context, opts SessionOptions) (Session, error)
}

// SessionOptions configure a session. The zero value is a session with a
// persistent working directory and a fresh interpreter per run.
type SessionOptions struct {
	// Interpreter keeps one Python interpreter alive between runs, so that
	// variables, imports and definitions survive from one Run to the next,
	// as in a notebook. A run that hits a limit or times out ends that
	// interpreter; the next run starts a fresh one (the files remain).
	Interpreter bool `json:"interpreter,omitempty"`
}

// Session is state kept across runs at one isolation level: a private
// working directory and, when asked for, a live interpreter.
//
// Runs of one session are serialized: Run waits for the session's previous
// run to end. Every run gets the sandbox's limits; the disk limit covers the
// session's files as a whole. Files written by one run are there for the next
// run of the same session and for no one else.
//
// File names are slash-separated paths relative to the working directory.
// They must stay inside it: absolute paths, ".." elements and symbolic links
// (which the code may plant) that lead outside are refused with an error
// wrapping ErrInvalid, and nothing is read or written.
//
// Close kills anything still running and removes everything of the session:
// a run in progress ends as a cancelled one does (Reason [ReasonCanceled]),
// file operations in progress fail with an error wrapping ErrClosed, and so
// do later Reads of the readers ReadFile returned. It may be called more
// than once.
type Session interface {
	Run(ctx context.Context, req Request) (*Result, error)
	Files
	Close() error
}

// Files are the file operations of a session's working directory. Names
// are slash-separated paths relative to it, checked as [Session] says.
// Missing files give errors wrapping fs.ErrNotExist; names that are not
// usable (an escape, a directory where a file is wanted, a write past the
// disk or file size limit) give errors wrapping ErrInvalid, and change
// nothing.
type Files interface {
	// WriteFile creates or replaces name with the contents of r, creating
	// parent directories. It fails with an error wrapping ErrInvalid when
	// the write would pass the disk limit or the file size limit; the file
	// is then as it was.
	WriteFile(ctx context.Context, name string, r io.Reader) error
	// ReadFile returns the contents of name, a regular file. The caller
	// closes it.
	ReadFile(ctx context.Context, name string) (io.ReadCloser, error)
	// ListFiles returns the files of the working directory, recursively,
	// without following symbolic links.
	ListFiles(ctx context.Context) ([]FileInfo, error)
	// Stat describes name without following it if it is a symbolic link.
	Stat(ctx context.Context, name string) (FileInfo, error)
	// Mkdir creates the directory name and its missing parents.
	Mkdir(ctx context.Context, name string) error
	// Rename moves from to to, replacing a file at to.
	Rename(ctx context.Context, from, to string) error
	// RemoveFile removes name (a file, a symbolic link itself, or an empty
	// directory).
	RemoveFile(ctx context.Context, name string) error
}

// FileInfo describes one file of a session.
type FileInfo struct {
	Name    string      `json:"name"` // slash-separated, relative to the working directory
	Size    int64       `json:"size"`
	Mode    fs.FileMode `json:"mode"`
	ModTime time.Time   `json:"mod_time"`
	IsDir   bool        `json:"is_dir"`
}

// Suspender is implemented by sessions that can be suspended: their state
// saved on disk and everything of them that runs or holds memory ended.
//
// Suspend waits for the run in progress to end (ctx bounds the wait; the
// run is never lost), then saves the session into dir, which Suspend
// creates and which must not exist yet; its parent should be moat's own
// (mode 0700). The directory appears complete or not at all: a crash
// during Suspend leaves no dir (the session is then ended as by Close). A
// manifest in it holds every file's size and digest, which ResumeSession
// checks. Once Suspend has returned nil the session is closed (later calls
// fail with ErrClosed); on an error the session is as it was, unless the
// error wraps ErrClosed.
type Suspender interface {
	Suspend(ctx context.Context, dir string) (SuspendInfo, error)
}

// Resumer is implemented by sandboxes that can bring suspended sessions
// back. ResumeSession checks dir (written by a Suspend of a session of
// this level) against its manifest and returns a live session with its
// files and, when the SuspendInfo's Memory says so, its memory (the live
// interpreter's variables). A dir that is damaged, truncated or of another
// level is refused with an error wrapping ErrInvalid and nothing is
// started. dir is only read: one suspended state can be resumed many
// times, each a session of its own (a fork).
type Resumer interface {
	ResumeSession(ctx context.Context, dir string) (Session, SuspendInfo, error)
}

// MemoryKeeper is implemented by Resumers that can say ahead of a suspend
// whether it keeps a session's memory (a live interpreter's variables):
// what moat doctor and GET /v1/levels show.
type MemoryKeeper interface {
	SuspendKeepsMemory() bool
}

// SuspendInfo says what a suspended session kept.
type SuspendInfo struct {
	Level Level `json:"level"`
	// Interpreter says the session had a live interpreter.
	Interpreter bool `json:"interpreter"`
	// Memory says the session's memory was saved with its files: the
	// interpreter's variables come back on resume. Without it the files
	// come back and a live interpreter starts fresh.
	Memory bool `json:"memory"`
	// Files is how many files and directories were saved, and Bytes the
	// size of the state on disk.
	Files int   `json:"files"`
	Bytes int64 `json:"bytes"`
	// Notes say what was not kept (symbolic links, special files).
	Notes []string `json:"notes,omitempty"`
}
