package gvisor

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
)

// The host's end of the container init of a session with a live
// interpreter (launcher.py's mode init; see interpreter.go).
//
// The init is the only process of the sandbox holding host files: its
// stdin, stdout and stderr, the sandbox's own (runsc run, or runsc restore,
// donates them). It starts each interpreter as its child and relays, in
// frames that only it makes: moat's frames on its stdin (start an
// interpreter, bytes for its stdin, a ping), the interpreter's streams,
// records, and the init's reports of it (its pid, its start, its wait
// status) on its stdout. Because the interpreter is a
// descendant of the init and holds no host file, runsc checkpoint saves it
// and runsc restore brings it back (suspend.go); an interpreter started
// with runsc exec would not survive a restore. Each frame the init writes
// is at most PIPE_BUF bytes, one write each, so a checkpoint never splits
// one between the old host pipe and the new.

// Host-to-init frames: a kind byte, a 4-byte big-endian length, the payload.
const (
	frameStart = 'S' // start an interpreter
	frameData  = 'D' // bytes for the interpreter's stdin
	framePing  = 'P' // answered with a framePong
)

// Init-to-host frames: a kind byte, a 2-byte big-endian length, the payload.
const (
	frameReady   = 'R' // the init runs
	frameOut     = 'o' // the interpreter's stdout
	frameErr     = 'e' // its stderr
	frameRecord  = 'r' // its records (fd 4)
	frameReport  = 'c' // one report line of the init's (as launcher.py's launch() writes them)
	frameGenDone = 'z' // the interpreter has ended, and every stream of it
	framePong    = 'P' // the pid of the interpreter the init runs, empty when none
)

// maxFrameOut bounds an init-to-host frame's payload: the whole frame is
// at most PIPE_BUF bytes.
const maxFrameOut = 4096 - 3

// initConn is the host's end of the init: it writes frames on the
// sandbox's stdin and reads the init's frames from its stdout for the
// session's life.
type initConn struct {
	ss  *session
	wmu sync.Mutex // one frame at a time on in
	in  *os.File

	ready chan struct{} // closed at the init's frameReady
	pong  chan string   // a framePong's payload
	ended chan struct{} // closed once the init's stdout ended

	// running is the pid of the interpreter the init said it runs when
	// it answered a restore's ping (startInit), 0 for none.
	running int

	mu  sync.Mutex
	cur *interpProc // the interpreter whose frames come now, or nil
}

// newInitConn reads the init's frames from out, the sandbox's stdout.
func newInitConn(ss *session, in, out *os.File) *initConn {
	c := &initConn{ss: ss, in: in, ready: make(chan struct{}), pong: make(chan string, 1), ended: make(chan struct{})}
	go c.read(out)
	return c
}

// send writes one frame to the init.
func (c *initConn) send(kind byte, payload []byte) error {
	hdr := binary.BigEndian.AppendUint32([]byte{kind}, uint32(len(payload)))
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if _, err := c.in.Write(append(hdr, payload...)); err != nil {
		return fmt.Errorf("gvisor: session: write to the sandbox's init: %w: %w", err, moat.ErrUnavailable)
	}
	return nil
}

// read dispatches the init's frames until its stdout ends or a frame is
// not one the init makes; then the interpreter, if any, has ended.
func (c *initConn) read(out *os.File) {
	defer close(c.ended)
	defer out.Close()
	r := bufio.NewReaderSize(out, 64<<10)
	var hdr [3]byte
	buf := make([]byte, maxFrameOut)
	var err error
	for {
		if _, err = io.ReadFull(r, hdr[:]); err != nil {
			break
		}
		n := int(binary.BigEndian.Uint16(hdr[1:]))
		if n > maxFrameOut {
			err = fmt.Errorf("a frame of %d bytes", n)
			break
		}
		if _, err = io.ReadFull(r, buf[:n]); err != nil {
			break
		}
		if err = c.dispatch(hdr[0], buf[:n]); err != nil {
			break
		}
	}
	// The init never ends by itself: whatever ended its stdout ended the
	// sandbox, or moat killed it.
	if !errors.Is(err, io.EOF) && !errors.Is(err, os.ErrClosed) {
		c.ss.b.log.Warn("gvisor: session: the init's frames", "id", c.ss.bt.id, "err", err)
		c.ss.mu.Lock()
		c.ss.breakLocked(fmt.Errorf("the sandbox's init wrote what it never writes: %v", err))
		c.ss.mu.Unlock()
	}
	io.Copy(io.Discard, r)
	c.mu.Lock()
	p := c.cur
	c.cur = nil
	c.mu.Unlock()
	if p != nil {
		p.end(errors.New("the sandbox's init ended"))
	}
}

