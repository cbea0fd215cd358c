// process.Process: commands run as runs of the sandbox's session.

package e2b

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"slices"
	"strings"
	"sync"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b/internal/envd/process"
	"github.com/moatsandbox/moat/e2b/internal/envd/process/processconnect"
)

// procTable is a sandbox's commands in progress, by the pid this API gave
// them (not a process id of any kernel).
type procTable struct {
	mu    sync.Mutex
	next  uint32
	procs map[uint32]*proc
}

// proc is one command in progress: a run of the session.
type proc struct {
	pid    uint32
	tag    string
	config *process.ProcessConfig
	cancel context.CancelFunc

	mu sync.Mutex
	// subs get every event after the start; closed when the command ends.
	subs []chan *process.ProcessEvent
	// ended says closeSubs has run: a later subscriber gets a closed
	// channel, never one that nothing will close.
	ended bool
	// killed says a SendSignal ended it.
	killed string
	// stdin is the command's input; nil when it was started without.
	stdin *stdinSpool
}

func (t *procTable) add(p *proc) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.procs == nil {
		t.procs = map[uint32]*proc{}
	}
	t.next++
	p.pid = t.next
	t.procs[p.pid] = p
}

func (t *procTable) remove(p *proc) {
	t.mu.Lock()
	delete(t.procs, p.pid)
	t.mu.Unlock()
}

func (t *procTable) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.procs)
}

func (t *procTable) find(sel *process.ProcessSelector) (*proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range t.procs {
		switch v := sel.GetSelector().(type) {
		case *process.ProcessSelector_Pid:
			if p.pid == v.Pid {
				return p, nil
			}
		case *process.ProcessSelector_Tag:
			if p.tag != "" && p.tag == v.Tag {
				return p, nil
			}
		}
	}
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("e2b: no command %v is running", sel))
}

func (t *procTable) all() []*proc {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Collect(maps.Values(t.procs))
}

func (t *procTable) killAll() {
	for _, p := range t.all() {
		p.cancel()
	}
}

// publish hands ev to every subscriber (Connect) without waiting for a slow
// one: a subscriber that has fallen behind loses the event.
func (p *proc) publish(ev *process.ProcessEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.subs {
		select {
		case c <- ev:
		default:
		}
	}
}

// subscribe returns a channel of the command's events from now on, closed
// when it ends (at once if it has ended).
func (p *proc) subscribe() chan *process.ProcessEvent {
	c := make(chan *process.ProcessEvent, 64)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ended {
		close(c)
		return c
	}
	p.subs = append(p.subs, c)
	return c
}

func (p *proc) closeSubs() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.subs {
		close(c)
	}
	p.subs, p.ended = nil, true
}

type processService struct {
	processconnect.UnimplementedProcessHandler
	s *Server
}

func unimplemented(format string, args ...any) error {
	return connect.NewError(connect.CodeUnimplemented, fmt.Errorf("e2b: "+format+" (see docs/e2b.md)", args...))
}

// rpcError maps moat's and the server's errors to Connect codes.
func rpcError(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := errors.AsType[*connect.Error](err); ok {
		return err
	}
	code := connect.CodeInternal
	switch st := statusOf(err); {
	case st == 400 || st == 413:
		code = connect.CodeInvalidArgument
	case st == 404:
		code = connect.CodeNotFound
	case st == 401:
		code = connect.CodeUnauthenticated
	case st == 403:
		code = connect.CodePermissionDenied
	case st == 409:
		code = connect.CodeFailedPrecondition
	case st == 429, st == 507:
		code = connect.CodeResourceExhausted
	case st == 501:
		code = connect.CodeUnimplemented
	case st == 503, st == 502:
		code = connect.CodeUnavailable
	case st == 499:
		code = connect.CodeCanceled
	}
	return connect.NewError(code, err)
}

