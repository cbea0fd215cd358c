package image

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
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"
)

// LabelKey is the image label that holds the root filesystem's full key.
const LabelKey = "moat.image.key"

// dockerClient connects to the engine named by the environment (DOCKER_HOST,
// or the local socket), negotiating the API version, and checks that it
// answers.
func dockerClient(ctx context.Context) (*client.Client, error) {
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		return nil, fmt.Errorf("image: docker client: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := cli.Ping(pctx); err != nil {
		cli.Close()
		return nil, fmt.Errorf("image: no Docker engine answers at %s (run scripts/setup-docker.sh): %w", cli.DaemonHost(), err)
	}
	return cli, nil
}

// Import imports the built root filesystem of cfg into the Docker engine
// behind cli, unless an image with its tag and key is already there. It
// returns the image's ID and whether it imported it now.
func Import(ctx context.Context, cli client.APIClient, cfg Config) (id string, imported bool, err error) {
	cfg = cfg.WithDefaults()
	return importImage(ctx, cli, cfg, progress{w: cfg.Progress})
}

func importImage(ctx context.Context, cli client.APIClient, cfg Config, p progress) (string, bool, error) {
	key, tag := cfg.Key(), cfg.Tag()
	if !cfg.Force {
		if id, ok, err := inspectImage(ctx, cli, tag, key); err != nil {
			return "", false, err
		} else if ok {
			p.say("docker image %s: already present (%s), nothing to do", tag, shortID(id))
			return id, false, nil
		}
	}
	root := Path(cfg)
	if !exists(root) {
		return "", false, ErrNotBuilt
	}
	p.say("docker image %s: importing %s", tag, root)
	start := time.Now()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(pw, root)) }()
	defer pr.Close()
	changes := []string{
		"LABEL " + LabelKey + "=" + key,
		"LABEL moat.image.recipe=" + RecipeVersion,
		"WORKDIR " + WorkDir,
		"USER 65534:65534",
		"ENV LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin",
		`CMD ["` + Python + `", "-"]`,
	}
	rc, err := cli.ImageImport(ctx, image.ImportSource{Source: pr, SourceName: "-"}, tag, image.ImportOptions{
		Message: "moat sandbox root filesystem " + key,
		Changes: changes,
	})
	if err != nil {
		return "", false, fmt.Errorf("image: docker import: %w", err)
	}
	defer rc.Close()
	if err := readJSONMessages(rc); err != nil {
		return "", false, fmt.Errorf("image: docker import: %w", err)
	}
	id, ok, err := inspectImage(ctx, cli, tag, key)
	if err != nil {
		return "", false, err
	}
	if !ok {
		return "", false, fmt.Errorf("image: docker import of %s finished but the image is not there", tag)
	}
	p.say("docker image %s: imported in %s (%s)", tag, time.Since(start).Round(100*time.Millisecond), shortID(id))
	return id, true, nil
}

// inspectImage reports whether the engine holds tag with the label key.
func inspectImage(ctx context.Context, cli client.APIClient, tag, key string) (id string, ok bool, err error) {
	ins, err := cli.ImageInspect(ctx, tag)
	if cerrdefs.IsNotFound(err) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("image: docker inspect %s: %w", tag, err)
	}
	if ins.Config == nil || ins.Config.Labels[LabelKey] != key {
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
// (the runtime provides them), and so are sockets and fifos.
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
		return fmt.Errorf("image: tar of %s: %w", root, err)
	}
	return tw.Close()
}

func shortID(id string) string {
	id = strings.TrimPrefix(id, "sha256:")
	if len(id) > 12 {
		id = id[:12]
	}
	return id
}
