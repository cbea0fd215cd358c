package container_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dimage "github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/image"
)

// TestImportImage imports the built root filesystem under a repository of
// the test's own, checks that a second import does nothing, and runs code
// in a container made from the imported image.
func TestImportImage(t *testing.T) {
	needEngine(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := image.Config{Repository: fmt.Sprintf("moat-import-test-%d", os.Getpid())}
	if !image.GetStatus(cfg).Exists {
		t.Fatalf("the root filesystem %s is not built, though needEngine built it", image.Path(cfg))
	}
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := cli.ImageRemove(ctx, cfg.Tag(), dimage.RemoveOptions{Force: true, PruneChildren: true}); err != nil {
			t.Errorf("remove %s: %v", cfg.Tag(), err)
		}
	})

	if st, err := moatcontainer.InspectImage(ctx, cfg); err != nil || st.Present {
		t.Fatalf("InspectImage before the import = %+v, %v; want not present", st, err)
	}
	first, err := moatcontainer.ImportImage(ctx, cfg)
	if err != nil {
		t.Fatalf("ImportImage: %v", err)
	}
	if !first.Present || !first.Imported || first.ID == "" || first.Tag != cfg.Tag() {
		t.Fatalf("ImportImage = %+v, want %s present and imported now", first, cfg.Tag())
	}
	ins, err := cli.ImageInspect(ctx, cfg.Tag())
	if err != nil {
		t.Fatal(err)
	}
	if ins.Config == nil || ins.Config.Labels[moatcontainer.ImageLabel] != cfg.Key() || ins.Config.User != "65534:65534" || ins.Config.WorkingDir != image.WorkDir {
		t.Errorf("the imported image's config: %+v", ins.Config)
	}
	again, err := moatcontainer.ImportImage(ctx, cfg)
	if err != nil || !again.Present || again.Imported || again.ID != first.ID {
		t.Errorf("a second ImportImage = %+v, %v; want %s present, not imported again", again, err, first.ID)
	}
	if st, err := moatcontainer.InspectImage(ctx, cfg); err != nil || !st.Present || st.ID != first.ID {
		t.Errorf("InspectImage after the import = %+v, %v; want %s present", st, err, first.ID)
	}

	sb, err := moatcontainer.New(moatcontainer.Config{Image: cfg.Tag(), Warm: -1})
	if err != nil {
		t.Fatalf("container.New with the imported image: %v", err)
	}
	defer sb.Close()
	res, err := sb.Run(ctx, moat.Request{Code: []byte("import os, sys\nprint(os.getcwd(), sys.version_info[0])\n")})
	if err != nil {
		t.Fatalf("Run in the imported image: %v", err)
	}
	if got := strings.TrimSpace(string(res.Stdout)); got != image.WorkDir+" 3" || res.ExitCode != 0 {
		t.Errorf("Run in the imported image: stdout %q, exit %d, want %q", got, res.ExitCode, image.WorkDir+" 3")
	}
}

// TestImportImageNotBuilt checks that importing a root filesystem that is
// not built fails with image.ErrNotBuilt and imports nothing.
func TestImportImageNotBuilt(t *testing.T) {
	needEngine(t)
	cfg := image.Config{StateDir: t.TempDir(), Repository: fmt.Sprintf("moat-import-test-%d", os.Getpid())}
	st, err := moatcontainer.ImportImage(context.Background(), cfg)
	if !errors.Is(err, image.ErrNotBuilt) || st.Present || st.Imported {
		t.Errorf("ImportImage of an empty state dir = %+v, %v; want image.ErrNotBuilt", st, err)
	}
}

// TestImportImageNoEngine checks that with no engine to talk to, importing
// and inspecting fail with moat.ErrUnavailable (which `moat image build`
// takes as "skip the import"), not with some other error.
func TestImportImageNoEngine(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(t.TempDir(), "no-engine.sock"))
	cfg := image.Config{StateDir: t.TempDir()}
	if _, err := moatcontainer.ImportImage(context.Background(), cfg); !errors.Is(err, moat.ErrUnavailable) {
		t.Errorf("ImportImage with no engine: %v, want moat.ErrUnavailable", err)
	}
	if st, err := moatcontainer.InspectImage(context.Background(), cfg); !errors.Is(err, moat.ErrUnavailable) || st.Present {
		t.Errorf("InspectImage with no engine = %+v, %v; want moat.ErrUnavailable", st, err)
	}
}
