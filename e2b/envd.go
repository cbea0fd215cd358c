// The sandbox side: what E2B's in-sandbox daemon (envd) serves, routed by
// the E2b-Sandbox-Id and E2b-Sandbox-Port headers and checked against the
// sandbox's X-Access-Token.

package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strings"
	"sync/atomic"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem/filesystemconnect"
	"github.com/moatsandbox/moat/e2b/internal/envd/process/processconnect"
)

// Home is E2B's home directory, /home/user: the session's working
// directory.
const Home = "/home/user"

// MapPath returns the session file name (moat.Files) of an E2B path: a path
// under Home, or one relative to it, is the file of the same name relative
// to the session's working directory, and Home itself is ".". Any other
// path is refused with an error wrapping moat.ErrInvalid: a sandbox's files
// are its session's and nothing else of the machine it runs on.
func MapPath(p string) (string, error) {
	if p == "" {
		return ".", nil
	}
	if !strings.HasPrefix(p, "/") {
		p = Home + "/" + p
	}
	c := path.Clean(p)
	if c == Home {
		return ".", nil
	}
	name, ok := strings.CutPrefix(c, Home+"/")
	if !ok {
		return "", fmt.Errorf("e2b: path %q: moat serves the files under %s only: %w", p, Home, moat.ErrInvalid)
	}
	return name, nil
}

type ctxKey struct{}

// current is the sandbox a sandbox-side request is for, set by
// serveSandbox.
func current(ctx context.Context) *sandbox {
	sb, _ := ctx.Value(ctxKey{}).(*sandbox)
	return sb
}

func (s *Server) envdRoutes() http.Handler {
	mux := http.NewServeMux()
	opts := connectOptions()
	mux.Handle(processconnect.NewProcessHandler(&processService{s: s}, opts...))
	mux.Handle(filesystemconnect.NewFilesystemHandler(&filesystemService{s: s}, opts...))
	mux.HandleFunc("GET /files", s.handleReadFile)
	mux.HandleFunc("POST /files", s.handleWriteFile)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, errorf(http.StatusNotFound, "%s %s is not served by moat's envd", r.Method, r.URL.Path))
	})
	return mux
}

// serveSandbox serves a request for a sandbox: an unknown or ended one is
// 502, as E2B's proxy answers; any request but GET /health needs the
// sandbox's access token.
func (s *Server) serveSandbox(w http.ResponseWriter, r *http.Request, envd http.Handler) {
	id := r.Header.Get("E2b-Sandbox-Id")
	sb, _, ok := s.lookupSandbox(id)
	if !ok {
		s.writeError(w, r, errorf(http.StatusBadGateway, "sandbox %q not found: it was killed, timed out or never existed", id))
		return
	}
	switch port := r.Header.Get("E2b-Sandbox-Port"); port {
	case EnvdPort, "":
	case InterpreterPort:
		if !interpreterAllowed(r, sb) {
			s.writeError(w, r, errorf(http.StatusUnauthorized, "missing or wrong X-Access-Token (or E2B-Traffic-Access-Token for /contexts) for sandbox %s", id))
			return
		}
		s.interp.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, sb)))
		return
	default:
		s.writeError(w, r, errorf(http.StatusBadGateway, "port %s of sandbox %s is not open: moat serves envd (%s) only", port, id, EnvdPort))
		return
	}
	if r.Method == http.MethodGet && r.URL.Path == "/health" {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if !checkAccess(r, sb) {
		s.writeError(w, r, errorf(http.StatusUnauthorized, "missing or wrong X-Access-Token for sandbox %s", id))
		return
	}
	envd.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, sb)))
}

// envdStatus is the status envd's HTTP routes answer err with.
func envdStatus(err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return &apiError{http.StatusNotFound, err.Error()}
	case errors.Is(err, moat.ErrInvalid):
		return &apiError{http.StatusBadRequest, err.Error()}
	}
	return err
}

