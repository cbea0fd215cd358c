package subprocess

import (
	_ "embed"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/marker"
)

// The live interpreter.
//
// A python3 started through the helper like any run stays alive between the
// runs of a session, driven by interpreter_driver.py, which reads code from
// a control socket and runs it with exec() in one persistent globals
// dictionary.
//
// Between runs the interpreter's cgroup is frozen (cgroup.Group.Freeze): no
// process of it, forked ones and threads included, runs until the next run
// thaws it, whatever timers or signals the code arranged (a process stopped
// with SIGSTOP is woken by a SIGCONT it armed itself). Without a freezer the
// interpreter is refused.
//
// The interpreter's cgroup counts its CPU time over its whole life. Each run
// may use Limits.CPUTime of it; the session's interpreters together may use
// Config.SessionCPUTime (see backend.sessionCPUTime). A run of it is
// interpreter_run.go; its output, interpreter_output.go.
//
// The control channel and what the host can trust. The code runs in the
// driver's own process: it can read the driver's memory (the nonce, the
// socket's descriptor) and write on the control socket and on fds 1 and 2
// whatever the driver could. So nothing the driver sends is authenticated,
// and the host takes from it only what the code could decide anyway:
//
//   - when its run ended and with what status. A record counts for a run
//     only if it carries that run's nonce, which the host draws afresh for
//     each run: a record made in an earlier run (among them the real end of
//     a run whose end the code forged, which the driver sends late) is
//     dropped and never becomes a later run's end or status.
//   - where the run's output ends, by the same nonce on fds 1 and 2; the
//     previous run's marker, which a late driver writes at the start of
//     the next run, is dropped from the output.
//
// The socket is SOCK_SEQPACKET, so whatever the code writes on it is one
// record of its own and cannot shift the framing of the driver's later
// records. Verdicts on limits (CPU, wall time, memory, processes, disk) come
// from the cgroup and the host's clock, never from the channel.
//
// What stays possible, by the nature of a shared interpreter: code of one run
// can change what later runs do and report (replace builtins, hook os.read
// and read the next run's nonce and code, leave a thread that answers in the
// driver's place). A session's later results are as trustworthy as its
// earlier code, as in a notebook; the limits hold regardless.

//go:embed interpreter_driver.py
var interpreterDriver string

const (
	// nonceLen is the length of a run's nonce (hex).
	nonceLen = 32
	// maxFrame is the largest record the driver sends; a larger one is not
	// the driver's.
	maxFrame = 4096
	// codeChunk is the largest record of code moat sends: well under the
	// socket's send buffer, which bounds a SOCK_SEQPACKET record.
	codeChunk = 32 << 10
)

// sessionCPUTime is the CPU budget of a session's interpreters, all of them
// over the session's life: Config.SessionCPUTime, by default ten times the
// per-run CPU time.
func (b *backend) sessionCPUTime() time.Duration {
	if b.cfg.SessionCPUTime != 0 {
		return time.Duration(b.cfg.SessionCPUTime)
	}
	return 10 * time.Duration(b.limits.CPUTime)
}

// frame is one record from the driver.
type frame struct {
	kind    byte
	payload []byte
}

// interpreter is a live python3 under the helper.
type interpreter struct {
	b      *backend
	cmd    *exec.Cmd
	ctl    *os.File // moat's end of the control socket
	status *os.File // the helper's status pipe
	group  *cgroup.Group
	frames chan frame    // closed when the control socket ends
	exited chan struct{} // closed when the helper has exited
	outs   [2]*marker.Router
	// listener is the egress proxy's listener in the helper's network
	// namespace, served by the session's egress.Run; nil without
	// Config.Egress. close closes it.
	listener net.Listener

	// Used by the session's run in progress only (kill and close also by
	// Close, after it).
	frozen    bool
	dead      bool          // killed or ended: the next run starts a new one
	closed    bool          // close has run
	lastCPU   time.Duration // the last reading of the group's CPU account
	prevNonce []byte        // the nonce of the last run whose end was taken
}

