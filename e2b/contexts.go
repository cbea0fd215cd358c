// The code interpreter's contexts (port 49999, /contexts), as
// @e2b/code-interpreter's createCodeContext, listCodeContexts,
// restartCodeContext and removeCodeContext call them, and runCode's
// context.
//
// A context is a namespace of globals of its own in the sandbox's one live
// interpreter, not a second interpreter: creating one costs a record, no
// process, and its cells run in the session as the default context's do,
// under the same limits and in the same run slots. It shares the
// sandbox's files, as E2B's contexts do, and also its process: it is no
// isolation boundary. A cell of one context can reach another's names
// (through sys or gc); E2B's contexts, separate kernels of the sandbox's
// one user, are no boundary either. A context's cwd is the working
// directory of its cells (set for the cell, then put back).

package e2b

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"path"
	"slices"
	"strings"
)

// maxContexts caps a sandbox's contexts, which its record keeps.
const maxContexts = 32

// codeContext is a context as E2B's API shows it, and as the sandbox's
// record keeps it.
type codeContext struct {
	ID       string `json:"id"`
	Language string `json:"language"`
	// Cwd is the E2B path of its cells' working directory.
	Cwd string `json:"cwd"`
	// gen counts its restarts: its namespace is id/gen, so that a
	// restart starts a fresh one.
	Gen int `json:"gen,omitempty"`
}

// view is c without what only the record keeps.
func (c codeContext) view() map[string]string {
	return map[string]string{"id": c.ID, "language": c.Language, "cwd": c.Cwd}
}

// namespace is the key of c's globals in the live interpreter.
func (c codeContext) namespace() string { return fmt.Sprintf("%s/%d", c.ID, c.Gen) }

func newContextID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6], b[8] = b[6]&0x0f|0x40, b[8]&0x3f|0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// interpreterRoutes serves the code interpreter's port for the sandbox in
// the request's context. /execute needs the sandbox's X-Access-Token;
// /contexts takes its E2B-Traffic-Access-Token too, which is all the SDK
// sends there.
func (s *Server) interpreterRoutes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /execute", func(w http.ResponseWriter, r *http.Request) {
		s.handleExecute(w, r, current(r.Context()))
	})
	handle := func(pattern string, h func(http.ResponseWriter, *http.Request, *sandbox) error) {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			if err := h(w, r, current(r.Context())); err != nil {
				s.writeError(w, r, err)
			}
		})
	}
	handle("POST /contexts", s.handleCreateContext)
	handle("GET /contexts", s.handleListContexts)
	handle("DELETE /contexts/{id}", s.handleRemoveContext)
	handle("POST /contexts/{id}/restart", s.handleRestartContext)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, errorf(http.StatusNotFound, "%s %s is not served by moat's code interpreter", r.Method, r.URL.Path))
	})
	return mux
}

// interpreterAllowed says whether r carries a token that opens sb's code
// interpreter for its path.
func interpreterAllowed(r *http.Request, sb *sandbox) bool {
	if checkAccess(r, sb) {
		return true
	}
	p := r.URL.Path
	return (p == "/contexts" || strings.HasPrefix(p, "/contexts/")) && path.Clean(p) == p && checkTraffic(r, sb)
}

// saveContexts sets sb's contexts to cs and records them; on failure sb
// keeps its contexts as they were. sb.ctxMu is held.
func (s *Server) saveContexts(sb *sandbox, cs []codeContext) error {
	old := sb.contexts
	sb.contexts = cs
	front, err := json.Marshal(sb.record())
	if err == nil {
		err = s.cfg.Sessions.SetFront(sb.owner, sb.id, front)
	}
	if err != nil {
		sb.contexts = old
		return err
	}
	return nil
}

type createContextBody struct {
	Language string `json:"language"`
	Cwd      string `json:"cwd"`
}

