// The code interpreter's POST /execute (port 49999), as
// @e2b/code-interpreter's runCode calls it: the code runs in the session
// (in its live interpreter when the template keeps one), and the answer is
// NDJSON, one object per line.

package e2b

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/moatsandbox/moat"
)

// InterpreterPort is the code interpreter's port, in E2b-Sandbox-Port.
const InterpreterPort = "49999"

// cellRunner is the Python that runs a cell: the code, then the value of
// its last expression as the main result, or the exception it raised, each
// on a line of its own that starts with the run's marker. Its input is
// base64 JSON, never Python built from the request. In a live interpreter
// the cell's names stay for the next cell; the runner's own are removed.
//
// The marker is no secret from the cell, which runs in the same process: a
// cell can forge its own result or error, nothing else. The exit code,
// the reason and the output caps are moat's, judged on the host.
const cellRunner = `def _moat_cell(c):
    import ast, base64, json, os, sys, traceback
    c = json.loads(base64.b64decode(c))
    mark = c["mark"]
    def say(kind, **kw):
        sys.stdout.flush()
        kw["type"] = kind
        sys.stdout.write("\n" + mark + json.dumps(kw) + "\n")
        sys.stdout.flush()
    # The session's directory: where the interpreter started, taken at
    # its first cell, before any cell could change directory.
    home = sys.__dict__.setdefault("_moat_home", os.getcwd())
    saved = dict(os.environ)
    os.environ.update(c["envs"])
    # The contexts' namespaces; those of contexts removed or restarted
    # since are dropped.
    spaces = sys.__dict__.setdefault("_moat_contexts", {})
    for k in [k for k in spaces if k not in c["live"]]:
        del spaces[k]
    g = globals()
    if c["ns"]:
        import builtins
        g = spaces.get(c["ns"])
        if g is None:
            g = spaces[c["ns"]] = {"__name__": "__main__", "__builtins__": builtins}
    back = None
    try:
        if c["cwd"] is not None:
            back = os.getcwd()
            os.chdir(os.path.join(home, c["cwd"]))
        tree = ast.parse(c["code"], "<cell>")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), g)
        if last is not None:
            v = eval(compile(last, "<cell>", "eval"), g)
            if v is not None:
                say("result", text=repr(v), is_main_result=True)
    except SystemExit:
        raise
    except BaseException as e:
        tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        say("error", name=type(e).__name__, value=str(e), traceback="".join(tb))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if back is not None:
            os.chdir(back)
try:
    _moat_cell(%q)
finally:
    del _moat_cell
`

// executeBody is what runCode sends.
type executeBody struct {
	Code      string            `json:"code"`
	ContextID string            `json:"context_id"`
	Language  string            `json:"language"`
	EnvVars   map[string]string `json:"env_vars"`
}

// handleExecute is POST /execute: stdout and stderr line by line as they
// come, the main result, an error with name, value and traceback, the
// execution count, then end_of_execution.
func (s *Server) handleExecute(w http.ResponseWriter, r *http.Request, sb *sandbox) {
	var b executeBody
	if err := decodeBody(r, &b); err != nil {
		s.writeError(w, r, err)
		return
	}
	ns, cwd, live, err := s.cellContext(sb, b.ContextID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if l := strings.ToLower(b.Language); l != "" && l != "python" {
		s.writeError(w, r, errorf(http.StatusBadRequest, "language %q: moat runs python only", b.Language))
		return
	}
	envs := map[string]string{}
	for k, v := range sb.envs {
		envs[k] = v
	}
	for k, v := range b.EnvVars {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.ContainsRune(v, 0) {
			s.writeError(w, r, errorf(http.StatusBadRequest, "environment variable %q: an empty name, \"=\" in it, or NUL in it or its value", k))
			return
		}
		envs[k] = v
	}
	mark := newSecret("\x1emoat-")
	j, _ := json.Marshal(map[string]any{"code": b.Code, "envs": envs, "mark": mark, "ns": ns, "cwd": cwd, "live": live})
	code := fmt.Appendf(nil, cellRunner, base64.StdEncoding.EncodeToString(j))

	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	flusher, _ := w.(http.Flusher)
	var mu sync.Mutex
	emit := func(v map[string]any) {
		mu.Lock()
		defer mu.Unlock()
		line, _ := json.Marshal(v)
		w.Write(append(line, '\n'))
		if flusher != nil {
			flusher.Flush()
		}
	}
	stdout := &lineSplitter{kind: "stdout", mark: mark, emit: emit}
	stderr := &lineSplitter{kind: "stderr", emit: emit}
	res, err := s.cfg.Sessions.RunSession(r.Context(), sb.owner, sb.id, moat.Request{Code: code, Stdout: stdout, Stderr: stderr})
	stdout.flush()
	stderr.flush()
	n := sb.executions.Add(1)
	switch {
	case err != nil:
		emit(map[string]any{"type": "error", "name": "SandboxError", "value": err.Error(), "traceback": ""})
	case res.Reason != "":
		emit(map[string]any{"type": "error", "name": "SandboxLimitError", "value": fmt.Sprintf("moat ended the run: %s (exit code %d)", res.Reason, res.ExitCode), "traceback": ""})
	case res.ExitCode != 0 && !stdout.sawError:
		emit(map[string]any{"type": "error", "name": "SystemExit", "value": fmt.Sprint(res.ExitCode), "traceback": ""})
	}
	emit(map[string]any{"type": "number_of_executions", "execution_count": n})
	emit(map[string]any{"type": "end_of_execution"})
}

// lineSplitter turns a stream into NDJSON objects, one per line: the lines
// that start with mark are the cell runner's own objects, passed on as
// they are (of the types result and error only); the rest are output of
// kind.
type lineSplitter struct {
	kind, mark string
	emit       func(map[string]any)
	buf        []byte
	sawError   bool
	// pending holds back an empty line, which may be the one the runner
	// writes before its marker line rather than the cell's.
	pending bool
}

func (l *lineSplitter) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			break
		}
		l.line(string(l.buf[:i+1]))
		l.buf = l.buf[i+1:]
	}
	return len(p), nil
}

func (l *lineSplitter) line(s string) {
	if l.mark != "" && strings.HasPrefix(s, l.mark) {
		// The newline held back was the runner's, written before its
		// marker line.
		l.pending = false
		var v map[string]any
		if json.Unmarshal([]byte(strings.TrimPrefix(s, l.mark)), &v) == nil && (v["type"] == "result" || v["type"] == "error") {
			if v["type"] == "error" {
				l.sawError = true
			}
			l.emit(v)
		}
		return
	}
	if l.pending {
		l.pending = false
		l.out("\n")
	}
	if l.mark != "" && s == "\n" {
		l.pending = true
		return
	}
	l.out(s)
}

func (l *lineSplitter) out(s string) {
	l.emit(map[string]any{"type": l.kind, "text": s})
}

func (l *lineSplitter) flush() {
	if l.pending {
		l.out("\n")
		l.pending = false
	}
	if len(l.buf) > 0 {
		l.out(string(l.buf))
		l.buf = nil
	}
}

var _ io.Writer = (*lineSplitter)(nil)
