// A command's standard input, carried through the session's files.

package e2b

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
)

// A run of moat takes no input (moat.Request has none), but a session's
// files can be written while a run is in progress, at every level. So a
// command started with stdin reads it from a spool directory of the
// session's: each SendInput is a file, "<n>.part" written then renamed to
// "<n>" (so the command never reads half of one), and CloseStdin is the
// file "eof". The launcher runs the command with a pipe as its input and
// a thread that copies each "<n>" into the pipe in order, removing it,
// and closes the pipe at "eof". The spool is under stdinRoot, which the
// E2B API does not show (listings, watches).
//
// The spool belongs to the sandbox's own code: the code can read it, add
// to it or break it, which changes only its own input (a link it plants
// there can send the input to another file of the session, which the code
// could write anyway). The host writes through moat.Files, which never
// follows a link out of the session's directory (at the levels that run a
// program in the instance, none at all), never writes through an existing
// file, and opens no FIFO for writing, so a broken spool is an error of
// SendInput, nothing more.
const stdinRoot = ".moat-stdin"

// maxStdinPending is how many chunks SendInput lets wait for the command
// to take them before it waits in turn: what one command's unread input
// holds of the session's disk is at most this many messages.
const maxStdinPending = 8

// hiddenName reports whether name (a session file name) is of the stdin
// spool, which listings and watches leave out.
func hiddenName(name string) bool {
	return name == stdinRoot || strings.HasPrefix(name, stdinRoot+"/")
}

// stdinSpool is the host's side of one command's input.
type stdinSpool struct {
	dir string // session file name of the spool directory

	// ended is closed when the command has ended: a send waiting for it
	// to read stops waiting.
	ended   chan struct{}
	endOnce sync.Once

	// lock is held (a value in it) by the one send, close or end at
	// work on the spool; taken with acquire, so that a caller waiting
	// for it still ends with its own context. It guards next and closed.
	lock   chan struct{}
	next   int  // the number of the next chunk
	closed bool // "eof" written, or the command ended
}

// acquire takes sp.lock, or gives up when ctx ends: a send that waits for
// the command to read holds the lock, and the calls behind it must not
// wait past their own deadlines.
func (sp *stdinSpool) acquire(ctx context.Context) error {
	select {
	case sp.lock <- struct{}{}:
		return nil
	case <-ctx.Done():
		code := connect.CodeCanceled
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			code = connect.CodeDeadlineExceeded
		}
		return connect.NewError(code, fmt.Errorf("e2b: waiting for another call on the command's input: %w", ctx.Err()))
	}
}

func (sp *stdinSpool) release() { <-sp.lock }

// end says the command has ended: a send waiting for it stops waiting.
func (sp *stdinSpool) end() { sp.endOnce.Do(func() { close(sp.ended) }) }

// stdinEndGrace is how long a failed write to the spool waits to see
// whether the command's end came with the failure.
const stdinEndGrace = 2 * time.Second

// endedWith reports whether the failure of a write to the spool came with
// the command's end: at the container level a run's end kills every
// process of the instance but its init, the one that writes a file for
// moat too, so the last write before the end (the "eof" that ends it above
// all) can fail after it was done. It waits up to stdinEndGrace for the
// end (ctx bounds the wait).
func (sp *stdinSpool) endedWith(ctx context.Context) bool {
	t := time.NewTimer(stdinEndGrace)
	defer t.Stop()
	select {
	case <-sp.ended:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// stdinCleanup bounds what endStdin spends removing a spool, since it
// runs once the client has gone and no request bounds it.
const stdinCleanup = 30 * time.Second

// newStdinSpool makes the spool directory for a command of sb.
func (ps *processService) newStdinSpool(ctx context.Context, sb *sandbox) (*stdinSpool, error) {
	var nonce [8]byte
	rand.Read(nonce[:])
	sp := &stdinSpool{dir: path.Join(stdinRoot, hex.EncodeToString(nonce[:])), ended: make(chan struct{}), lock: make(chan struct{}, 1)}
	sess, done, err := ps.s.cfg.Sessions.UseSession(ctx, sb.owner, sb.id)
	if err != nil {
		return nil, rpcError(err)
	}
	defer done()
	if err := sess.Mkdir(ctx, sp.dir); err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("e2b: the command's stdin: %w", err))
	}
	return sp, nil
}

// send writes data as the next chunk, once fewer than maxStdinPending wait
// (ctx bounds the wait).
func (ps *processService) send(ctx context.Context, sb *sandbox, sp *stdinSpool, data []byte) error {
	if err := sp.acquire(ctx); err != nil {
		return err
	}
	defer sp.release()
	if sp.closed {
		return connect.NewError(connect.CodeFailedPrecondition, errors.New("e2b: the command's stdin is closed"))
	}
	if len(data) == 0 {
		return nil
	}
	sess, done, err := ps.s.cfg.Sessions.UseSession(ctx, sb.owner, sb.id)
	if err != nil {
		return rpcError(err)
	}
	defer done()
	if sp.next >= maxStdinPending {
		// Chunks are taken in order: when this one is gone, so are all
		// before it.
		// The look costs a run of a program in the instance at some
		// levels (docker exec, the guest's channel): the wait between
		// two is at least ten times what the last took, so that a send
		// waiting on a command that does not read uses at most a tenth
		// of what the file operations can take.
		oldest := path.Join(sp.dir, strconv.Itoa(sp.next-maxStdinPending))
		for pause := time.Millisecond; ; {
			start := time.Now()
			_, err := sess.Stat(ctx, oldest)
			if errors.Is(err, fs.ErrNotExist) {
				break
			}
			if err != nil {
				return fsError(err)
			}
			pause = max(min(2*pause, 50*time.Millisecond), 10*time.Since(start))
			select {
			case <-ctx.Done():
				return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("e2b: the command has not read its input: %w", ctx.Err()))
			case <-sp.ended:
				return connect.NewError(connect.CodeNotFound, errors.New("e2b: the command ended before it read its input"))
			case <-time.After(pause):
			}
		}
	}
	name := path.Join(sp.dir, strconv.Itoa(sp.next))
	err = sess.WriteFile(ctx, name+".part", bytes.NewReader(data))
	if err == nil {
		err = sess.Rename(ctx, name+".part", name)
	}
	if err != nil {
		if sp.endedWith(ctx) {
			return connect.NewError(connect.CodeNotFound, errors.New("e2b: the command ended as its input was sent"))
		}
		return fsError(err)
	}
	sp.next++
	return nil
}

