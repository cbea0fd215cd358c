package sandboxtest

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// This file looks at the host from the outside: its processes, its files and
// the test process's goroutines. It is how the suite judges a level without
// trusting what the sandbox says.

// process is one host process, as /proc shows it.
type process struct {
	PID     int
	PPID    int
	State   string // one letter: R running, S sleeping, Z zombie, ...
	Cmdline string // the arguments, separated by spaces
}

func (p process) String() string {
	return fmt.Sprintf("pid %d ppid %d state %s: %s", p.PID, p.PPID, p.State, p.Cmdline)
}

// listProcesses reads every process under root (normally /proc). A process
// that ends while it is read is left out.
func listProcesses(root string) ([]process, error) {
	ents, err := os.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("sandboxtest: list processes: %w", err)
	}
	var ps []process
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		stat, err := os.ReadFile(filepath.Join(root, e.Name(), "stat"))
		if err != nil {
			continue // gone, or not a process
		}
		ppid, state, err := parseStat(stat)
		if err != nil {
			return nil, fmt.Errorf("sandboxtest: process %d: %w", pid, err)
		}
		cmdline, _ := os.ReadFile(filepath.Join(root, e.Name(), "cmdline"))
		cmdline = bytes.TrimRight(cmdline, "\x00")
		ps = append(ps, process{
			PID:     pid,
			PPID:    ppid,
			State:   state,
			Cmdline: string(bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '})),
		})
	}
	return ps, nil
}

// parseStat returns the parent pid and the state from the contents of
// /proc/<pid>/stat. The command name, in parentheses, may itself hold spaces
// and parentheses, so the fields are read after the last ')'.
func parseStat(stat []byte) (ppid int, state string, err error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, "", fmt.Errorf("stat %q has no command name", stat)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 2 {
		return 0, "", fmt.Errorf("stat %q is too short", stat)
	}
	ppid, err = strconv.Atoi(f[1])
	if err != nil {
		return 0, "", fmt.Errorf("stat %q: parent pid: %w", stat, err)
	}
	return ppid, f[0], nil
}

// processesWith returns the processes under root, other than this one, whose
// command line contains marker.
func processesWith(root, marker string) ([]process, error) {
	all, err := listProcesses(root)
	if err != nil {
		return nil, err
	}
	var ps []process
	for _, p := range all {
		if p.PID != os.Getpid() && strings.Contains(p.Cmdline, marker) {
			ps = append(ps, p)
		}
	}
	return ps, nil
}

// childrenOf returns the processes under root whose parent is pid, zombies
// included.
func childrenOf(root string, pid int) ([]process, error) {
	all, err := listProcesses(root)
	if err != nil {
		return nil, err
	}
	var ps []process
	for _, p := range all {
		if p.PPID == pid {
			ps = append(ps, p)
		}
	}
	return ps, nil
}

// remainingWith waits up to wait for the processes carrying marker to go and
// describes those that did not. It kills them (they run the suite's own
// programs, which would otherwise sleep for minutes).
func remainingWith(marker string, wait time.Duration) []string {
	var left []process
	got := eventually(wait, func() []string {
		ps, err := processesWith(procRoot, marker)
		if err != nil {
			return []string{err.Error()}
		}
		left = ps
		var s []string
		for _, p := range ps {
			s = append(s, p.String())
		}
		return s
	})
	for _, p := range left {
		_ = syscall.Kill(p.PID, syscall.SIGKILL)
	}
	return got
}

// Bounds on a search for leftover files: deep enough for
// <tmp>/<level>/<run>/<dir>/<file>, small enough to stay cheap.
const (
	searchDepth   = 6
	searchEntries = 200_000
)

// hostDirs returns the directories where a level is likely to keep the files
// of a run, plus extra, keeping those that exist, each once.
func hostDirs(extra []string) []string {
	dirs := []string{os.TempDir(), "/tmp", "/var/tmp", "/dev/shm", "/run/moat", "/var/lib/moat"}
	if d, err := os.UserCacheDir(); err == nil {
		dirs = append(dirs, filepath.Join(d, "moat"))
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		dirs = append(dirs, d)
	}
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		dirs = append(dirs, filepath.Join(d, "moat"))
	} else if home, err := os.UserHomeDir(); err == nil {
		dirs = append(dirs, filepath.Join(home, ".local", "state", "moat"))
	}
	dirs = append(dirs, extra...)
	var out []string
	for _, d := range dirs {
		d, err := filepath.EvalSymlinks(d)
		if err != nil {
			continue
		}
		if fi, err := os.Stat(d); err == nil && fi.IsDir() && !slices.Contains(out, d) {
			out = append(out, d)
		}
	}
	return out
}