// startInterpreter starts python3 and the driver under the helper. The
// caller waits for the driver's 'H' record.
func (ss *session) startInterpreter() (*interpreter, error) {
	b := ss.b
	in := &interpreter{b: b, frames: make(chan frame, 4), exited: make(chan struct{})}
	id := b.newID()
	lim := b.limits
	if b.strict {
		g, err := b.cg.New(id, cgroup.Limits{Memory: int64(lim.Memory), Pids: int64(lim.Pids), Freezable: true})
		if errors.Is(err, cgroup.ErrNoFreezer) {
			return nil, errNoFreezer(err)
		}
		if err != nil {
			return nil, unavailable("cannot create the interpreter's cgroup", "", err)
		}
		in.group = g
	}
	// -I: no environment variables, no user site; the driver puts the
	// working directory on sys.path itself.
	uid, gid := ss.uid()
	sp := b.runSpec(ss.dir, uid, gid, in.group, []string{"python3", "-I", "-c", interpreterDriver})
	if b.strict {
		// RLIMIT_CPU counts a process's whole life, and the interpreter
		// lives across runs: the cgroup's account bounds each run instead.
		for i := range sp.Rlimits {
			if sp.Rlimits[i].Resource == unix.RLIMIT_CPU {
				sp.Rlimits[i].Cur, sp.Rlimits[i].Max = unix.RLIM_INFINITY, unix.RLIM_INFINITY
			}
		}
	}
	if ss.net != nil {
		b.withNetwork(&sp, ss.net)
	}
	arg, err := json.Marshal(sp)
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	// SOCK_SEQPACKET: every write is a record of its own, so what the code
	// writes on the socket cannot shift the framing of the driver's.
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	// moat's end is non-blocking, so that it is read through the runtime's
	// poller; the driver's end stays blocking.
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	in.ctl = os.NewFile(uintptr(fds[0]), "interpreter-control")
	child := os.NewFile(uintptr(fds[1]), "interpreter-control-child")
	defer child.Close()
	statusR, statusW, err := os.Pipe()
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer statusW.Close()
	in.status = statusR
	specR, specW, err := os.Pipe()
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer specR.Close()
	defer specW.Close()
	var childEnds []*os.File
	defer func() {
		for _, f := range childEnds {
			f.Close()
		}
	}()
	var readers [2]*os.File
	for i := range readers {
		r, w, err := os.Pipe()
		if err != nil {
			for _, f := range readers {
				if f != nil {
					f.Close()
				}
			}
			in.close()
			return nil, fmt.Errorf("subprocess: %w", err)
		}
		readers[i] = r
		childEnds = append(childEnds, w)
	}

	// The same helper as a one-shot run's (see helperproc.go), with the
	// control socket as its stdin, which python3 inherits.
	cmd := b.helperCmd()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = child, childEnds[0], childEnds[1]
	cmd.ExtraFiles = []*os.File{statusW, specR} // fds 3 and 4
	if err := cmd.Start(); err != nil {
		readers[0].Close()
		readers[1].Close()
		in.close()
		return nil, unavailable("cannot start the sandbox helper", "", err)
	}
	in.cmd = cmd
	specR.Close()
	if ss.net != nil {
		// The listener goes in before the spec, so before any code.
		l, err := b.listenIn(cmd.Process.Pid)
		if err != nil {
			specW.Close() // on the empty spec the helper exits
			cmd.Process.Kill()
			cmd.Wait()
			close(in.exited)
			readers[0].Close()
			readers[1].Close()
			in.close()
			return nil, err
		}
		in.listener = l
		go serve(b, ss.net, l)
	}
	if _, err := specW.Write(arg); err != nil {
		in.b.log.Warn("subprocess: interpreter spec", "err", err)
	}
	specW.Close()
	for i := range in.outs {
		in.outs[i] = marker.NewRouter(readers[i])
	}
	go func() {
		cmd.Wait()
		close(in.exited)
	}()
	go in.readFrames()
	return in, nil
}

func errNoFreezer(err error) error {
	return unavailable("no cgroup freezer: a live interpreter's processes could not be held still between runs",
		"mount the v1 freezer hierarchy at /sys/fs/cgroup/freezer, or use cgroup v2 on Linux 5.2 or later; sessions without an interpreter work without it", err)
}

// readFrames reads the driver's records until the socket ends or breaks.
// Records that cannot be the driver's (too long) are dropped.
func (in *interpreter) readFrames() {
	defer close(in.frames)
	rc, err := in.ctl.SyscallConn()
	if err != nil {
		return
	}
	buf := make([]byte, maxFrame+1)
	for {
		var n, flags int
		var rerr error
		end := false
		err := rc.Read(func(fd uintptr) bool {
			n, _, flags, _, rerr = unix.Recvmsg(int(fd), buf, nil, unix.MSG_DONTWAIT)
			if rerr == unix.EAGAIN {
				return false
			}
			// Zero bytes: the end, or an empty record (the code's). The
			// end leaves the socket hung up.
			end = rerr != nil || (n == 0 && peerGone(int(fd)))
			return true
		})
		if err != nil || end {
			return
		}
		if n == 0 || n > maxFrame || flags&unix.MSG_TRUNC != 0 {
			continue
		}
		in.frames <- frame{buf[0], append([]byte(nil), buf[1:n]...)}
	}
}