// launcher is the Python program that runs a command in the session: it
// changes to the command's directory, sets its environment (HOME the
// session's directory, then the sandbox's and the command's variables)
// and replaces itself with the command, so that its exit status and
// signal are the command's; SIGPIPE and SIGXFSZ, which Python ignores,
// are the default again for the command. A command with stdin runs as its
// child instead, its input a pipe that the relay fills from the spool
// (stdinRelay), and the launcher ends as the child did: the same exit
// status, or killed by the same signal. Its input is base64 JSON, never
// Python source built from the request.
const launcher = `import base64, json, os, signal, sys, threading
%s
c = json.loads(base64.b64decode(%q))
home = os.getcwd()
env = dict(os.environ)
env["HOME"] = home
env.update(c["envs"])
def run():
    try:
        for s in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_DFL)
        os.chdir(c["cwd"] or ".")
        env["PWD"] = os.getcwd()
        os.execve(c["cmd"], [c["cmd"]] + c["args"], env)
    except FileNotFoundError as e:
        sys.stderr.write("moat: %%s: %%s\n" %% (c["cmd"], e.strerror))
        code = 127
    except (OSError, ValueError) as e:
        sys.stderr.write("moat: %%s: %%s\n" %% (c["cmd"], e))
        code = 126
    sys.stderr.flush()
    os._exit(code)
if not c["stdin"]:
    run()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.dup2(r, 0)
    os.close(r)
    os.close(w)
    run()
os.close(r)
stop = threading.Event()
threading.Thread(target=relay, args=(os.path.join(home, c["stdin"]), w, stop), daemon=True).start()
_, st = os.waitpid(pid, 0)
stop.set()
clean(os.path.join(home, c["stdin"]))
if os.WIFSIGNALED(st):
    try:
        signal.signal(os.WTERMSIG(st), signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), os.WTERMSIG(st))
sys.exit(os.waitstatus_to_exitcode(st))
`

// childLauncher is launcher for a session with a live interpreter, which
// must outlive the command: it runs the command as its child (input
// closed, or the relay's pipe with stdin) and exits with its status, as
// the live interpreter reports a SystemExit. HOME is moat's, the session's
// directory, whatever a cell did with the interpreter's own working
// directory. It leaves no name and no thread in the interpreter.
const childLauncher = `def _moat_child(c):
    import base64, json, os, subprocess, sys, threading
%s
    c = json.loads(base64.b64decode(c))
    home = os.environ.get("HOME") or os.getcwd()
    env = dict(os.environ)
    env["HOME"] = home
    env.update(c["envs"])
    cwd = os.path.normpath(os.path.join(home, c["cwd"] or "."))
    env["PWD"] = cwd
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        r = subprocess.Popen([c["cmd"]] + c["args"], cwd=cwd, env=env, stdin=subprocess.PIPE if c["stdin"] else subprocess.DEVNULL)
    except FileNotFoundError as e:
        sys.stderr.write("moat: %%s: %%s\n" %% (c["cmd"], e.strerror))
        raise SystemExit(127)
    except (OSError, ValueError) as e:
        sys.stderr.write("moat: %%s: %%s\n" %% (c["cmd"], e))
        raise SystemExit(126)
    stop = threading.Event()
    t = None
    try:
        if c["stdin"]:
            w = os.dup(r.stdin.fileno())
            r.stdin.close()
            t = threading.Thread(target=relay, args=(os.path.join(home, c["stdin"]), w, stop), daemon=True)
            try:
                t.start()
            except BaseException:
                # No relay (a thread refused: the pids limit): the
                # command reads the end of its input, and is waited for.
                t = None
                os.close(w)
                sys.stderr.write("moat: the command's input cannot be relayed: it reads none\n")
        rc = r.wait()
    finally:
        stop.set()
        if t:
            t.join()
            clean(os.path.join(home, c["stdin"]))
    raise SystemExit(rc if rc >= 0 else 128 - rc)
try:
    _moat_child(%q)
finally:
    del _moat_child
`

// launchCode returns the run's code for cfg, with envs (the sandbox's)
// under the command's own variables: launcher, or childLauncher when the
// session keeps a live interpreter. cwd maps as MapPath does.
func launchCode(cfg *process.ProcessConfig, envs map[string]string, interpreter bool, stdin string) ([]byte, error) {
	if cfg == nil || cfg.GetCmd() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("e2b: the process has no cmd"))
	}
	cwd := "."
	if cfg.Cwd != nil {
		name, err := MapPath(cfg.GetCwd())
		if err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
		cwd = name
	}
	all := map[string]string{}
	maps.Copy(all, envs)
	maps.Copy(all, cfg.GetEnvs())
	for k, v := range all {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.ContainsRune(v, 0) {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("e2b: environment variable %q: an empty name, \"=\" in it, or NUL in it or its value", k))
		}
	}
	args := cfg.GetArgs()
	if args == nil {
		args = []string{}
	}
	j, err := json.Marshal(map[string]any{"cmd": cfg.GetCmd(), "args": args, "envs": all, "cwd": cwd, "stdin": stdin})
	if err != nil {
		return nil, err
	}
	if interpreter {
		return fmt.Appendf(nil, childLauncher, indent(stdinRelay, "    "), base64.StdEncoding.EncodeToString(j)), nil
	}
	return fmt.Appendf(nil, launcher, stdinRelay, base64.StdEncoding.EncodeToString(j)), nil
}

