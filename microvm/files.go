package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// A session's file operations, carried out by the agent inside the guest
// (see agent/files.go). What the guest answers is checked here: it runs
// hostile code and may be compromised.

// writeChunk is how much of a file one Data frame to the guest carries.
const writeChunk = 1 << 20

// op is one file operation in progress: its id and its replies.
type op struct {
	ss   *vmSession
	id   uint64
	s    *sink
	done func()
	name string
	kind string
	t    *time.Timer
}

// begin starts operation kind on name (and to): the VM runs until end.
func (ss *vmSession) begin(ctx context.Context, kind, name, to string) (*op, error) {
	if err := ss.acquire(ctx); err != nil {
		return nil, err
	}
	o := &op{ss: ss, id: ss.ids.Add(1), name: name, kind: kind, t: time.NewTimer(opTimeout)}
	o.s, o.done = ss.c.opSink(o.id)
	if err := ss.c.sendJSON(wire.KindFile, wire.File{ID: o.id, Op: kind, Name: name, To: to}); err != nil {
		o.end()
		return nil, err
	}
	return o, nil
}

func (o *op) end() {
	o.t.Stop()
	o.done()
	o.ss.release()
}

// bad is the error of an answer the agent does not make.
func (o *op) bad(format string, args ...any) error {
	return fmt.Errorf("microvm: %s %q: the agent's answer is not one it makes: "+format, append([]any{o.kind, o.name}, args...)...)
}

// reply waits for the operation's next frame, which must be a FileReply;
// data, when not nil, takes the Data frames before it.
func (o *op) reply(ctx context.Context, data func([]byte) error) (*wire.FileReply, error) {
	for {
		var f frame
		select {
		case f = <-o.s.ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-o.t.C:
			return nil, fmt.Errorf("microvm: %s %q: the agent did not answer within %v", o.kind, o.name, opTimeout)
		case <-o.ss.c.done:
			// What the reader delivered before it ended comes first.
			select {
			case f = <-o.s.ch:
			default:
				return nil, fmt.Errorf("microvm: %s %q: the session's VM ended (%v)", o.kind, o.name, o.ss.c.ended())
			}
		}
		if f.kind == wire.KindData {
			_, b, _ := wire.DataID(f.payload)
			if data == nil {
				return nil, o.bad("data")
			}
			if err := data(b); err != nil {
				return nil, err
			}
			continue
		}
		var r wire.FileReply
		dec := json.NewDecoder(bytes.NewReader(f.payload))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&r); err != nil {
			return nil, o.bad("%v", err)
		}
		if r.Errno != 0 && (r.More || r.Info != nil || len(r.Entries) > 0 || r.Size != 0) {
			return nil, o.bad("an error with a result")
		}
		if r.Errno != 0 {
			return nil, o.errno(r.Errno)
		}
		return &r, nil
	}
}

// errno maps the agent's error number to moat's error classes.
func (o *op) errno(n int) error {
	if n < 0 || n > 4095 {
		return o.bad("errno %d", n)
	}
	e := syscall.Errno(n)
	prefix := fmt.Sprintf("microvm: %s %q", o.kind, o.name)
	switch e {
	case syscall.ENOENT:
		return fmt.Errorf("%s: %w", prefix, fs.ErrNotExist)
	case syscall.ENOSPC, syscall.EDQUOT:
		return fmt.Errorf("%s: the session's disk limit is reached: %w", prefix, moat.ErrInvalid)
	case syscall.EFBIG:
		return fmt.Errorf("%s: larger than the file size limit: %w", prefix, moat.ErrInvalid)
	case syscall.ELOOP:
		return fmt.Errorf("%s: a symbolic link is in the way (links are never followed): %w", prefix, moat.ErrInvalid)
	case syscall.ENOTDIR, syscall.EISDIR, syscall.ENOTEMPTY, syscall.EEXIST, syscall.EINVAL, syscall.EXDEV,
		syscall.ENAMETOOLONG, syscall.EACCES, syscall.EPERM, syscall.EBUSY, syscall.EMLINK, syscall.ETXTBSY:
		return fmt.Errorf("%s: %v: %w", prefix, e, moat.ErrInvalid)
	}
	return fmt.Errorf("%s: %v", prefix, e)
}

// maxSize is the largest a file of the session can be: the disk limit, or
// a sparse file up to the file size limit.
func (ss *vmSession) maxSize() int64 {
	return max(int64(ss.b.limits.Disk), int64(ss.b.limits.FileSize))
}

// maxEntries bounds a listing: the writable layer has no more inodes.
func (ss *vmSession) maxEntries() int {
	return int(int64(ss.b.limits.Disk)/(4<<10)) + 4096
}

const modeBits = fs.ModeType | fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky

// info checks one entry of the agent's and makes it a FileInfo.
func (o *op) info(e wire.FileEntry) (moat.FileInfo, error) {
	m := fs.FileMode(e.Mode)
	if m&^modeBits != 0 || e.Size < 0 || e.Size > o.ss.maxSize() {
		return moat.FileInfo{}, o.bad("entry %q of mode %#o and size %d", clip([]byte(e.Name), 256), e.Mode, e.Size)
	}
	return moat.FileInfo{Name: e.Name, Size: e.Size, Mode: m, ModTime: time.Unix(0, e.ModNano), IsDir: m.IsDir()}, nil
}

// simple runs an operation whose answer is one empty reply.
func (ss *vmSession) simple(ctx context.Context, kind, name, to string) error {
	o, err := ss.begin(ctx, kind, name, to)
	if err != nil {
		return err
	}
	defer o.end()
	r, err := o.reply(ctx, nil)
	if err != nil {
		return err
	}
	if r.More || r.Info != nil || len(r.Entries) > 0 || r.Size != 0 {
		return o.bad("a result")
	}
	return nil
}

