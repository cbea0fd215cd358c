// Package cgroup gives each sandbox run a control group of its own, with a
// memory and a process limit, on cgroup v2 or on the v1 memory and pids
// hierarchies, and says afterwards which limit the run hit. A group asked to
// be freezable can also be frozen and thawed ([Group.Freeze]), through v2's
// cgroup.freeze or the v1 freezer hierarchy.
//
// Groups are named "<owner>-<run id>" under a parent directory ("moat" by
// default) in each hierarchy, so that a later process can tell the groups of
// a live moat from those of a dead one and remove only the latter
// ([Manager.ReapDead]).
package cgroup

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// Root is where cgroup hierarchies are mounted.
const Root = "/sys/fs/cgroup"

// Manager creates per-run groups. Its zero value is not usable; call
// [Detect].
type Manager struct {
	v2 bool
	// dirs are the parent directories, one per hierarchy: on v2 the single
	// unified one; on v1 memory, pids and cpuacct, in that order.
	dirs []string
	// freezer is the parent directory in the v1 freezer hierarchy, "" on v2
	// or when there is none.
	freezer string
	// noFreezer says why groups cannot be frozen; nil when they can.
	noFreezer error
}

// ErrNoFreezer means groups cannot be frozen here: no v1 freezer hierarchy,
// or a v2 kernel without cgroup.freeze.
var ErrNoFreezer = errors.New("cgroup: no freezer")

// Limits are what a group enforces.
type Limits struct {
	Memory int64 // bytes; swap is held at zero beyond it where the kernel allows
	Pids   int64 // processes and threads
	// Freezable makes a group that [Group.Freeze] can freeze. On v1 it
	// puts the group in the freezer hierarchy too. New fails with an error
	// wrapping ErrNoFreezer when there is no freezer.
	Freezable bool
}

// Detect finds the memory, pids and CPU accounting controllers and prepares
// parent (e.g. "moat") under them. It fails when one of them cannot be had;
// the error explains why. It also looks for the freezer, which only
// freezable groups need: [Manager.Freezer] says whether it was found.
func Detect(parent string) (*Manager, error) {
	if parent == "" || strings.Contains(parent, "..") {
		return nil, fmt.Errorf("cgroup: bad parent name %q", parent)
	}
	m := &Manager{}
	if data, err := os.ReadFile(filepath.Join(Root, "cgroup.controllers")); err == nil {
		// cgroup v2, unified hierarchy.
		ctrl := strings.Fields(string(data))
		if !contains(ctrl, "memory") || !contains(ctrl, "pids") {
			return nil, fmt.Errorf("cgroup: v2 hierarchy lacks the memory or pids controller (has %v)", ctrl)
		}
		m.v2 = true
		dir := filepath.Join(Root, parent)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+memory +pids"), 0); err != nil {
			return nil, fmt.Errorf("cgroup: enable memory and pids controllers under %s: %w", dir, err)
		}
		m.dirs = []string{dir}
		// cgroup.freeze exists in every non-root group from Linux 5.2 on.
		if _, err := os.Stat(filepath.Join(dir, "cgroup.freeze")); err != nil {
			m.noFreezer = fmt.Errorf("%w: the v2 hierarchy has no cgroup.freeze (Linux 5.2 or later has it): %v", ErrNoFreezer, err)
		}
		return m, nil
	}
	for _, c := range []string{"memory", "pids", "cpuacct"} {
		base := filepath.Join(Root, c)
		if _, err := os.Stat(filepath.Join(base, "cgroup.procs")); err != nil {
			return nil, fmt.Errorf("cgroup: no cgroup v2 hierarchy and no v1 %s controller at %s", c, base)
		}
		dir := filepath.Join(base, parent)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		m.dirs = append(m.dirs, dir)
	}
	base := filepath.Join(Root, "freezer")
	if _, err := os.Stat(filepath.Join(base, "cgroup.procs")); err != nil {
		m.noFreezer = fmt.Errorf("%w: no v1 freezer hierarchy at %s", ErrNoFreezer, base)
		return m, nil
	}
	dir := filepath.Join(base, parent)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		m.noFreezer = fmt.Errorf("%w: %v", ErrNoFreezer, err)
		return m, nil
	}
	m.freezer = dir
	return m, nil
}

