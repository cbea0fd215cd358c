// The file routes of a session: list, upload, download, delete.

package server

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"

	"github.com/moatsandbox/moat"
)

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
	if files == nil {
		files = []moat.FileInfo{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"files": files})
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
	rc, err := sess.ReadFile(r.Context(), r.PathValue("path"))
	if err != nil {
		return err
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	if f, ok := rc.(interface{ Stat() (os.FileInfo, error) }); ok {
		if st, err := f.Stat(); err == nil {
			// The length announced is what is sent, even if the file
			// changes meanwhile.
			w.Header().Set("Content-Length", strconv.FormatInt(st.Size(), 10))
			w.WriteHeader(http.StatusOK)
			io.CopyN(w, rc, st.Size())
			return nil
		}
	}
	w.WriteHeader(http.StatusOK)
	io.Copy(w, rc)
	return nil
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
	writeJSON(w, http.StatusOK, info)
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
