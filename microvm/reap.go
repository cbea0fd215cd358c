package microvm

import (
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/moatsandbox/moat/internal/owner"
)

// ownersDir is where moat processes hold their owner ids (package owner),
// shared with the other levels.
const ownersDir = "/run/moat/owners"

// vmTagger returns the tag of this moat process's QEMU processes,
// "moat-vm:OWNER:RANDOM", OWNER being its owner id: a pid would mean
// nothing to a moat in another PID namespace, which would take a live
// owner's VMs for leftovers.
func vmTagger() (func() string, error) {
	id, err := owner.Self(ownersDir)
	if err != nil {
		return nil, err
	}
	return func() string {
		var b [6]byte
		rand.Read(b[:])
		return tagPrefix + id + ":" + hex.EncodeToString(b[:])
	}, nil
}

const tagPrefix = "moat-vm:"

// vmProcess is a QEMU process of moat, found by its tag.
type vmProcess struct {
	pid   int
	owner string // owner id
}

// listVMs returns the QEMU processes that carry moat's tag.
func listVMs() []vmProcess {
	ents, _ := os.ReadDir("/proc")
	var out []vmProcess
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		for i := 0; i+1 < len(args); i++ {
			if args[i] == "-name" && strings.HasPrefix(args[i+1], tagPrefix) {
				rest := strings.TrimPrefix(args[i+1], tagPrefix)
				out = append(out, vmProcess{pid: pid, owner: strings.SplitN(rest, ":", 2)[0]})
				break
			}
		}
	}
	return out
}

// reap kills the VMs whose moat process is gone and removes the half-made
// files such processes left in the state directory, and their VMs' egress
// sockets.
func reap(stateDir string, log *slog.Logger) {
	for _, p := range listVMs() {
		if _, ok := owner.Of(p.owner + "-"); !ok || owner.Alive(ownersDir, p.owner) {
			continue
		}
		if err := syscall.Kill(p.pid, syscall.SIGKILL); err == nil {
			log.Info("microvm: reaped a leftover VM", "pid", p.pid, "owner", p.owner)
		}
	}
	socks, _ := filepath.Glob(filepath.Join(socketDir, "*.sock"))
	for _, sk := range socks {
		if id, ok := owner.Of(filepath.Base(sk)); ok && !owner.Alive(ownersDir, id) {
			if err := os.Remove(sk); err == nil {
				log.Info("microvm: reaped a leftover egress socket", "path", sk)
			}
		}
	}
	for _, sub := range []string{"templates", "agent/*", "initrd", "disks"} {
		tmps, _ := filepath.Glob(filepath.Join(stateDir, "microvm", sub, "*.tmp-*"))
		for _, t := range tmps {
			_, rest, _ := strings.Cut(filepath.Base(t), ".tmp-")
			pid, err := strconv.Atoi(strings.SplitN(rest, "-", 2)[0])
			if err != nil || pid == os.Getpid() || syscall.Kill(pid, 0) == nil {
				continue
			}
			if err := os.RemoveAll(t); err == nil {
				log.Info("microvm: reaped a leftover file", "path", t)
			}
		}
	}
}