// streamWriter turns a run's output into data events on the stream and to
// the command's subscribers.
type streamWriter struct {
	mu     *sync.Mutex
	send   func(*process.ProcessEvent) error
	p      *proc
	stderr bool
}

func (w *streamWriter) Write(b []byte) (int, error) {
	data := &process.ProcessEvent_DataEvent{}
	cp := append([]byte{}, b...)
	if w.stderr {
		data.Output = &process.ProcessEvent_DataEvent_Stderr{Stderr: cp}
	} else {
		data.Output = &process.ProcessEvent_DataEvent_Stdout{Stdout: cp}
	}
	ev := &process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: data}}
	w.p.publish(ev)
	w.mu.Lock()
	defer w.mu.Unlock()
	// A client gone does not stop the run's output being drained: the
	// run ends with the request's context.
	w.send(ev)
	return len(b), nil
}

// Start runs the command as a run of the session and streams its output:
// a start event with the command's pid, data events as the output comes,
// and an end event with its exit code. The run is bounded by the level's
// limits (wall time above all) and ends if the client goes away.
func (ps *processService) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	sb := current(ctx)
	if req.Msg.Pty != nil {
		return unimplemented("a pty is not supported by moat")
	}
	// Judged before anything is made for the command.
	if _, err := launchCode(req.Msg.GetProcess(), sb.envs, sb.interpreter, ""); err != nil {
		return err
	}
	if err := ps.checkCwd(ctx, sb, req.Msg.GetProcess().GetCwd()); err != nil {
		return err
	}
	var spool *stdinSpool
	stdinDir := ""
	if req.Msg.GetStdin() {
		var err error
		if spool, err = ps.newStdinSpool(ctx, sb); err != nil {
			return err
		}
		stdinDir = spool.dir
	}
	code, err := launchCode(req.Msg.GetProcess(), sb.envs, sb.interpreter, stdinDir)
	if err != nil {
		if spool != nil {
			ps.endStdin(ctx, sb, spool)
		}
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	p := &proc{tag: req.Msg.GetTag(), config: req.Msg.GetProcess(), cancel: cancel, stdin: spool}
	sb.procs.add(p)
	defer sb.procs.remove(p)
	if spool != nil {
		// Before the command leaves the table, so that a pause (refused
		// while a command is listed) never comes between the command's
		// end and this, which would then resume the sandbox to clean up.
		// Not under the request's context: the spool goes even when the
		// client has.
		defer ps.endStdin(ctx, sb, spool)
	}
	defer p.closeSubs()
	var mu sync.Mutex
	send := func(ev *process.ProcessEvent) error { return stream.Send(&process.StartResponse{Event: ev}) }
	start := &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: p.pid}}}
	if err := send(start); err != nil {
		return err
	}
	res, err := ps.s.cfg.Sessions.RunSession(runCtx, sb.owner, sb.id, moat.Request{
		Code:   code,
		Stdout: &streamWriter{mu: &mu, send: send, p: p},
		Stderr: &streamWriter{mu: &mu, send: send, p: p, stderr: true},
	})
	if spool != nil {
		spool.end()
	}
	if err != nil {
		return rpcError(err)
	}
	end := endEvent(res, p)
	p.publish(end)
	mu.Lock()
	defer mu.Unlock()
	return send(end)
}

// checkCwd refuses a working directory that is not a directory of the
// session's, before anything runs, as envd refuses one that is missing.
func (ps *processService) checkCwd(ctx context.Context, sb *sandbox, cwd string) error {
	name, err := MapPath(cwd)
	if err != nil || name == "." {
		return nil // launchCode has judged it
	}
	sess, done, err := ps.s.cfg.Sessions.UseSession(ctx, sb.owner, sb.id)
	if err != nil {
		return rpcError(err)
	}
	defer done()
	fi, err := sess.Stat(ctx, name)
	if err == nil && !fi.IsDir {
		err = fmt.Errorf("e2b: cwd %s is not a directory: %w", homePath(name), moat.ErrInvalid)
	}
	if errors.Is(err, fs.ErrNotExist) {
		err = fmt.Errorf("e2b: cwd %s does not exist: %w", homePath(name), moat.ErrInvalid)
	}
	if err != nil {
		return fsError(err)
	}
	return nil
}