func (c *initConn) dispatch(kind byte, b []byte) error {
	switch kind {
	case frameReady:
		select {
		case <-c.ready:
		default:
			close(c.ready)
		}
		return nil
	case framePong:
		select {
		case c.pong <- string(b):
		default:
		}
		return nil
	}
	c.mu.Lock()
	p := c.cur
	if kind == frameGenDone {
		c.cur = nil
	}
	c.mu.Unlock()
	if p == nil {
		if kind == frameOut || kind == frameErr || kind == frameRecord || kind == frameReport || kind == frameGenDone {
			return nil // what an ended interpreter left; it was drained
		}
		return fmt.Errorf("a frame of kind %q", kind)
	}
	switch kind {
	case frameOut:
		p.outW.Write(b)
	case frameErr:
		p.errW.Write(b)
		p.tail.Write(b)
	case frameRecord:
		p.recW.Write(b)
	case frameReport:
		p.reportLine(string(b))
	case frameGenDone:
		p.end(nil)
	default:
		return fmt.Errorf("a frame of kind %q", kind)
	}
	return nil
}

// waitReady waits for the init's frameReady.
func (c *initConn) waitReady(ctx context.Context) error {
	select {
	case <-c.ready:
		return nil
	case <-c.ended:
		return errors.New("the sandbox's init ended before it was ready")
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ping asks the init for a framePong and waits for it: the pid of the
// interpreter the init runs (whose end it has not reported), 0 for none.
func (c *initConn) ping(ctx context.Context) (int, error) {
	select {
	case <-c.pong:
	default:
	}
	if err := c.send(framePing, nil); err != nil {
		return 0, err
	}
	select {
	case b := <-c.pong:
		if b == "" {
			return 0, nil
		}
		if pid, err := strconv.Atoi(b); err == nil && pid > 1 {
			return pid, nil
		}
		return 0, fmt.Errorf("the sandbox's init answered %q", clip([]byte(b), 100))
	case <-c.ended:
		return 0, errors.New("the sandbox's init ended")
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// start starts an interpreter; none may run. The caller holds the sandbox.
func (c *initConn) start() (*interpProc, error) {
	p, err := c.attach(0)
	if err != nil {
		return nil, err
	}
	if err := c.send(frameStart, nil); err != nil {
		p.end(err)
		return nil, err
	}
	return p, nil
}

// attach makes the interpreter whose frames come next, with pid, its
// init's report of the interpreter's pid, when known already (a
// restored one).
func (c *initConn) attach(pid int) (*interpProc, error) {
	p := &interpProc{c: c, exited: make(chan struct{}), pid: pid}
	var files [6]*os.File
	for i := 0; i < 6; i += 2 {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll(files[:i])
			return nil, fmt.Errorf("gvisor: %w", err)
		}
		files[i], files[i+1] = r, w
	}
	p.stdout, p.outW, p.stderr, p.errW, p.records, p.recW = files[0], files[1], files[2], files[3], files[4], files[5]
	p.stdin = initStdin{c}
	p.report.pid = pid
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-c.ended:
		closeAll(files[:])
		return nil, fmt.Errorf("gvisor: session: the sandbox's init has ended: %w", moat.ErrUnavailable)
	default:
	}
	if c.cur != nil {
		closeAll(files[:])
		return nil, fmt.Errorf("gvisor: session: an interpreter runs already: %w", moat.ErrUnavailable)
	}
	c.cur = p
	return p, nil
}

// initStdin writes to the interpreter's stdin through the init.
type initStdin struct{ c *initConn }

func (w initStdin) Write(b []byte) (int, error) {
	for n := 0; n < len(b); {
		m := min(len(b)-n, 64<<10)
		if err := w.c.send(frameData, b[n:n+m]); err != nil {
			return n, err
		}
		n += m
	}
	return len(b), nil
}

// interpProc is an interpreter started by the init: its streams, its
// init's reports of it, and how moat kills it (runsc kill --pid of its PID
// namespace's init, whose pid the init reported).
type interpProc struct {
	c                        *initConn
	stdin                    io.Writer
	stdout, stderr, records  *os.File // the host's read ends, fed by the init's frames
	outW, errW, recW         *os.File
	tail                     tail
	exited                   chan struct{} // closed once it ended, everything it wrote passed on
	waitErr                  error         // why it ended without its status, once exited
	report                   launchReport  // once exited
	mu                       sync.Mutex
	pid                      int
	status, killing, stopped bool
	backstop                 *time.Timer
	kills                    sync.WaitGroup
}

// reportLine takes one line of the init's reports, as
// sessionRun.readReports does.
func (p *interpProc) reportLine(line string) {
	kind, arg, _ := strings.Cut(line, " ")
	p.mu.Lock()
	defer p.mu.Unlock()
	switch kind {
	case "pid":
		if n, err := strconv.Atoi(arg); err == nil && n > 1 && p.pid == 0 {
			p.pid, p.report.pid = n, n
			if p.killing && !p.stopped {
				p.kills.Go(func() { p.killPid(n) })
			}
		}
	case "status":
		if n, err := strconv.ParseUint(arg, 10, 32); err == nil && !p.report.hasStatus {
			p.report.hasStatus, p.report.status = true, syscall.WaitStatus(n)
			p.status = true
		}
	case "error":
		p.report.err = clip([]byte(arg), 300)
	}
}

// end marks the interpreter ended: its streams' host ends reach EOF.
func (p *interpProc) end(why error) {
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return
	}
	p.stopped = true
	p.waitErr = why
	if p.backstop != nil {
		p.backstop.Stop()
	}
	p.mu.Unlock()
	closeAll([]*os.File{p.outW, p.errW, p.recW})
	close(p.exited)
}

// kill kills the interpreter's PID namespace, once, and arms the
// backstop: if it has not ended killGrace later, the session's sandbox is
// killed.
func (p *interpProc) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped || p.killing {
		return
	}
	p.killing = true
	if pid := p.pid; pid != 0 && !p.status {
		p.kills.Go(func() { p.killPid(pid) })
	}
	p.backstop = time.AfterFunc(killGrace, p.giveUp)
}