// close writes "eof": the command reads the end of its input once it has
// read every chunk before.
func (ps *processService) closeStdin(ctx context.Context, sb *sandbox, sp *stdinSpool) error {
	if err := sp.acquire(ctx); err != nil {
		return err
	}
	defer sp.release()
	if sp.closed {
		return nil
	}
	sess, done, err := ps.s.cfg.Sessions.UseSession(ctx, sb.owner, sb.id)
	if err != nil {
		return rpcError(err)
	}
	defer done()
	if err := sess.WriteFile(ctx, path.Join(sp.dir, "eof"), bytes.NewReader(nil)); err != nil {
		if !sp.endedWith(ctx) {
			return fsError(err)
		}
		// The input of a command that has ended is closed.
	}
	sp.closed = true
	return nil
}

// end closes the spool for good once the command has ended and removes
// what the launcher left of it: the chunks it had not taken (at most
// maxStdinPending and one being written), "eof", the directory, and the
// root when no other command's spool is in it. What it cannot remove (the
// code put files of its own there) stays, among the session's own files.
// It does not end with ctx (the client may have gone): stdinCleanup bounds
// it, the wait for a send in progress included. It never resumes a
// suspended sandbox to clean up.
func (ps *processService) endStdin(ctx context.Context, sb *sandbox, sp *stdinSpool) {
	sp.end()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stdinCleanup)
	defer cancel()
	if sp.acquire(ctx) != nil {
		return
	}
	defer sp.release()
	sp.closed = true
	// A look, not a use: a sandbox suspended meanwhile (a pause, moat's
	// own API, a shutdown) stays so, with what is left of the spool in
	// its files; the cleanup never wakes it.
	sess, done, running, err := ps.s.cfg.Sessions.PeekSession(sb.owner, sb.id)
	if err != nil || !running {
		return
	}
	defer done()
	if _, err := sess.Stat(ctx, sp.dir); err != nil {
		return // the launcher removed it
	}
	for n := max(0, sp.next-maxStdinPending-1); n <= sp.next; n++ {
		sess.RemoveFile(ctx, path.Join(sp.dir, strconv.Itoa(n)))
		sess.RemoveFile(ctx, path.Join(sp.dir, strconv.Itoa(n)+".part"))
	}
	sess.RemoveFile(ctx, path.Join(sp.dir, "eof"))
	sess.RemoveFile(ctx, sp.dir)
	sess.RemoveFile(ctx, stdinRoot)
}

// stdinRelay is the Python of the launcher's side: relay(d, w, stop)
// copies the chunks of spool directory d into the file descriptor w, in
// order, until "eof" (or until stop is set, or w's reader has gone), then
// closes w; clean(d) removes the spool. It is inserted into the
// launchers, indented to their level.
//
// Nothing in it blocks past stop: the launcher sets stop when the command
// has ended, and the relay then ends within one pause (50 ms) and one
// chunk's read, even when a process the command left holds the pipe and
// reads nothing (w is non-blocking, written when poll says it can be:
// select would refuse a descriptor past 1023),
// or when the code put something other than a regular file where a chunk
// goes (a FIFO is opened without blocking, and anything but a regular
// file ends the input).
const stdinRelay = `def relay(d, w, stop):
    import os, select, stat
    n, pause = 0, 0.002
    try:
        os.set_blocking(w, False)
        po = select.poll()
        po.register(w, select.POLLOUT)
        while not stop.is_set():
            p = os.path.join(d, str(n))
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except FileNotFoundError:
                if os.path.exists(os.path.join(d, "eof")) and not os.path.exists(p):
                    break
                stop.wait(pause)
                pause = min(pause * 2, 0.05)
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    break
                parts = []
                while True:
                    b = os.read(fd, 1 << 20)
                    if not b:
                        break
                    parts.append(b)
            finally:
                os.close(fd)
            os.unlink(p)
            n, pause = n + 1, 0.002
            data = b"".join(parts)
            while data and not stop.is_set():
                po.poll(50)
                try:
                    data = data[os.write(w, data):]
                except BlockingIOError:
                    pass
    except OSError:
        pass
    finally:
        os.close(w)
def clean(d):
    import os
    try:
        for e in os.listdir(d):
            os.unlink(os.path.join(d, e))
        os.rmdir(d)
        os.rmdir(os.path.dirname(d))
    except OSError:
        pass
`

// indent returns src with every line but empty ones indented by prefix.
func indent(src, prefix string) string {
	lines := strings.Split(strings.TrimSuffix(src, "\n"), "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = prefix + l
		}
	}
	return strings.Join(lines, "\n") + "\n"
}

// errNoStdin is SendInput's and CloseStdin's answer for a command started
// without stdin.
var errNoStdin = connect.NewError(connect.CodeFailedPrecondition, errors.New("e2b: the command was started without stdin: start it with stdin true"))
