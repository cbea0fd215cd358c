// filesystem.Filesystem: the session's files under /home/user.

package e2b

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem/filesystemconnect"
)

type filesystemService struct {
	filesystemconnect.UnimplementedFilesystemHandler
	s *Server
}

// fsError maps a file operation's error to the Connect code envd uses.
func fsError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, fs.ErrExist):
		return connect.NewError(connect.CodeAlreadyExists, err)
	case errors.Is(err, moat.ErrInvalid):
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	return rpcError(err)
}

// use maps p and marks the current sandbox's session busy.
func (f *filesystemService) use(ctx context.Context, p string) (string, moat.Session, func(), error) {
	name, err := MapPath(p)
	if err != nil {
		return "", nil, nil, fsError(err)
	}
	sb := current(ctx)
	sess, done, err := f.s.cfg.Sessions.UseSession(ctx, sb.owner, sb.id)
	if err != nil {
		return "", nil, nil, rpcError(err)
	}
	return name, sess, done, nil
}

func entry(fi moat.FileInfo) *filesystem.EntryInfo {
	e := &filesystem.EntryInfo{
		Name: path.Base(fi.Name), Path: homePath(fi.Name), Size: fi.Size,
		Mode: uint32(fi.Mode.Perm()), Permissions: fi.Mode.String(),
		Owner: "user", Group: "user", ModifiedTime: timestamppb.New(fi.ModTime),
		Type: filesystem.FileType_FILE_TYPE_FILE,
	}
	switch {
	case fi.IsDir || fi.Mode.IsDir():
		e.Type = filesystem.FileType_FILE_TYPE_DIRECTORY
	case fi.Mode&fs.ModeSymlink != 0:
		e.Type = filesystem.FileType_FILE_TYPE_SYMLINK
	}
	return e
}

// homeEntry is the entry of /home/user itself.
func homeEntry() *filesystem.EntryInfo {
	return &filesystem.EntryInfo{Name: "user", Path: Home, Type: filesystem.FileType_FILE_TYPE_DIRECTORY,
		Mode: 0o755, Permissions: (fs.ModeDir | 0o755).String(), Owner: "user", Group: "user", ModifiedTime: timestamppb.New(time.Now())}
}

func (f *filesystemService) stat(ctx context.Context, sess moat.Session, name string) (*filesystem.EntryInfo, error) {
	if name == "." {
		return homeEntry(), nil
	}
	fi, err := sess.Stat(ctx, name)
	if err != nil {
		return nil, fsError(err)
	}
	return entry(fi), nil
}

func (f *filesystemService) Stat(ctx context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	name, sess, done, err := f.use(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	defer done()
	e, err := f.stat(ctx, sess, name)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystem.StatResponse{Entry: e}), nil
}

// ListDir lists the entries under the path down to depth levels (0 is 1).
func (f *filesystemService) ListDir(ctx context.Context, req *connect.Request[filesystem.ListDirRequest]) (*connect.Response[filesystem.ListDirResponse], error) {
	name, sess, done, err := f.use(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	defer done()
	if name != "." {
		fi, err := sess.Stat(ctx, name)
		if err != nil {
			return nil, fsError(err)
		}
		if !fi.IsDir {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("e2b: %s is not a directory", homePath(name)))
		}
	}
	depth := int(req.Msg.GetDepth())
	if depth < 1 {
		depth = 1
	}
	all, err := sess.ListFiles(ctx)
	if err != nil {
		return nil, fsError(err)
	}
	prefix := ""
	if name != "." {
		prefix = name + "/"
	}
	out := &filesystem.ListDirResponse{}
	for _, fi := range all {
		rest, ok := strings.CutPrefix(fi.Name, prefix)
		if !ok || rest == "" || strings.Count(rest, "/") >= depth || hiddenName(fi.Name) {
			continue
		}
		out.Entries = append(out.Entries, entry(fi))
	}
	slices.SortFunc(out.Entries, func(a, b *filesystem.EntryInfo) int { return strings.Compare(a.Path, b.Path) })
	return connect.NewResponse(out), nil
}

// MakeDir creates the directory and its parents; one that exists already
// is AlreadyExists, as envd answers.
func (f *filesystemService) MakeDir(ctx context.Context, req *connect.Request[filesystem.MakeDirRequest]) (*connect.Response[filesystem.MakeDirResponse], error) {
	name, sess, done, err := f.use(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	defer done()
	if name == "." {
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("e2b: %s exists", Home))
	}
	if _, err := sess.Stat(ctx, name); err == nil {
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("e2b: %s exists", homePath(name)))
	}
	if err := sess.Mkdir(ctx, name); err != nil {
		return nil, fsError(err)
	}
	e, err := f.stat(ctx, sess, name)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystem.MakeDirResponse{Entry: e}), nil
}

