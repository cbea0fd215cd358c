// The file routes of a session: list, upload, download, delete.

package server

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/moatsandbox/moat"
)

// fileView is a file as the API shows it: its permissions as an octal
// string ("0644", with 4000, 2000 and 1000 for setuid, setgid and sticky),
// its kind as a word, never fs.FileMode's raw bits.
type fileView struct {
	Name string `json:"name"`
	// Type is "file", "dir", "symlink" or "other" (a fifo, socket or
	// device).
	Type    string    `json:"type"`
	Mode    string    `json:"mode"`
	Size    int64     `json:"size"`
	ModTime time.Time `json:"mod_time"`
	IsDir   bool      `json:"is_dir"`
}

func newFileView(fi moat.FileInfo) fileView {
	return fileView{Name: fi.Name, Type: fileType(fi.Mode), Mode: octalMode(fi.Mode), Size: fi.Size, ModTime: fi.ModTime, IsDir: fi.IsDir}
}

// fileType names the kind of file m describes.
func fileType(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "file"
	case m.IsDir():
		return "dir"
	case m&fs.ModeSymlink != 0:
		return "symlink"
	default:
		return "other"
	}
}

// octalMode is m's permission bits as chmod takes them, in four octal
// digits.
func octalMode(m fs.FileMode) string {
	bits := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		bits |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		bits |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		bits |= 0o1000
	}
	return fmt.Sprintf("%04o", bits)
}

func (s *Server) handleListFiles(w http.ResponseWriter, r *http.Request, owner string) error {
	sess, _, done, err := s.useSession(w, r, owner)
	if err != nil {
		return err
	}
	defer done()
	files, err := sess.ListFiles(r.Context())
	if err != nil {
		return err
	}
	out := make([]fileView, 0, len(files))
	for _, f := range files {
		out = append(out, newFileView(f))
	}
	writeJSON(w, http.StatusOK, map[string]any{"files": out})
	return nil
}

func (s *Server) handlePutFile(w http.ResponseWriter, r *http.Request, owner string) error {
	sess, _, done, err := s.useSession(w, r, owner)
	if err != nil {
		return err
	}
	defer done()
	name := r.PathValue("path")
	if r.ContentLength > int64(s.cfg.MaxFileBytes) {
		return fmt.Errorf("file of %d bytes is over the %v cap: %w", r.ContentLength, s.cfg.MaxFileBytes, errBodyTooLarge)
	}
	body := http.MaxBytesReader(w, r.Body, int64(s.cfg.MaxFileBytes))
	if err := sess.WriteFile(r.Context(), name, body); err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return fmt.Errorf("file over the %v cap: %w", s.cfg.MaxFileBytes, errBodyTooLarge)
		}
		return err
	}
	writeJSON(w, http.StatusCreated, map[string]any{"name": name})
	return nil
}

func (s *Server) handleGetFile(w http.ResponseWriter, r *http.Request, owner string) error {
	sess, _, done, err := s.useSession(w, r, owner)
	if err != nil {
		return err
	}
	defer done()
	name := r.PathValue("path")
	rc, err := sess.ReadFile(r.Context(), name)
	if err != nil {
		// A level refuses to read a directory in its own words (some
		// as not found): the answer says it plainly, with a code of its
		// own.
		if fi, serr := sess.Stat(r.Context(), name); serr == nil && fi.IsDir {
			return isDir(name)
		}
		return err
	}
	defer rc.Close()
	if f, ok := rc.(interface{ Stat() (os.FileInfo, error) }); ok {
		if st, err := f.Stat(); err == nil {
			if st.IsDir() {
				return isDir(name)
			}
			w.Header().Set("Content-Type", "application/octet-stream")
			// The length announced is what is sent, even if the file
			// changes meanwhile.
			w.Header().Set("Content-Length", strconv.FormatInt(st.Size(), 10))
			w.WriteHeader(http.StatusOK)
			io.CopyN(w, rc, st.Size())
			return nil
		}
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.WriteHeader(http.StatusOK)
	io.Copy(w, rc)
	return nil
}

// isDir is the error for downloading the directory name.
func isDir(name string) error {
	return fmt.Errorf("%q is a directory, which cannot be downloaded: list it with GET /v1/sessions/{id}/files and download its files one by one: %w", name, errIsDir)
}

func (s *Server) handleDeleteFile(w http.ResponseWriter, r *http.Request, owner string) error {
	sess, _, done, err := s.useSession(w, r, owner)
	if err != nil {
		return err
	}
	defer done()
	if err := sess.RemoveFile(r.Context(), r.PathValue("path")); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) handleStatFile(w http.ResponseWriter, r *http.Request, owner string) error {
	sess, _, done, err := s.useSession(w, r, owner)
	if err != nil {
		return err
	}
	defer done()
	info, err := sess.Stat(r.Context(), r.PathValue("path"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, newFileView(info))
	return nil
}

func (s *Server) handleMkdir(w http.ResponseWriter, r *http.Request, owner string) error {
	sess, _, done, err := s.useSession(w, r, owner)
	if err != nil {
		return err
	}
	defer done()
	name := r.PathValue("path")
	if err := sess.Mkdir(r.Context(), name); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, map[string]any{"name": name})
	return nil
}

// renameRequest is the body of POST /v1/sessions/{id}/rename.
type renameRequest struct {
	From string `json:"from"`
	To   string `json:"to"`
}

func (s *Server) handleRename(w http.ResponseWriter, r *http.Request, owner string) error {
	var req renameRequest
	if err := s.decode(w, r, &req); err != nil {
		return err
	}
	sess, _, done, err := s.useSession(w, r, owner)
	if err != nil {
		return err
	}
	defer done()
	if err := sess.Rename(r.Context(), req.From, req.To); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"from": req.From, "to": req.To})
	return nil
}
