package container

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	dimage "github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"

	"github.com/moatsandbox/moat/image"
)

// ImageLabel is the label of an imported image that holds its root
// filesystem's full key (image.Config.Key). An image under the right tag
// without the right label is not taken for the image.
const ImageLabel = "moat.image.key"

// ImageState says what the Docker engine holds of the image of an
// image.Config.
type ImageState struct {
	// Tag is the image's reference in the engine (image.Config.Tag).
	Tag string `json:"tag"`
	// Present is true when the engine holds Tag labelled with the key; ID
	// is then its ID.
	Present bool   `json:"present"`
	ID      string `json:"id,omitempty"`
	// Imported is true when ImportImage imported it just now.
	Imported bool `json:"imported"`
}

// ImportImage makes sure the Docker engine named by the environment
// (DOCKER_HOST, or the local socket) holds the root filesystem of cfg,
// which image.BuildRootFS made, as the image cfg.Tag() labelled with its
// key: it imports the root filesystem unless that image is there already
// (or cfg.Force is set). The image runs as 65534:65534 in image.WorkDir
// with image.Python as its command; the contents of /dev, /proc and /sys
// and any sockets, fifos and device nodes are left out.
//
// When no engine answers, the error wraps moat.ErrUnavailable; when the
// root filesystem is not built, image.ErrNotBuilt. Each step is reported
// on cfg.Progress.
func ImportImage(ctx context.Context, cfg image.Config) (ImageState, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return ImageState{}, err
	}
	cli, err := engineClient(ctx)
	if err != nil {
		return ImageState{Tag: cfg.Tag()}, err
	}
	defer cli.Close()
	p := image.NewProgress(cfg.Progress, cfg.Terminal)
	defer p.Clear()
	return importImage(ctx, cli, cfg, p)
}

// InspectImage reports whether the Docker engine named by the environment
// holds the image of cfg; it never imports anything. When no engine
// answers, the error wraps moat.ErrUnavailable.
func InspectImage(ctx context.Context, cfg image.Config) (ImageState, error) {
	cfg = cfg.WithDefaults()
	st := ImageState{Tag: cfg.Tag()}
	cli, err := engineClient(ctx)
	if err != nil {
		return st, err
	}
	defer cli.Close()
	st.ID, st.Present, err = inspectImage(ctx, cli, st.Tag, cfg.Key())
	return st, err
}