func (p *interpProc) killPid(pid int) {
	if err := p.c.ss.killPid(pid); err != nil {
		p.c.ss.b.log.Warn("gvisor: session: kill the interpreter", "id", p.c.ss.bt.id, "err", err)
	}
}

// giveUp kills the session's sandbox when a killed interpreter did not
// end; its end follows from the init's.
func (p *interpProc) giveUp() {
	select {
	case <-p.exited:
		return
	default:
	}
	ss := p.c.ss
	ss.mu.Lock()
	ss.breakLocked(fmt.Errorf("an interpreter killed %v ago has not ended", killGrace))
	ss.mu.Unlock()
	ss.bt.kill()
}

// withInit makes the container's init of spec, a session's with a live
// interpreter, launcher.py in mode init, as root with driverCaps (a run
// launcher's, and CAP_SYS_RESOURCE to lift RLIMIT_CPU). The spec has no
// seccomp filter: gVisor would apply it to the init and all its
// descendants, and the init must make a PID namespace for each
// interpreter; the init installs the guest filter on each interpreter
// itself (launcher.py's child()), as a run's launcher does for every run of
// a session (gVisor never applied the spec's filter to those).
func (b *backend) withInit(spec *ociSpec, raw []byte, env []string) *ociSpec {
	spec.Process.Args = b.launcherArgs(raw, env, "init", "-I", "-c", interpreterDriver)
	spec.Process.Env = []string{"PATH=/usr/bin:/bin"}
	spec.Process.Capabilities = rootCaps(driverCaps)
	spec.Linux.Seccomp = nil
	return spec
}

// startInit reads the frames of the init of a session with a live
// interpreter (interpinit.go) and waits, at most timeout, until it
// answers: its first frame after a boot (how "start"), a ping after a
// restore.
func (ss *session) startInit(ctx context.Context, timeout time.Duration, how string) error {
	bt := ss.bt
	ss.init = newInitConn(ss, bt.stdin, bt.stdout)
	go io.Copy(io.MultiWriter(io.Discard, &ss.initErr), bt.stderr)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var err error
	if how == "start" {
		err = ss.init.waitReady(ctx)
	} else {
		ss.init.running, err = ss.init.ping(ctx)
	}
	if err == nil {
		return nil
	}
	if ctx.Err() == context.DeadlineExceeded {
		bt.kill()
		return fmt.Errorf("gvisor: session: the sandbox did not %s within %v: %w", how, timeout, moat.ErrUnavailable)
	}
	if ctx.Err() != nil {
		bt.kill()
		return ctx.Err()
	}
	bt.kill()
	<-bt.exited
	ev := ss.sandboxEvidence()
	return fmt.Errorf("gvisor: session: the sandbox did not %s (%v; %s): %w", how, err, clip(ss.initErr.bytes(), 300), ev.failure())
}