func (s *Server) handleCreateContext(w http.ResponseWriter, r *http.Request, sb *sandbox) error {
	var b createContextBody
	if err := decodeBody(r, &b); err != nil {
		return err
	}
	lang := strings.ToLower(b.Language)
	if lang == "" {
		lang = "python"
	}
	if lang != "python" {
		return errorf(http.StatusBadRequest, "language %q: moat runs python only", b.Language)
	}
	if b.Cwd == "" {
		b.Cwd = Home
	}
	if len(b.Cwd) > 1024 {
		return errorf(http.StatusBadRequest, "cwd of %d bytes: at most 1024", len(b.Cwd))
	}
	name, err := MapPath(b.Cwd)
	if err != nil {
		return errorf(http.StatusBadRequest, "%v", err)
	}
	c := codeContext{ID: newContextID(), Language: lang, Cwd: homePath(name)}
	sb.ctxMu.Lock()
	defer sb.ctxMu.Unlock()
	if len(sb.contexts) >= maxContexts {
		return errorf(http.StatusConflict, "sandbox %s has %d contexts, the most moat keeps: remove one", sb.id, len(sb.contexts))
	}
	if err := s.saveContexts(sb, append(slices.Clone(sb.contexts), c)); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, c.view())
	return nil
}

func (s *Server) handleListContexts(w http.ResponseWriter, r *http.Request, sb *sandbox) error {
	sb.ctxMu.Lock()
	out := make([]map[string]string, 0, len(sb.contexts))
	for _, c := range sb.contexts {
		out = append(out, c.view())
	}
	sb.ctxMu.Unlock()
	writeJSON(w, http.StatusOK, out)
	return nil
}

// contextIndex is the index of context id in sb's, or an error. sb.ctxMu
// is held.
func contextIndex(sb *sandbox, id string) (int, error) {
	i := slices.IndexFunc(sb.contexts, func(c codeContext) bool { return c.ID == id })
	if i < 0 {
		return 0, errorf(http.StatusNotFound, "context %q not found in sandbox %s", id, sb.id)
	}
	return i, nil
}

// handleRemoveContext forgets a context; its names are dropped from the
// live interpreter at its next cell.
func (s *Server) handleRemoveContext(w http.ResponseWriter, r *http.Request, sb *sandbox) error {
	sb.ctxMu.Lock()
	defer sb.ctxMu.Unlock()
	i, err := contextIndex(sb, r.PathValue("id"))
	if err != nil {
		return err
	}
	if err := s.saveContexts(sb, slices.Delete(slices.Clone(sb.contexts), i, i+1)); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// handleRestartContext gives a context a fresh namespace: its next cell
// sees none of the names of the cells before.
func (s *Server) handleRestartContext(w http.ResponseWriter, r *http.Request, sb *sandbox) error {
	sb.ctxMu.Lock()
	defer sb.ctxMu.Unlock()
	i, err := contextIndex(sb, r.PathValue("id"))
	if err != nil {
		return err
	}
	cs := slices.Clone(sb.contexts)
	cs[i].Gen++
	if err := s.saveContexts(sb, cs); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// cellContext returns what a cell of context id runs with: its namespace
// and working directory (a session file name), and the namespaces of
// every context of sb (the runner drops the others). An empty id is the
// default context: the interpreter's own globals, and no cwd.
func (s *Server) cellContext(sb *sandbox, id string) (ns string, cwd *string, live []string, err error) {
	sb.ctxMu.Lock()
	defer sb.ctxMu.Unlock()
	live = []string{}
	for _, c := range sb.contexts {
		live = append(live, c.namespace())
	}
	if id == "" {
		return "", nil, live, nil
	}
	i, err := contextIndex(sb, id)
	if err != nil {
		return "", nil, nil, err
	}
	name, err := MapPath(sb.contexts[i].Cwd)
	if err != nil {
		return "", nil, nil, errorf(http.StatusBadRequest, "%v", err)
	}
	return sb.contexts[i].namespace(), &name, live, nil
}