// endEvent describes how the command ended, as envd does: exited with its
// status, or killed by a signal (exit code -1), with moat's reason as the
// error when a limit ended it.
func endEvent(res *moat.Result, p *proc) *process.ProcessEvent {
	e := &process.ProcessEvent_EndEvent{ExitCode: int32(res.ExitCode), Exited: true, Status: fmt.Sprintf("exit status %d", res.ExitCode)}
	p.mu.Lock()
	killed := p.killed
	p.mu.Unlock()
	switch {
	case killed != "":
		e.ExitCode, e.Exited, e.Status = -1, false, "signal: "+killed
	case res.Signal != "":
		e.ExitCode, e.Exited, e.Status = -1, false, "signal: "+signalText(res.Signal)
	}
	// A signal the code got from itself (or from a process of its own)
	// is its own end, as an exit status is; the rest are moat's.
	if res.Reason != "" && res.Reason != moat.ReasonSignal && killed == "" {
		msg := fmt.Sprintf("moat: the command was ended: %s", res.Reason)
		e.Error = &msg
	}
	return &process.ProcessEvent{Event: &process.ProcessEvent_End{End: e}}
}

// signalText is how Go's os.ProcessState names a signal ("terminated" for
// SIGTERM), as envd's end events do; a name it does not know stays as moat
// gave it.
func signalText(name string) string {
	if n := unix.SignalNum(name); n != 0 {
		return n.String()
	}
	return name
}

// Connect follows a command in progress: a start event, then its events
// from now on (not the output it wrote before).
func (ps *processService) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	sb := current(ctx)
	p, err := sb.procs.find(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	c := p.subscribe()
	start := &process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: p.pid}}}
	if err := stream.Send(&process.ConnectResponse{Event: start}); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case ev, ok := <-c:
			if !ok {
				return nil
			}
			if err := stream.Send(&process.ConnectResponse{Event: ev}); err != nil {
				return err
			}
		}
	}
}

func (ps *processService) List(ctx context.Context, req *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	sb := current(ctx)
	out := &process.ListResponse{}
	procs := sb.procs.all()
	slices.SortFunc(procs, func(a, b *proc) int { return int(a.pid) - int(b.pid) })
	for _, p := range procs {
		info := &process.ProcessInfo{Config: p.config, Pid: p.pid}
		if p.tag != "" {
			info.Tag = &p.tag
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

// SendSignal ends the command, SIGTERM or SIGKILL alike: moat kills a
// run's whole tree.
func (ps *processService) SendSignal(ctx context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	sb := current(ctx)
	p, err := sb.procs.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	name := "killed"
	switch req.Msg.GetSignal() {
	case process.Signal_SIGNAL_SIGKILL:
	case process.Signal_SIGNAL_SIGTERM:
		name = "terminated"
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("e2b: signal %v: want SIGTERM or SIGKILL", req.Msg.GetSignal()))
	}
	p.mu.Lock()
	p.killed = name
	p.mu.Unlock()
	p.cancel()
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

// CloseStdin ends the command's input: it reads what was sent, then the
// end. For a command started without stdin (its input is always closed)
// it succeeds.
func (ps *processService) CloseStdin(ctx context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	sb := current(ctx)
	p, err := sb.procs.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.stdin != nil {
		if err := ps.closeStdin(ctx, sb, p.stdin); err != nil {
			return nil, err
		}
	}
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

// SendInput gives data to the command's input (sendStdin), in the order
// sent; it waits while the command has not read the last maxStdinPending
// messages.
func (ps *processService) SendInput(ctx context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	sb := current(ctx)
	p, err := sb.procs.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	in := req.Msg.GetInput()
	if in.GetPty() != nil {
		return nil, unimplemented("a pty is not supported by moat")
	}
	if p.stdin == nil {
		return nil, errNoStdin
	}
	if err := ps.send(ctx, sb, p.stdin, in.GetStdin()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.SendInputResponse{}), nil
}