func (f *filesystemService) Move(ctx context.Context, req *connect.Request[filesystem.MoveRequest]) (*connect.Response[filesystem.MoveResponse], error) {
	from, sess, done, err := f.use(ctx, req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	defer done()
	to, err := MapPath(req.Msg.GetDestination())
	if err != nil {
		return nil, fsError(err)
	}
	if from == "." || to == "." {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("e2b: %s itself cannot be moved or replaced", Home))
	}
	if err := sess.Rename(ctx, from, to); err != nil {
		return nil, fsError(err)
	}
	e, err := f.stat(ctx, sess, to)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystem.MoveResponse{Entry: e}), nil
}

// Remove removes a file, or a directory with everything in it, as envd
// does.
func (f *filesystemService) Remove(ctx context.Context, req *connect.Request[filesystem.RemoveRequest]) (*connect.Response[filesystem.RemoveResponse], error) {
	name, sess, done, err := f.use(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	defer done()
	if name == "." {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("e2b: %s itself cannot be removed", Home))
	}
	fi, err := sess.Stat(ctx, name)
	if err != nil {
		return nil, fsError(err)
	}
	if fi.IsDir {
		all, err := sess.ListFiles(ctx)
		if err != nil {
			return nil, fsError(err)
		}
		var inside []string
		for _, c := range all {
			if strings.HasPrefix(c.Name, name+"/") {
				inside = append(inside, c.Name)
			}
		}
		if len(inside) > maxRemoveOneByOne {
			if err := f.removeByRun(ctx, current(ctx), name); err != nil {
				return nil, err
			}
			return connect.NewResponse(&filesystem.RemoveResponse{}), nil
		}
		// Deepest first, so that each directory is empty when its turn
		// comes.
		slices.SortFunc(inside, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
		for _, c := range inside {
			if err := sess.RemoveFile(ctx, c); err != nil {
				return nil, fsError(err)
			}
		}
	}
	if err := sess.RemoveFile(ctx, name); err != nil {
		return nil, fsError(err)
	}
	return connect.NewResponse(&filesystem.RemoveResponse{}), nil
}

// maxRemoveOneByOne is the most entries a directory Remove removes one
// file operation at a time. Each is an exec into the sandbox at the
// container and microvm levels (tens of milliseconds of the host's), and
// a listing holds up to 100000: one request was hours of them. A larger
// directory is removed by one run of the session instead.
const maxRemoveOneByOne = 256

// removeRunner is the Python of that run: it removes the name, relative to
// the session's directory (found as childLauncher finds it), with
// shutil.rmtree, which never follows a symbolic link, with the code's own
// rights inside the sandbox. Its input is base64 JSON.
const removeRunner = `def _moat_rm(c):
    import base64, json, os, shutil
    c = json.loads(base64.b64decode(c))
    home = (os.environ.get("HOME") or os.getcwd()) if c["interpreter"] else os.getcwd()
    p = os.path.join(home, c["name"])
    if os.path.islink(p) or not os.path.isdir(p):
        os.unlink(p)
    else:
        shutil.rmtree(p)
try:
    _moat_rm(%q)
finally:
    del _moat_rm
`

// removeByRun removes name, a directory of the session's, and all in it, by
// one run of the session: one run slot and one run's limits, whatever it
// holds.
func (f *filesystemService) removeByRun(ctx context.Context, sb *sandbox, name string) error {
	j, err := json.Marshal(map[string]any{"name": name, "interpreter": sb.interpreter})
	if err != nil {
		return err
	}
	var stderr bytes.Buffer
	res, err := f.s.cfg.Sessions.RunSession(ctx, sb.owner, sb.id, moat.Request{
		Code: fmt.Appendf(nil, removeRunner, base64.StdEncoding.EncodeToString(j)), Stderr: &stderr})
	if err != nil {
		return rpcError(err)
	}
	if res.ExitCode != 0 || res.Reason != "" {
		lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
		return connect.NewError(connect.CodeInternal, fmt.Errorf("e2b: remove %s: the run that removes it ended with exit code %d %s: %s",
			homePath(name), res.ExitCode, res.Reason, lines[len(lines)-1]))
	}
	return nil
}