func (s *Server) handleReadFile(w http.ResponseWriter, r *http.Request) {
	sb := current(r.Context())
	name, err := MapPath(r.URL.Query().Get("path"))
	if err == nil && name == "." {
		err = fmt.Errorf("e2b: %s is a directory: %w", Home, moat.ErrInvalid)
	}
	if err != nil {
		s.writeError(w, r, envdStatus(err))
		return
	}
	sess, done, err := s.cfg.Sessions.UseSession(r.Context(), sb.owner, sb.id)
	if err != nil {
		s.writeError(w, r, envdStatus(err))
		return
	}
	defer done()
	info, err := sess.Stat(r.Context(), name)
	if err == nil && info.IsDir {
		err = fmt.Errorf("e2b: %s is a directory: %w", homePath(name), moat.ErrInvalid)
	}
	if err != nil {
		s.writeError(w, r, envdStatus(err))
		return
	}
	rc, err := sess.ReadFile(r.Context(), name)
	if err != nil {
		s.writeError(w, r, envdStatus(err))
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": path.Base(name)}))
	w.WriteHeader(http.StatusOK)
	io.Copy(w, rc)
}

// entryJSON is what POST /files answers for each file written.
type entryJSON struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// handleWriteFile is POST /files: the body is the file (octet-stream, at
// ?path=), or multipart parts named "file", each at ?path= or, without it,
// at its own file name. Each file is capped at MaxFileBytes (413).
func (s *Server) handleWriteFile(w http.ResponseWriter, r *http.Request) {
	sb := current(r.Context())
	if err := s.writeFiles(w, r, sb); err != nil {
		s.writeError(w, r, envdStatus(err))
	}
}

func (s *Server) writeFiles(w http.ResponseWriter, r *http.Request, sb *sandbox) error {
	if r.Header.Get("Content-Encoding") != "" {
		return errorf(http.StatusBadRequest, "Content-Encoding %q is not supported by moat: send the file as it is", r.Header.Get("Content-Encoding"))
	}
	qpath := r.URL.Query().Get("path")
	sess, done, err := s.cfg.Sessions.UseSession(r.Context(), sb.owner, sb.id)
	if err != nil {
		return err
	}
	defer done()
	var written []entryJSON
	put := func(p string, body io.Reader) error {
		name, err := MapPath(p)
		if err != nil {
			return err
		}
		if name == "." {
			return fmt.Errorf("e2b: %s is a directory: %w", Home, moat.ErrInvalid)
		}
		lr := &capReader{r: body, left: int64(s.cfg.MaxFileBytes)}
		if err := sess.WriteFile(r.Context(), name, lr); err != nil {
			if lr.over {
				return errorf(http.StatusRequestEntityTooLarge, "file %s is over the %v cap", homePath(name), s.cfg.MaxFileBytes)
			}
			return err
		}
		written = append(written, entryJSON{Name: path.Base(name), Type: "file", Path: homePath(name)})
		return nil
	}
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if mt == "multipart/form-data" {
		guard := &multipartGuard{r: r.Body}
		mr := multipart.NewReader(guard, params["boundary"])
		for {
			part, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if errors.Is(err, errPartOverhead) {
				return errorf(http.StatusRequestEntityTooLarge, "multipart body: more than %d bytes of a part's header, or of parts not named \"file\"", maxPartOverhead)
			}
			if err != nil {
				return errorf(http.StatusBadRequest, "multipart body: %v", err)
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			p := qpath
			if p == "" {
				// The SDKs name each part for its whole path, which
				// Part.FileName cuts to its last element.
				_, dp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
				p = dp["filename"]
			}
			err = put(p, guard.contents(part))
			if cerr := part.Close(); err == nil && errors.Is(cerr, errPartOverhead) {
				err = errorf(http.StatusRequestEntityTooLarge, "multipart body: more than %d bytes of parts not named \"file\"", maxPartOverhead)
			}
			if err != nil {
				return err
			}
		}
		if len(written) == 0 {
			return errorf(http.StatusBadRequest, "no part named \"file\" in the multipart body")
		}
	} else {
		if qpath == "" {
			return errorf(http.StatusBadRequest, "path is missing")
		}
		if err := put(qpath, r.Body); err != nil {
			return err
		}
	}
	writeJSON(w, http.StatusOK, written)
	return nil
}

// maxPartOverhead caps what a multipart upload may hold between two reads
// of a file's contents: a part's header, boundaries, parts not named
// "file". mime/multipart keeps a part's whole header in memory, up to
// 10MiB, and that for each upload in progress: thirty uploads holding a
// 9MiB header each held 270MB of the host's heap.
const maxPartOverhead = 64 << 10

var errPartOverhead = errors.New("e2b: a multipart part's header over the cap")

// multipartGuard counts the bytes the multipart reader takes from the body
// outside a file's contents, and fails past maxPartOverhead; each read of
// a file's contents starts the count anew. (The contents may be read from
// another goroutine than the multipart reader's, hence the atomics.)
type multipartGuard struct {
	r      io.Reader
	used   atomic.Int64
	inFile atomic.Bool
}

func (g *multipartGuard) Read(p []byte) (int, error) {
	n, err := g.r.Read(p)
	if !g.inFile.Load() && g.used.Add(int64(n)) > maxPartOverhead {
		return n, errPartOverhead
	}
	return n, err
}

// contents returns a reader of part's contents whose reads the guard does
// not count.
func (g *multipartGuard) contents(part io.Reader) io.Reader {
	return readerFunc(func(p []byte) (int, error) {
		g.inFile.Store(true)
		defer g.inFile.Store(false)
		n, err := part.Read(p)
		g.used.Store(0)
		return n, err
	})
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }

// capReader reads at most left bytes and fails past them, so that a file
// over the cap is refused and not cut.
type capReader struct {
	r    io.Reader
	left int64
	over bool
}

func (c *capReader) Read(p []byte) (int, error) {
	if c.left < 0 {
		c.over = true
		return 0, errors.New("e2b: file over the cap")
	}
	if int64(len(p)) > c.left+1 {
		p = p[:c.left+1]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	if c.left < 0 {
		c.over = true
		return n, errors.New("e2b: file over the cap")
	}
	return n, err
}
