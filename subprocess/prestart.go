package subprocess

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"
)

// Pre-started interpreters.
//
// Python's own start (about 15 ms here) is most of a one-shot run. So a
// prepared instance is the whole run but its code: the helper has its
// spec, every restriction of the run is in place (uid, cgroups, rlimits,
// namespaces, no_new_privs, Landlock, seccomp, the run's own root), and
// python3 has started under them, running bootstrap, which waits on its fd
// 3 for the name of the code's file. Start writes the code file and its
// name, and the bootstrap runs it as `python3 FILE` would. Each instance
// serves one run: every run gets a python3 of its own, with its own hash
// seed and randomness, started for it and for nothing else.
//
// What the code sees of the bootstrap: none of its names (it deletes its
// own before the code runs); sys.argv, sys.path[0], __file__ and
// __name__ as for a script; an uncaught exception printed without the
// bootstrap's frame, exit status 1 (a KeyboardInterrupt: killed by
// SIGINT, as python3 ends then, but without running atexit's handlers); a
// SyntaxError printed as python3 prints one. The traceback is the
// interpreter's own (sys.exc_info), not one the code's exception class
// may redefine (__traceback__, with_traceback). Its stack holds two frames below its module (the -c module
// and the bootstrap's), which only a walk of the stack shows. The CPU time
// python3 used to start (a few ms) counts against the run's CPU limit, as
// it does for a run that starts python3 itself; the time the instance
// waited in the pool counts against nothing.

// bootstrap is the python3 -c program of a pre-started instance.
const bootstrap = `def _moat_main():
    import os, sys
    g = sys.modules["__main__"].__dict__
    del g["_moat_main"]
    with os.fdopen(3, "rb") as f:
        path = os.fsdecode(f.read())
    if not path:
        os._exit(0)
    sys.argv[:] = [path]
    sys.path[0] = os.path.dirname(path)
    g["__file__"] = path
    g["__cached__"] = None
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    except SyntaxError as e:
        sys.excepthook(SyntaxError, e.with_traceback(None), None)
        sys.exit(1)
    except ValueError:
        e = SyntaxError("source code cannot contain null bytes")
        sys.excepthook(SyntaxError, e, None)
        sys.exit(1)
    try:
        exec(code, g)
    except SystemExit:
        raise
    except BaseException as e:
        tb = sys.exc_info()[2].tb_next
        sys.excepthook(type(e), BaseException.with_traceback(e, tb), tb)
        if isinstance(e, KeyboardInterrupt):
            import signal
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)
_moat_main()
`

// prestartArgs is python3's argv for a pre-started run of the code in
// file: the bootstrap, and file as what it will run (shown by ps, never
// read from argv).
func prestartArgs(file string) []string {
	return []string{"python3", "-c", bootstrap, file}
}

// startedTimeout bounds the wait for a helper to say its python3 started.
const startedTimeout = time.Minute

// awaitStarted reads the helper's first status line: "started" once its
// python3 is forked, or the error that stopped it. It returns an error
// wrapping moat.ErrUnavailable with the helper's reason when the helper
// failed to set the run up, so that a level that cannot apply a
// restriction says so at once, not at the first run.
func (h *helperProc) awaitStarted() error {
	h.status.SetReadDeadline(time.Now().Add(startedTimeout))
	defer h.status.SetReadDeadline(time.Time{})
	var line []byte
	var b [1]byte
	for len(line) < 4096 {
		n, err := h.status.Read(b[:])
		if n == 1 {
			if b[0] == '\n' {
				break
			}
			line = append(line, b[0])
			continue
		}
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return fmt.Errorf("subprocess: the sandbox helper did not start python3 within %v", startedTimeout)
			}
			return fmt.Errorf("%w: %v", errHelperGone, err)
		}
	}
	switch s := string(line); {
	case s == "started":
		return nil
	case strings.HasPrefix(s, "error "):
		return unavailable("the sandbox helper could not set the run up", "", errors.New(strings.TrimPrefix(s, "error ")))
	default:
		return fmt.Errorf("subprocess: the sandbox helper said %q before its run", s)
	}
}

// sendCode hands a pre-started python3 the name of its code's file. An
// error wrapping errHelperGone says it (or its helper) died while it
// waited.
func (h *helperProc) sendCode(file string) error {
	_, err := h.code.Write([]byte(file))
	cerr := h.code.Close()
	if err == nil {
		err = cerr
	}
	if errors.Is(err, syscall.EPIPE) {
		return fmt.Errorf("%w: %v", errHelperGone, err)
	}
	if err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	return nil
}
