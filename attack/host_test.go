package attack

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
)

// hostSandbox runs code with the host's /usr/bin/python3 and no isolation at
// all: the defence is off, so every attack must get through. It has what a
// harness needs and nothing more: an empty environment, a private working
// directory, streamed output, and, when wall is set, a wall timeout that
// kills the process group (or, with pidns, the whole PID namespace). With
// uid set, the code runs as that uid (and gid), an unprivileged user of the
// host's.
type hostSandbox struct {
	wall  time.Duration
	pidns bool
	uid   int
	env   []string // the code's whole environment; nil means empty
}

var _ moat.Sandbox = hostSandbox{}

const hostOutputCap = 1 << 20

func (hostSandbox) Level() moat.Level { return "host" }
func (hostSandbox) Close() error      { return nil }

func (h hostSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	dir, err := os.MkdirTemp("", "moat-attack-host-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	prog := filepath.Join(dir, "prog.py")
	if err := os.WriteFile(prog, req.Code, 0o600); err != nil {
		return nil, err
	}
	work := filepath.Join(dir, "work")
	if err := os.Mkdir(work, 0o700); err != nil {
		return nil, err
	}
	if h.uid != 0 {
		for _, p := range []string{dir, prog, work} {
			if err := os.Chown(p, h.uid, h.uid); err != nil {
				return nil, err
			}
		}
	}

	runCtx, cancel := ctx, context.CancelFunc(func() {})
	if h.wall > 0 {
		runCtx, cancel = context.WithTimeout(ctx, h.wall)
	}
	defer cancel()
	cmd := exec.CommandContext(runCtx, "/usr/bin/python3", prog)
	cmd.Env = append([]string{}, h.env...)
	cmd.Dir = work
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if h.pidns {
		cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWPID
	}
	if h.uid != 0 {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(h.uid), Gid: uint32(h.uid)}
	}
	cmd.Cancel = func() error {
		// The group, and with pidns the namespace's init, whose death
		// kills every process in the namespace.
		return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	cmd.WaitDelay = 200 * time.Millisecond
	var stdout, stderr capped
	cmd.Stdout = io.MultiWriter(&stdout, orDiscard(req.Stdout))
	cmd.Stderr = io.MultiWriter(&stderr, orDiscard(req.Stderr))
	start := time.Now()
	err = cmd.Run()
	res := &moat.Result{Level: "host", Stdout: stdout.b.Bytes(), Stderr: stderr.b.Bytes(),
		Duration: time.Since(start), Truncated: stdout.cut || stderr.cut}
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		res.ExitCode = exit.ExitCode()
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			res.ExitCode = 128 + int(ws.Signal())
			res.Signal = ws.Signal().String()
		}
	case errors.Is(err, exec.ErrWaitDelay):
	default:
		return nil, err
	}
	switch {
	case ctx.Err() != nil:
		res.Reason = moat.ReasonCanceled
	case runCtx.Err() != nil:
		res.Reason = moat.ReasonTimeout
	case res.Signal != "":
		res.Reason = moat.ReasonSignal
	}
	return res, nil
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// capped keeps the first hostOutputCap bytes written to it.
type capped struct {
	b   bytes.Buffer
	cut bool
}

func (c *capped) Write(p []byte) (int, error) {
	room := hostOutputCap - c.b.Len()
	if len(p) > room {
		c.cut = true
		c.b.Write(p[:max(room, 0)])
	} else {
		c.b.Write(p)
	}
	return len(p), nil
}
