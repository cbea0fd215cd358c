package subprocess

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"syscall"

	"github.com/moatsandbox/moat/subprocess/internal/helper"
)

// The helper process, seen from moat.
//
// Starting the helper (exec of moat's binary in a fresh PID namespace, and
// the Go runtime's start) costs about as much as a fifth of Python's own
// start. So a helper is the level's prepared instance (backend.Prepare),
// which the engine keeps Config.Warm of started ahead of runs: each waits,
// unconfined and doing nothing, for the spec of one run on a pipe, and is
// used once. Nothing of a run exists before the run: the helper joins the
// run's cgroups, takes its limits, its uid and its restrictions only once it
// has the spec (internal/helper/helper.go).

// specFD is the pipe on which a helper receives its spec, and codeFD the
// one it passes on to a pre-started python3 (its fd 3), on which moat
// sends the code's file name.
const (
	specFD = helper.SpecFD
	codeFD = helper.CodeFD
)

// helperProc is a started helper waiting for its spec.
type helperProc struct {
	cmd    *exec.Cmd
	spec   *os.File // write end of the helper's fd 4
	code   *os.File // write end of the helper's fd 5
	status *os.File // read end of the helper's fd 3
	stdout *os.File // read end of python3's stdout
	stderr *os.File // read end of python3's stderr
	// listener is the egress proxy's listener in the helper's network
	// namespace (network.go), nil without Config.Egress. It is closed
	// with the helper's files.
	listener net.Listener
}

// startHelper starts a helper that waits for its spec.
func (b *backend) startHelper() (*helperProc, error) {
	var files [10]*os.File // r/w pairs: spec, status, stdout, stderr, code
	for i := 0; i < len(files); i += 2 {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll(files[:i])
			return nil, fmt.Errorf("subprocess: %w", err)
		}
		files[i], files[i+1] = r, w
	}
	specR, specW := files[0], files[1]
	statusR, statusW := files[2], files[3]
	outR, outW := files[4], files[5]
	errR, errW := files[6], files[7]
	codeR, codeW := files[8], files[9]

	cmd := b.helperCmd()
	cmd.Stdout, cmd.Stderr = outW, errW
	cmd.ExtraFiles = []*os.File{statusW, specR, codeR} // fds 3, 4 and 5
	err := cmd.Start()
	// The helper holds its ends now; ours would keep the pipes open.
	closeAll([]*os.File{specR, statusW, outW, errW, codeR})
	if err != nil {
		closeAll([]*os.File{specW, statusR, outR, errR, codeW})
		return nil, unavailable("cannot start the sandbox helper", "", err)
	}
	h := &helperProc{cmd: cmd, spec: specW, status: statusR, stdout: outR, stderr: errR, code: codeW}
	if b.cfg.Egress != nil {
		// Placed now, before the helper is given any run: the pid is
		// our child's, not yet waited for, so it names this helper.
		if h.listener, err = b.listenIn(cmd.Process.Pid); err != nil {
			h.discard()
			return nil, err
		}
	}
	return h, nil
}

// helperCmd returns the command of a helper, for Start once its files are
// set. It runs in fresh PID and IPC namespaces (and, with strict hardening,
// a network namespace, and a user namespace mapping only moat's ids when
// moat is not root): the run's processes die with the
// helper, and so do the System V IPC objects and POSIX message queues they
// made, which would otherwise outlive the run and be open to the next runs
// of the same uid.
func (b *backend) helperCmd() *exec.Cmd {
	cmd := &exec.Cmd{
		Path: "/proc/self/exe",
		Args: []string{helperArg0},
		Env:  []string{}, // nothing of moat's environment
		Dir:  "/",
		SysProcAttr: &syscall.SysProcAttr{
			// The helper dies with moat; python3 dies with the helper,
			// which is the init of its PID namespace.
			Pdeathsig:  syscall.SIGKILL,
			Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWIPC,
		},
	}
	if b.strict {
		// A network namespace of the run's own, with only a loopback
		// that is down (or, with Config.Egress, up and holding only
		// moat's listener: network.go): no interface, address or route
		// of the host, and abstract unix names of its own. Made here,
		// ahead of the run, since it costs a millisecond or two.
		cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWNET
	}
	if !b.root {
		cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWUSER
		cmd.SysProcAttr.UidMappings = []syscall.SysProcIDMap{{ContainerID: os.Getuid(), HostID: os.Getuid(), Size: 1}}
		cmd.SysProcAttr.GidMappings = []syscall.SysProcIDMap{{ContainerID: os.Getgid(), HostID: os.Getgid(), Size: 1}}
	}
	return cmd
}

// discard ends a helper that never got a spec: on the empty spec it exits.
func (h *helperProc) discard() {
	h.spec.Close()
	h.cmd.Process.Kill()
	h.cmd.Wait()
	h.closeFiles()
}

func (h *helperProc) closeFiles() {
	closeAll([]*os.File{h.spec, h.status, h.stdout, h.stderr, h.code})
	if h.listener != nil {
		h.listener.Close()
	}
}

func closeAll(files []*os.File) {
	for _, f := range files {
		if f != nil {
			f.Close()
		}
	}
}
