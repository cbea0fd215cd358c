package container

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"
)

// reap removes the containers of moat processes that are gone: those that
// carry moat's labels, were made on this machine since its last boot, and
// whose owner pid no longer runs the process that made them (the start time
// tells a reused pid apart). Containers made on another machine or before a
// reboot are removed only once they stopped: their owner may be alive
// elsewhere. It returns the ids it removed.
func reap(ctx context.Context, cli client.APIClient, log *slog.Logger) ([]string, error) {
	boot, err := bootID()
	if err != nil {
		return nil, err
	}
	list, err := cli.ContainerList(ctx, container.ListOptions{
		All:     true,
		Filters: filters.NewArgs(filters.Arg("label", LabelSandbox+"=1")),
	})
	if err != nil {
		return nil, fmt.Errorf("container: list moat's containers: %w", err)
	}
	var removed []string
	for _, c := range list {
		if !ownerGone(c.Labels, boot, c.State) {
			continue
		}
		err := removeContainer(ctx, cli, c.ID)
		if err != nil && !cerrdefs.IsNotFound(err) {
			log.Warn("container: remove a leftover container", "id", shortID(c.ID), "err", err)
			continue
		}
		removed = append(removed, shortID(c.ID))
	}
	return removed, nil
}

// ownerGone reports whether the moat process named by labels is gone.
func ownerGone(labels map[string]string, boot, state string) bool {
	if labels[LabelBoot] != boot {
		return state != "running" && state != "restarting"
	}
	pid, err := strconv.Atoi(labels[LabelOwner])
	if err != nil || pid <= 0 {
		return true
	}
	start, err := procStart(pid)
	if err != nil {
		return true // no such process
	}
	return strconv.FormatUint(start, 10) != labels[LabelOwnerStart]
}

// removeContainer removes container id, killing it first if it runs. A
// session's container is frozen between runs, and its live interpreter may
// have been left frozen in a freezer cgroup of its own (by a moat killed
// during a file operation); the engine's kill cannot end a process frozen
// in a cgroup it does not know, so the freezers are thawed first.
func removeContainer(ctx context.Context, cli client.APIClient, id string) error {
	thawFreezers(id)
	return cli.ContainerRemove(ctx, id, container.RemoveOptions{Force: true, RemoveVolumes: true})
}

// thawFreezers thaws the interpreter's freezer cgroup of container id, if
// it has one, then the container's own, where Docker's cgroupfs or systemd
// driver puts it.
func thawFreezers(id string) {
	m, err := cgroupMounts()
	if err != nil {
		return
	}
	for _, root := range []string{m["freezer"], m[""]} {
		if root == "" {
			continue
		}
		for _, dir := range []string{filepath.Join(root, "docker", id), filepath.Join(root, "system.slice", "docker-"+id+".scope")} {
			if _, err := os.Stat(dir); err != nil {
				continue
			}
			v2 := root == m[""]
			if _, err := os.Stat(filepath.Join(dir, interpFreezer)); err == nil {
				cgroupFiles{freezer: filepath.Join(dir, interpFreezer), v2: v2}.setFrozenAs(false, true)
			}
			cgroupFiles{freezer: dir, v2: v2}.setFrozenAs(false, true)
		}
	}
}

// procStart returns the start time of process pid, in clock ticks since
// boot (field 22 of /proc/PID/stat).
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces: count fields
	// after its closing parenthesis (which is field 2).
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("container: /proc/%d/stat does not parse", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, fmt.Errorf("container: /proc/%d/stat is too short", pid)
	}
	return strconv.ParseUint(f[19], 10, 64) // field 22 is the 20th after field 2
}

// bootID returns this machine's boot id.
func bootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("container: boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// Leftovers lists the containers carrying moat's labels whose owner is this
// process: after every Sandbox of this process has closed, there must be
// none. Tests use it.
func Leftovers(ctx context.Context) ([]string, error) {
	cli, err := newClient()
	if err != nil {
		return nil, err
	}
	defer cli.Close()
	list, err := cli.ContainerList(ctx, container.ListOptions{
		All: true,
		Filters: filters.NewArgs(
			filters.Arg("label", LabelSandbox+"=1"),
			filters.Arg("label", LabelOwner+"="+strconv.Itoa(os.Getpid())),
		),
	})
	if err != nil {
		return nil, fmt.Errorf("container: list moat's containers: %w", err)
	}
	var ids []string
	for _, c := range list {
		ids = append(ids, fmt.Sprintf("container %s (%s, %s)", shortID(c.ID), c.State, c.Status))
	}
	return ids, nil
}