// Freezer returns nil when freezable groups can be made here, else an error
// wrapping ErrNoFreezer that says why not.
func (m *Manager) Freezer() error { return m.noFreezer }

// WithoutFreezer returns a copy of m that makes groups as on a host without
// a freezer, so that callers can test how they refuse then.
func (m *Manager) WithoutFreezer() *Manager {
	c := *m
	c.freezer = ""
	c.noFreezer = fmt.Errorf("%w: disabled for a test", ErrNoFreezer)
	return &c
}

// Version returns 1 or 2.
func (m *Manager) Version() int {
	if m.v2 {
		return 2
	}
	return 1
}

// Group is one run's control group.
type Group struct {
	m    *Manager
	name string
	dirs []string // same order as Manager.dirs
	// freezer is the group's directory in the v1 freezer hierarchy, or "".
	freezer   string
	freezable bool
}

// New creates the group name with the given limits. The caller must Remove
// it.
func (m *Manager) New(name string, l Limits) (*Group, error) {
	if l.Freezable && m.noFreezer != nil {
		return nil, m.noFreezer
	}
	g := &Group{m: m, name: name, freezable: l.Freezable}
	for _, parent := range m.dirs {
		dir := filepath.Join(parent, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			g.Remove()
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		g.dirs = append(g.dirs, dir)
	}
	if l.Freezable && !m.v2 {
		dir := filepath.Join(m.freezer, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			g.Remove()
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		g.freezer = dir
	}
	mem := strconv.FormatInt(l.Memory, 10)
	pids := strconv.FormatInt(l.Pids, 10)
	var writes [][2]string
	if m.v2 {
		writes = [][2]string{
			{"memory.max", mem},
			{"memory.swap.max", "0"},
			{"pids.max", pids},
		}
	} else {
		writes = [][2]string{
			{"memory.limit_in_bytes", mem},
			{"memory.memsw.limit_in_bytes", mem},
			{"memory.swappiness", "0"},
			{"pids.max", pids},
		}
	}
	for _, w := range writes {
		if err := g.write(w[0], w[1]); err != nil {
			// memsw and swap files exist only where the kernel accounts swap;
			// without swap accounting there is no swap to hold at zero beyond
			// what the memory limit allows.
			if errors.Is(err, os.ErrNotExist) && (strings.Contains(w[0], "swap") || strings.Contains(w[0], "memsw")) {
				continue
			}
			g.Remove()
			return nil, err
		}
	}
	return g, nil
}

// dirFor returns the directory holding file.
func (g *Group) dirFor(file string) string {
	switch {
	case g.m.v2 || strings.HasPrefix(file, "memory."):
		return g.dirs[0]
	case strings.HasPrefix(file, "cpuacct."):
		return g.dirs[2]
	case strings.HasPrefix(file, "freezer."):
		return g.freezer
	}
	return g.dirs[1]
}

// CPUUsage is the CPU time the group's processes have used in all, the
// living and the dead.
func (g *Group) CPUUsage() (time.Duration, error) {
	if g.m.v2 {
		// A missing or unreadable account is an error, as on v1: the
		// caller's CPU watch must not read it as no usage.
		data, err := os.ReadFile(filepath.Join(g.dirs[0], "cpu.stat"))
		if err != nil {
			return 0, fmt.Errorf("cgroup: %w", err)
		}
		us, ok := findKey(data, "usage_usec")
		if !ok {
			return 0, fmt.Errorf("cgroup: no usage_usec in %s", filepath.Join(g.dirs[0], "cpu.stat"))
		}
		return time.Duration(us) * time.Microsecond, nil
	}
	data, err := os.ReadFile(filepath.Join(g.dirFor("cpuacct.usage"), "cpuacct.usage"))
	if err != nil {
		return 0, fmt.Errorf("cgroup: %w", err)
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("cgroup: cpuacct.usage: %w", err)
	}
	return time.Duration(ns), nil
}

func (g *Group) write(file, value string) error {
	p := filepath.Join(g.dirFor(file), file)
	if err := os.WriteFile(p, []byte(value), 0); err != nil {
		return fmt.Errorf("cgroup: write %s: %w", p, err)
	}
	return nil
}

// JoinFiles returns the files a thread writes "0" into to move itself into
// the group, one per hierarchy; processes it forks afterwards start in the
// group. On v1 these are the "tasks" files: moving the calling thread alone
// skips the global threadgroup lock, whose RCU grace period otherwise costs
// up to tens of milliseconds per run. On v2 they are "cgroup.procs".
func (g *Group) JoinFiles() []string {
	file := "tasks"
	if g.m.v2 {
		file = "cgroup.procs"
	}
	var out []string
	for _, d := range g.allDirs() {
		out = append(out, filepath.Join(d, file))
	}
	return out
}

// allDirs returns the group's directories in every hierarchy, the freezer's
// last.
func (g *Group) allDirs() []string {
	if g.freezer == "" {
		return g.dirs
	}
	return append(slices.Clip(g.dirs), g.freezer)
}

// Events says which limits the group hit.
type Events struct {
	OOMKill bool // the memory limit made the kernel kill a process
	PidsMax bool // the pids limit refused a fork or a thread
}

// Events reads the group's counters.
func (g *Group) Events() Events {
	var ev Events
	if g.m.v2 {
		ev.OOMKill = keyValue(filepath.Join(g.dirs[0], "memory.events"), "oom_kill") > 0
		ev.PidsMax = keyValue(filepath.Join(g.dirs[0], "pids.events"), "max") > 0
		return ev
	}
	ev.OOMKill = keyValue(filepath.Join(g.dirs[0], "memory.oom_control"), "oom_kill") > 0
	ev.PidsMax = keyValue(filepath.Join(g.dirs[1], "pids.events"), "max") > 0
	return ev
}

// keyValue reads "key N" from a flat-keyed cgroup file, 0 when absent.
func keyValue(path, key string) int64 {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := findKey(data, key)
	return n
}

// findKey finds "key N" in the contents of a flat-keyed cgroup file.
func findKey(data []byte, key string) (int64, bool) {
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == key {
			n, err := strconv.ParseInt(f[1], 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// Pids returns the processes in the group.
func (g *Group) Pids() []int {
	var out []int
	seen := map[int]bool{}
	for _, d := range g.allDirs() {
		data, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil && !seen[pid] {
				seen[pid] = true
				out = append(out, pid)
			}
		}
	}
	return out
}

// Kill kills every process in the group, frozen or not, and waits, bounded,
// until none is left. On v2 it uses cgroup.kill. On v1 it kills the listed
// processes until the list stays empty (a forking process is caught on a
// later pass, and the pids limit bounds how many there can be); a freezable
// group is frozen first, so that none can fork meanwhile, and thawed after
// the kill, since a process frozen on v1 dies only once thawed.
func (g *Group) Kill() error {
	if g.m.v2 {
		if err := os.WriteFile(filepath.Join(g.dirs[0], "cgroup.kill"), []byte("1"), 0); err == nil {
			return g.waitEmpty()
		}
	}
	if g.freezer != "" {
		g.Freeze() // best effort: a group that will not freeze is killed below all the same
		for _, p := range g.Pids() {
			syscall.Kill(p, syscall.SIGKILL)
		}
		if err := g.Thaw(); err != nil {
			return fmt.Errorf("cgroup: kill %s: %w", g.name, err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		pids := g.Pids()
		if len(pids) == 0 {
			return nil
		}
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("cgroup: processes remain in %s after kill", g.name)
}

// KillBut kills every process in the group but keep, as Kill does on v1
// (the group is not frozen first: keep, which is the caller's, does not
// fork), and waits, bounded, until none but keep is left.
func (g *Group) KillBut(keep int) error {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		n := 0
		for _, p := range g.Pids() {
			if p != keep {
				syscall.Kill(p, syscall.SIGKILL)
				n++
			}
		}
		if n == 0 {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("cgroup: processes remain in %s after kill", g.name)
}

func (g *Group) waitEmpty() error {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if len(g.Pids()) == 0 {
			return nil
		}
		time.Sleep(2 * time.Millisecond)
	}
	return fmt.Errorf("cgroup: processes remain in %s after kill", g.name)
}

// Remove removes the group's directories. The group must be empty; Remove
// retries briefly while the kernel finishes reaping its last processes. It
// is safe to call more than once.
func (g *Group) Remove() error {
	var errs []error
	dirs := g.allDirs()
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := rmdirRetry(dirs[i]); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func rmdirRetry(dir string) error {
	var err error
	for i := 0; i < 200; i++ {
		err = syscall.Rmdir(dir)
		if err == nil || errors.Is(err, syscall.ENOENT) {
			return nil
		}
		if !errors.Is(err, syscall.EBUSY) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("cgroup: remove %s: %w", dir, err)
}

// Reap kills and removes the groups left behind by moat processes that are
// no longer alive (a crash, kill -9), for groups named "<pid>-<id>". Groups
// of live owners are left alone. It returns the names of the groups it
// removed. A pid means nothing across PID namespaces; prefer ReapDead with
// package owner's ids.
func (m *Manager) Reap() ([]string, error) {
	return m.ReapDead(func(name string) bool {
		owner, ok := OwnerPid(name)
		return ok && !processAlive(owner)
	})
}

// ReapDead kills and removes every group under the parent for which dead
// returns true, and returns their names.
func (m *Manager) ReapDead(dead func(name string) bool) ([]string, error) {
	seen := map[string]bool{}
	var names []string
	parents := m.dirs
	if m.freezer != "" {
		parents = append(slices.Clip(parents), m.freezer)
	}
	for _, parent := range parents {
		entries, err := os.ReadDir(parent)
		if err != nil {
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		for _, e := range entries {
			if !e.IsDir() || seen[e.Name()] {
				continue
			}
			seen[e.Name()] = true
			if dead(e.Name()) {
				names = append(names, e.Name())
			}
		}
	}
	var errs []error
	for _, name := range names {
		g := &Group{m: m, name: name}
		for _, parent := range m.dirs {
			g.dirs = append(g.dirs, filepath.Join(parent, name))
		}
		// A group of a dead moat may have been left frozen: it must be
		// thawed for its processes to die.
		if dir := filepath.Join(m.freezer, name); m.freezer != "" && exists(dir) {
			g.freezer, g.freezable = dir, true
		}
		if err := g.Kill(); err != nil {
			errs = append(errs, err)
		}
		if err := g.Remove(); err != nil {
			errs = append(errs, err)
		}
	}
	return names, errors.Join(errs...)
}

// OwnerPid parses the owner pid out of a group or directory name of the form
// "<pid>-<anything>".
func OwnerPid(name string) (int, bool) {
	head, _, ok := strings.Cut(name, "-")
	if !ok {
		return 0, false
	}
	pid, err := strconv.Atoi(head)
	return pid, err == nil && pid > 0
}

func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// CPUPoll is how often WatchCPU reads the group's CPU account. A run
// overshoots its CPU limit by at most this times the number of CPUs.
const CPUPoll = 100 * time.Millisecond

// WatchCPU calls kill, once, when the group has used limit of CPU time
// beyond base (what it had used before the run began), and sets over first.
// An account that cannot be read counts as over: the watch fails closed.
// The returned function stops watching and waits until the watcher has
// stopped, so the group may be removed after it.
func (g *Group) WatchCPU(base, limit time.Duration, kill func(), over *atomic.Bool) (stop func()) {
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(CPUPoll)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			used, err := g.CPUUsage()
			if err != nil || used-base >= limit {
				over.Store(true)
				kill()
				return
			}
		}
	}()
	return func() { close(done); <-finished }
}