// findFiles returns the paths under roots, up to maxDepth levels below each,
// whose base name contains marker, each once even when roots nest. It visits at most maxEntries entries in
// all and says whether it stopped early. It does not follow symbolic links
// and skips what it may not read.
func findFiles(roots []string, marker string, maxDepth, maxEntries int) (found []string, truncated bool) {
	seen := 0
	for _, root := range roots {
		base := strings.Count(filepath.Clean(root), string(filepath.Separator))
		_ = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				if d != nil && d.IsDir() {
					return fs.SkipDir
				}
				return nil
			}
			seen++
			if seen > maxEntries {
				truncated = true
				return fs.SkipAll
			}
			if path != root && strings.Contains(d.Name(), marker) && !slices.Contains(found, path) {
				found = append(found, path)
			}
			if d.IsDir() && strings.Count(path, string(filepath.Separator))-base >= maxDepth {
				return fs.SkipDir
			}
			return nil
		})
		if truncated {
			break
		}
	}
	return found, truncated
}

// filesLeft returns the files named by marker that remain in the likely host
// directories (see [hostDirs]) or at the given paths, and removes them: they
// are the suite's own files.
func filesLeft(t interface{ Logf(string, ...any) }, dirs []string, marker string, paths ...string) []string {
	found, truncated := findFiles(hostDirs(dirs), marker, searchDepth, searchEntries)
	if truncated {
		t.Logf("the search for leftover files stopped after %d entries", searchEntries)
	}
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil && !slices.Contains(found, p) {
			found = append(found, p)
		}
	}
	for _, p := range found {
		if err := os.RemoveAll(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Logf("remove leftover %s: %v", p, err)
		}
	}
	return found
}

// goroutine is one goroutine of the test process.
type goroutine struct {
	ID    int64
	Stack string // the whole block of the dump, header included
}

// allGoroutines returns the goroutines of this process other than the
// calling one.
func allGoroutines() []goroutine {
	gs := dumpGoroutines()
	if len(gs) > 0 {
		gs = gs[1:] // the dump starts with the caller
	}
	return gs
}

// goroutineIDs returns the ids of the goroutines alive now, the caller's
// included.
func goroutineIDs() map[int64]bool {
	ids := make(map[int64]bool)
	for _, g := range dumpGoroutines() {
		ids[g.ID] = true
	}
	return ids
}

// dumpGoroutines returns every goroutine of this process, the caller's
// first.
func dumpGoroutines() []goroutine {
	buf := make([]byte, 1<<16)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return parseGoroutines(buf[:n])
		}
		buf = make([]byte, 2*len(buf))
	}
}

// parseGoroutines splits a dump from runtime.Stack(buf, true) into its
// goroutines. Blocks it cannot read are left out.
func parseGoroutines(dump []byte) []goroutine {
	var gs []goroutine
	for _, block := range strings.Split(strings.TrimSpace(string(dump)), "\n\n") {
		header, _, _ := strings.Cut(block, "\n")
		rest, ok := strings.CutPrefix(header, "goroutine ")
		if !ok {
			continue
		}
		idText, _, _ := strings.Cut(rest, " ")
		id, err := strconv.ParseInt(idText, 10, 64)
		if err != nil {
			continue
		}
		gs = append(gs, goroutine{ID: id, Stack: block})
	}
	return gs
}

// permanentGoroutines are functions whose goroutines, once started, live as
// long as the process by design.
var permanentGoroutines = []string{
	"os/signal.signal_recv", // signal.Notify's watcher
	"os/signal.loop",
	"runtime.ensureSigM",
	"runtime.runFinalizers", // shown while it runs a finalizer
	"runtime.runCleanups",
}

// leakedGoroutines returns the goroutines of now that were not in before and
// are not permanent by design.
func leakedGoroutines(before map[int64]bool, now []goroutine) []goroutine {
	var leaked []goroutine
	for _, g := range now {
		if before[g.ID] || slices.ContainsFunc(permanentGoroutines, func(f string) bool {
			return strings.Contains(g.Stack, f)
		}) {
			continue
		}
		leaked = append(leaked, g)
	}
	return leaked
}

// ChildrenLeft waits up to wait for the test process's child processes to
// end and describes those still alive then. A zombie is not counted: the
// code that started it has yet to wait for it, and it holds nothing but its
// pid. It lets a package outside the suite check that what it started is
// gone.
func ChildrenLeft(wait time.Duration) []string {
	return eventually(wait, func() []string {
		kids, err := childrenOf(procRoot, os.Getpid())
		if err != nil {
			return []string{err.Error()}
		}
		var live []string
		for _, p := range kids {
			if p.State != "Z" {
				live = append(live, p.String())
			}
		}
		return live
	})
}

// CheckNoChildren is for a test binary's TestMain, given the code of m.Run:
//
//	func TestMain(m *testing.M) {
//		os.Exit(sandboxtest.CheckNoChildren(m.Run(), 2*time.Second))
//	}
//
// When the tests passed, it waits up to wait for the test process's
// children to end ([ChildrenLeft]); if one is still alive, it lists them on
// standard error and returns 1. Otherwise it returns code.
func CheckNoChildren(code int, wait time.Duration) int {
	if code != 0 {
		return code
	}
	if left := ChildrenLeft(wait); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "child processes left after the tests:\n\t%s\n", strings.Join(left, "\n\t"))
		return 1
	}
	return 0
}