// peerGone reports whether the other end of the socket fd has shut down
// its writing side or closed.
func peerGone(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
	n, err := unix.Poll(p, 0)
	return err != nil || (n > 0 && p[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0)
}

// send hands the driver a run: the header record, then the code in
// records of at most codeChunk bytes. An error means the interpreter ended.
func (in *interpreter) send(nonce, code []byte) error {
	hdr := make([]byte, 0, 1+nonceLen+4)
	hdr = append(hdr, 'R')
	hdr = append(hdr, nonce...)
	hdr = binary.BigEndian.AppendUint32(hdr, uint32(len(code)))
	if _, err := in.ctl.Write(hdr); err != nil {
		return err
	}
	for len(code) > 0 {
		n := min(len(code), codeChunk)
		if _, err := in.ctl.Write(code[:n]); err != nil {
			return err
		}
		code = code[n:]
	}
	return nil
}

// cpu reads the CPU time the interpreter's cgroup has used in its life.
func (in *interpreter) cpu() (time.Duration, error) {
	used, err := in.group.CPUUsage()
	if err == nil {
		in.lastCPU = used
	}
	return used, err
}

// kill ends the interpreter and everything it started. It may be called
// from the run's watchers while the run waits.
func (in *interpreter) kill() {
	in.dead = true
	if in.cmd != nil && in.cmd.Process != nil {
		in.cmd.Process.Kill()
	}
	if in.group != nil {
		in.group.Kill()
	}
}

// close releases what the interpreter held, after it has ended, and returns
// the CPU time it used in all (the last reading, if the final one fails).
// Calls after the first do nothing but return it again.
func (in *interpreter) close() time.Duration {
	in.dead = true
	if in.closed {
		return in.lastCPU
	}
	in.closed = true
	if in.cmd != nil {
		select {
		case <-in.exited:
		case <-time.After(5 * time.Second):
			in.b.log.Warn("subprocess: interpreter helper did not exit")
		}
	}
	if in.listener != nil {
		in.listener.Close()
	}
	if in.ctl != nil {
		in.ctl.Close()
		go func() {
			for range in.frames {
			}
		}()
	}
	if in.status != nil {
		in.status.Close()
	}
	if in.group != nil {
		if err := in.group.Kill(); err != nil {
			in.b.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
		if _, err := in.cpu(); err != nil {
			in.b.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
		if err := in.group.Remove(); err != nil {
			in.b.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
	}
	return in.lastCPU
}

// endInterpreter kills the session's interpreter, if any, releases it and
// adds the CPU time it used to the session's account. cause, if not empty,
// says why it ended, for the notes of the run that starts the next one (see
// session.ended). The caller is the run in progress, or Close after it.
func (ss *session) endInterpreter(cause string) {
	in := ss.interp
	if in == nil {
		return
	}
	if cause != "" {
		ss.ended = cause
	}
	in.kill()
	ss.cpuUsed += in.close()
	ss.setInterp(nil)
	if ss.cpuUsed >= ss.b.sessionCPUTime() {
		ss.cpuSpent = true
	}
}

// errCPUSpent is what Run returns once the session's CPU budget is spent.
func (ss *session) errCPUSpent() error {
	return fmt.Errorf("subprocess: session %s: its interpreter's CPU budget of %v (session_cpu_time) is spent; only its files remain: %w",
		ss.id, ss.b.sessionCPUTime(), moat.ErrSpent)
}

// setInterp sets the session's live interpreter.
func (ss *session) setInterp(in *interpreter) {
	ss.mu.Lock()
	ss.interp = in
	ss.mu.Unlock()
}

// readStatus reads what the helper reported, once it has exited.
func readStatus(f *os.File) []byte {
	if f == nil {
		return nil
	}
	f.SetReadDeadline(time.Now().Add(time.Second))
	b, _ := io.ReadAll(io.LimitReader(f, 4096))
	return b
}