// Mkdir implements moat.Files.
func (ss *vmSession) Mkdir(ctx context.Context, name string) error {
	return ss.simple(ctx, wire.OpMkdir, name, "")
}

// Rename implements moat.Files.
func (ss *vmSession) Rename(ctx context.Context, from, to string) error {
	return ss.simple(ctx, wire.OpRename, from, to)
}

// RemoveFile implements moat.Files.
func (ss *vmSession) RemoveFile(ctx context.Context, name string) error {
	return ss.simple(ctx, wire.OpRemove, name, "")
}

// Stat implements moat.Files.
func (ss *vmSession) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	o, err := ss.begin(ctx, wire.OpStat, name, "")
	if err != nil {
		return moat.FileInfo{}, err
	}
	defer o.end()
	r, err := o.reply(ctx, nil)
	if err != nil {
		return moat.FileInfo{}, err
	}
	if r.Info == nil || r.More || r.Info.Name != name {
		return moat.FileInfo{}, o.bad("no description of it")
	}
	return o.info(*r.Info)
}

// maxListBytes bounds the names and descriptions of one listing, as
// sessionfiles' does at the levels that list in their sandbox: the code
// shapes the tree, and the names of a deep one, each up to 4096 bytes,
// would otherwise take up to maxEntries times that of the host's memory.
const maxListBytes = 64 << 20

// ListFiles implements moat.Files: every entry of the working directory,
// recursively, symbolic links listed and not followed. A listing whose
// names and descriptions take more than maxListBytes is refused with an
// error wrapping moat.ErrInvalid.
func (ss *vmSession) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	o, err := ss.begin(ctx, wire.OpList, "", "")
	if err != nil {
		return nil, err
	}
	defer o.end()
	out := []moat.FileInfo{}
	seen := map[string]bool{}
	total := 0
	for {
		r, err := o.reply(ctx, nil)
		if err != nil {
			return nil, err
		}
		if r.Info != nil || r.Size != 0 || (r.More && len(r.Entries) == 0) {
			return nil, o.bad("a reply that is not a part of a listing")
		}
		for _, e := range r.Entries {
			if _, err := engine.CleanName(moat.LevelMicroVM, e.Name); err != nil || seen[e.Name] {
				return nil, o.bad("the name %q", clip([]byte(e.Name), 256))
			}
			seen[e.Name] = true
			if total += len(e.Name) + 64; total > maxListBytes {
				return nil, fmt.Errorf("microvm: list: the files' names take more than %d bytes: %w", maxListBytes, moat.ErrInvalid)
			}
			fi, err := o.info(e)
			if err != nil {
				return nil, err
			}
			out = append(out, fi)
		}
		if len(out) > ss.maxEntries() {
			return nil, o.bad("more than %d entries", ss.maxEntries())
		}
		if !r.More {
			return out, nil
		}
	}
}

// ReadFile implements moat.Files: the whole file, as it was when the agent
// opened it (at most the size it had then), read into memory.
func (ss *vmSession) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	o, err := ss.begin(ctx, wire.OpRead, name, "")
	if err != nil {
		return nil, err
	}
	defer o.end()
	head, err := o.reply(ctx, nil)
	if err != nil {
		return nil, err
	}
	if !head.More || head.Info != nil || len(head.Entries) > 0 || head.Size < 0 || head.Size > ss.maxSize() {
		return nil, o.bad("a file of %d bytes", head.Size)
	}
	buf := make([]byte, 0, min(head.Size, 1<<20))
	last, err := o.reply(ctx, func(b []byte) error {
		if int64(len(buf)+len(b)) > head.Size {
			return o.bad("more than the %d bytes it announced", head.Size)
		}
		buf = append(buf, b...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if last.More || last.Info != nil || len(last.Entries) > 0 || last.Size != 0 {
		return nil, o.bad("a reply after the data")
	}
	return io.NopCloser(bytes.NewReader(buf)), nil
}

// WriteFile implements moat.Files: the contents go to a new file beside
// name, which replaces name once whole; a write past the file size limit
// or the disk limit is refused and leaves name as it was.
func (ss *vmSession) WriteFile(ctx context.Context, name string, r io.Reader) error {
	o, err := ss.begin(ctx, wire.OpWrite, name, "")
	if err != nil {
		return err
	}
	defer o.end()
	limit := int64(ss.b.limits.FileSize)
	abort := func(err error) error {
		ss.c.sendJSON(wire.KindFile, wire.File{ID: o.id, Op: wire.OpAbort})
		return err
	}
	buf := make([]byte, writeChunk)
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return abort(err)
		}
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			total += int64(n)
			if total > limit {
				return abort(fmt.Errorf("microvm: write %q: larger than the file size limit %v: %w", name, ss.b.limits.FileSize, moat.ErrInvalid))
			}
			if err := ss.c.send(wire.KindData, wire.DataPayload(o.id, buf[:n])); err != nil {
				return abort(err)
			}
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			return abort(fmt.Errorf("microvm: write %q: %w", name, rerr))
		}
	}
	if err := ss.c.sendJSON(wire.KindFile, wire.File{ID: o.id, Op: wire.OpCommit}); err != nil {
		return err
	}
	rep, err := o.reply(ctx, nil)
	if err != nil {
		return err
	}
	if rep.More || rep.Info != nil || len(rep.Entries) > 0 || rep.Size != 0 {
		return o.bad("a result")
	}
	return nil
}