// engineClient connects to the engine named by the environment,
// negotiating the API version, and checks that it answers.
func engineClient(ctx context.Context) (*client.Client, error) {
	cli, err := newClient()
	if err != nil {
		return nil, unavailable("no Docker client", "set DOCKER_HOST or run scripts/setup-docker.sh", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := cli.Ping(pctx); err != nil {
		host := cli.DaemonHost()
		cli.Close()
		return nil, unavailable("no Docker engine answers at "+host, "run scripts/setup-docker.sh as root", err)
	}
	return cli, nil
}

func importImage(ctx context.Context, cli client.APIClient, cfg image.Config, p *image.Progress) (ImageState, error) {
	key, tag := cfg.Key(), cfg.Tag()
	st := ImageState{Tag: tag}
	if !cfg.Force {
		id, ok, err := inspectImage(ctx, cli, tag, key)
		if err != nil {
			return st, err
		}
		if ok {
			p.Say("docker image %s: already present (%s), nothing to do", tag, shortID(imageID(id)))
			st.Present, st.ID = true, id
			return st, nil
		}
	}
	root := image.Path(cfg)
	if _, err := os.Lstat(root); err != nil {
		return st, fmt.Errorf("container: %s: %w", root, image.ErrNotBuilt)
	}
	total := image.GetStatus(cfg).Size
	p.Say("step 3/3 docker import %s: importing %s (%s)", tag, root, image.HumanSize(total))
	start := time.Now()
	pr, pw := io.Pipe()
	go func() {
		// The bar counts the tar stream against the files' sizes: the
		// headers make it end a little past 100%, which it never shows.
		cw := &image.CountingWriter{W: pw, P: p, Label: "docker import", Total: total}
		err := writeTar(cw, root)
		cw.Done()
		pw.CloseWithError(err)
	}()
	defer pr.Close()
	changes := []string{
		"LABEL " + ImageLabel + "=" + key,
		"LABEL moat.image.recipe=" + image.RecipeVersion,
		"WORKDIR " + image.WorkDir,
		"USER 65534:65534",
		"ENV LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin",
		`CMD ["` + image.Python + `", "-"]`,
	}
	rc, err := cli.ImageImport(ctx, dimage.ImportSource{Source: pr, SourceName: "-"}, tag, dimage.ImportOptions{
		Message: "moat sandbox root filesystem " + key,
		Changes: changes,
	})
	if err != nil {
		return st, fmt.Errorf("container: docker import: %w", err)
	}
	defer rc.Close()
	if err := readJSONMessages(rc); err != nil {
		return st, fmt.Errorf("container: docker import: %w", err)
	}
	id, ok, err := inspectImage(ctx, cli, tag, key)
	if err != nil {
		return st, err
	}
	if !ok {
		return st, fmt.Errorf("container: docker import of %s finished but the image is not there", tag)
	}
	p.Say("step 3/3 docker import %s: done in %s (%s)", tag, time.Since(start).Round(100*time.Millisecond), shortID(imageID(id)))
	st.Present, st.ID, st.Imported = true, id, true
	return st, nil
}

// inspectImage reports whether the engine holds tag with the label key.
func inspectImage(ctx context.Context, cli client.APIClient, tag, key string) (id string, ok bool, err error) {
	ins, err := cli.ImageInspect(ctx, tag)
	if cerrdefs.IsNotFound(err) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("container: docker inspect %s: %w", tag, err)
	}
	if ins.Config == nil || ins.Config.Labels[ImageLabel] != key {
		return ins.ID, false, nil
	}
	return ins.ID, true, nil
}

// readJSONMessages drains a Docker progress stream and returns the first
// error it reports.
func readJSONMessages(r io.Reader) error {
	dec := json.NewDecoder(r)
	for {
		var m struct {
			Error       string `json:"error"`
			ErrorDetail *struct {
				Message string `json:"message"`
			} `json:"errorDetail"`
		}
		if err := dec.Decode(&m); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
		if m.ErrorDetail != nil && m.ErrorDetail.Message != "" {
			return errors.New(m.ErrorDetail.Message)
		}
		if m.Error != "" {
			return errors.New(m.Error)
		}
	}
}

// writeTar writes the tree at root to w as a tar stream, with owners, modes,
// symlinks and hard links; the contents of /dev, /proc and /sys are left out
// (the runtime provides them), and so are sockets, fifos and device nodes.
func writeTar(w io.Writer, root string) error {
	tw := tar.NewWriter(w)
	links := map[[2]uint64]string{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		parent := strings.SplitN(rel, string(filepath.Separator), 2)[0]
		if (parent == "dev" || parent == "proc" || parent == "sys") && rel != parent {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		mode := info.Mode()
		if mode&(fs.ModeSocket|fs.ModeNamedPipe|fs.ModeDevice|fs.ModeCharDevice) != 0 {
			return nil
		}
		var target string
		if mode&fs.ModeSymlink != 0 {
			if target, err = os.Readlink(path); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, target)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		if st, ok := info.Sys().(*syscall.Stat_t); ok {
			hdr.Uid, hdr.Gid = int(st.Uid), int(st.Gid)
			if mode.IsRegular() && st.Nlink > 1 {
				id := [2]uint64{uint64(st.Dev), st.Ino}
				if first, seen := links[id]; seen {
					hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
				} else {
					links[id] = hdr.Name
				}
			}
		}
		hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if hdr.Typeflag != tar.TypeReg {
			return nil
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(tw, f)
		return err
	})
	if err != nil {
		return fmt.Errorf("container: tar of %s: %w", root, err)
	}
	return tw.Close()
}

// imageID strips the digest algorithm from an image ID.
func imageID(id string) string { return strings.TrimPrefix(id, "sha256:") }
