package main

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// A session's live interpreter: one python3 (driverSource) that runs each
// run's code with exec() in one globals dictionary it keeps, so that
// variables, imports and definitions survive from run to run. It runs as
// the run's uid in a cgroup of its own for its life, whose memory and
// process limits cover all it holds; the CPU time is the cgroup's since the
// run began. At a run's end every other process of the cgroup is killed
// (nothing the code started outlives its run); the interpreter itself waits
// for the next run, and the host pauses the VM. A run that is killed (the
// CPU time, the host's Kill at the wall time, the output cap or a
// cancellation) kills the whole cgroup, and so the interpreter: the next
// run gets a fresh one, and the Exit says so (Ended, then Fresh).
//
// The code shares the interpreter's process: it can read the run's marker
// and the descriptors the interpreter reports on, and so end its own
// output early or report a status of its choosing. Neither reaches beyond
// its own run's result: the host judges the limits from the cgroup, and
// takes the status the interpreter reports only as the run's exit status.

// driverSource drives the interpreter. It reads records on descriptor 3:
// b'R', the run's marker (32 hexadecimal digits), the code's length (4
// bytes, big-endian) and the code; it writes b'H' on descriptor 4 once
// ready, and after each run the marker on descriptors 1 and 2 (where the
// run's output ends) and b'X', the marker and the exit status (one byte) on
// descriptor 4.
//
// It imports nothing at its start but what Python's own start did: traceback
// and linecache (with tokenize and re, which they import) cost 0.5 to 2.6 s
// under TCG, on the session's path. traceback is imported, from the standard
// library's path, when a run's exception is to be printed; each run's
// source goes into linecache's cache (where tracebacks find the lines of
// code that has no file) as soon as linecache is there, and a finder at the
// head of sys.meta_path, which removes itself, puts the sources of the
// runs before into it when the code (or traceback) first imports it.
const driverSource = `import os, sys
def _moat_driver():
    sys.stdout.reconfigure(line_buffering=True)
    stdpath = sys.path[:]
    sys.path.insert(0, os.getcwd())
    pending = {}
    def linecache():
        lc = sys.modules.get('linecache')
        cache = getattr(lc, 'cache', None)
        if isinstance(cache, dict):
            cache.update(pending)
            pending.clear()
            return cache
        return pending
    class LinecacheFinder:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name != 'linecache':
                return None
            try:
                sys.meta_path.remove(cls)
            except ValueError:
                pass
            for f in sys.meta_path:
                if getattr(f, '__name__', '') == 'PathFinder':
                    spec = f.find_spec(name, path, target)
                    break
            else:
                return None
            if spec is None or spec.loader is None or not hasattr(spec.loader, 'exec_module'):
                return spec
            exec_module = spec.loader.exec_module
            def exec_and_fill(module):
                exec_module(module)
                linecache()
            spec.loader.exec_module = exec_and_fill
            return spec
    sys.meta_path.insert(0, LinecacheFinder)
    def print_exception(t, v, tb):
        tbm = sys.modules.get('traceback')
        if tbm is None:
            saved = sys.path[:]
            sys.path[:] = stdpath
            try:
                import traceback as tbm
            finally:
                sys.path[:] = saved
        linecache()
        tbm.print_exception(t, v, tb)
    out, err = sys.stdout, sys.stderr
    def readn(n):
        b = bytearray()
        while len(b) < n:
            c = os.read(3, n - len(b))
            if not c:
                os._exit(0)
            b += c
        return bytes(b)
    def status_of(code):
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xff
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        return 1
    g = {'__name__': '__main__', '__builtins__': __builtins__}
    os.write(4, b'H')
    n = 0
    while True:
        hdr = readn(37)
        if hdr[:1] != b'R':
            os._exit(0)
        marker, size = hdr[1:33], int.from_bytes(hdr[33:37], 'big')
        src = readn(size)
        n += 1
        name = '<run %d>' % n
        status = 0
        try:
            try:
                text = src.decode('utf-8')
                linecache()[name] = (len(text), None, text.splitlines(True), name)
            except UnicodeDecodeError:
                pass
            exec(compile(src, name, 'exec'), g)
        except SystemExit as e:
            status = status_of(e.code)
        except BaseException:
            t, v, tb = sys.exc_info()
            try:
                print_exception(t, v, tb.tb_next)
            except BaseException:
                pass
            status = 1
        del src
        for f in (sys.stdout, sys.stderr, out, err):
            try:
                f.flush()
            except BaseException:
                pass
        sys.stdout, sys.stderr = out, err
        for fd in (1, 2):
            try:
                os.write(fd, marker)
            except OSError:
                pass
        os.write(4, b'X' + marker + bytes([status]))
_moat_driver()
`

// interp is a live interpreter.
type interp struct {
	cmd     *exec.Cmd
	group   string
	cin     *os.File // the records to it
	cout    *os.File // its reports
	streams [2]*splitter
	done    chan struct{} // closed when it has ended, ws set
	ws      syscall.WaitStatus
	fresh   bool // it replaces one that ended
	gen     int  // the agent's gen when it started
	used    bool // it has been given a run's code
}

// discard ends it, which no run is using.
func (it *interp) discard() {
	killGroup(it.group)
	it.cin.Close()
	it.cout.Close()
	go func() { <-it.done; removeGroup(it.group) }()
}

// freshInterp makes sure that the session's interpreter, when it has not
// been given code yet, started in the current generation: one started
// earlier (saved with a suspended session, and so in each of its forks)
// is replaced with a new one (fresh as the one it replaces). One that has
// run code is the session's memory and is kept; when there is none, one
// starts.
func (a *agent) freshInterp() error {
	fresh := false
	if it := a.interp; it != nil {
		if it.used || it.gen == a.gen {
			return nil
		}
		fresh = it.fresh
		a.interp = nil
		it.discard()
	}
	it, err := a.startInterp()
	if err != nil {
		return err
	}
	it.fresh = fresh
	a.interp = it
	return nil
}

// gone says whether the interpreter has ended.
func (it *interp) gone() bool {
	select {
	case <-it.done:
		return true
	default:
		return false
	}
}

// startInterp starts an interpreter in a new cgroup and waits until it is
// ready.
func (a *agent) startInterp() (*interp, error) {
	a.groups++
	group := fmt.Sprintf("%s/interp-%d", cgroupDir, a.groups)
	if err := os.Mkdir(group, 0o755); err != nil {
		return nil, err
	}
	cg, err := os.Open(group)
	if err != nil {
		return nil, err
	}
	defer cg.Close()
	var toClose []*os.File
	defer func() {
		for _, f := range toClose {
			f.Close()
		}
	}()
	pipe := func() (*os.File, *os.File) {
		r, w, e := os.Pipe()
		if e != nil && err == nil {
			err = e
		}
		return r, w
	}
	inR, inW := pipe()
	outR, outW := pipe()
	soR, soW := pipe()
	seR, seW := pipe()
	if err != nil {
		return nil, err
	}
	toClose = append(toClose, inR, outW, soW, seW)
	devNull, err := os.Open("/dev/null")
	if err != nil {
		return nil, err
	}
	toClose = append(toClose, devNull)
	cmd := pythonCmd(codeDir + "/driver.py")
	cmd.Env = append(cmd.Env, a.env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devNull, soW, seW
	cmd.ExtraFiles = []*os.File{inR, outW}
	cmd.SysProcAttr.UseCgroupFD = true
	cmd.SysProcAttr.CgroupFD = int(cg.Fd())
	if err := reaped.start(cmd); err != nil {
		return nil, fmt.Errorf("start the interpreter: %w", err)
	}
	it := &interp{cmd: cmd, group: group, cin: inW, cout: outR, done: make(chan struct{}), gen: a.gen}
	go func() {
		it.ws = reaped.wait(cmd.Process.Pid)
		close(it.done)
	}()
	if err := it.ready(a, soR, seR); err != nil {
		return nil, err
	}
	return it, nil
}

// interpFromZygote makes z, a python3 of the current generation that has
// not been given code, the session's interpreter: it is handed the driver
// (codeDir/driver.py, written by then) as its code, the driver's records
// and reports pipes being the ones z got at its start, and the agent waits
// until the driver is ready. Python's start, the most of an interpreter's
// (about 0.9s under TCG), was done when z started: in a pooled VM, at its
// Refresh, after the reseed, so that the interpreter's hash secret is this
// VM's own. z is discarded when it fails.
func (a *agent) interpFromZygote(z *zygote) (*interp, error) {
	start := strings.Join(append([]string{"driver", codeDir + "/driver.py"}, a.env...), "\x00")
	if _, err := z.start.WriteString(start); err != nil {
		z.discard()
		return nil, fmt.Errorf("hand python3 the driver: %w", err)
	}
	z.start.Close()
	it := &interp{cmd: z.cmd, group: z.group, cin: z.records, cout: z.reports, done: make(chan struct{}), gen: z.gen}
	go func() {
		it.ws = reaped.wait(z.cmd.Process.Pid)
		close(it.done)
	}()
	if err := it.ready(a, z.out, z.errs); err != nil {
		return nil, err
	}
	return it, nil
}

// ready forwards the interpreter's stdout and stderr (sout and serr) to
// out from now on and waits, at most zygoteReady, for its driver to say it is
// ready. An interpreter that is not is killed.
func (it *interp) ready(out sender, sout, serr *os.File) error {
	for i, s := range []struct {
		f *os.File
		k wire.Kind
	}{{sout, wire.KindStdout}, {serr, wire.KindStderr}} {
		it.streams[i] = &splitter{out: out, kind: s.k, f: s.f, eof: make(chan struct{})}
		go it.streams[i].loop()
	}
	it.cout.SetReadDeadline(time.Now().Add(zygoteReady))
	var h [1]byte
	if _, err := io.ReadFull(it.cout, h[:]); err != nil || h[0] != 'H' {
		it.discard()
		return fmt.Errorf("the interpreter was not ready within %v: %v", zygoteReady, err)
	}
	it.cout.SetReadDeadline(time.Time{})
	return nil
}

// interpRun runs r's code in the session's interpreter, a fresh one when
// the last has ended, and returns the evidence of how the run ended.
func (a *agent) interpRun(r *wire.Run, st *runState) (*wire.Exit, error) {
	if a.interp != nil && a.interp.gone() {
		// It ended between runs (a thread of the code's called
		// os._exit before the VM paused).
		killGroup(a.interp.group)
		go removeGroup(a.interp.group)
		a.interp = nil
	}
	if a.interp == nil {
		it, err := a.startInterp()
		if err != nil {
			return nil, err
		}
		it.fresh = true
		a.interp = it
	}
	if err := a.freshInterp(); err != nil {
		return nil, err
	}
	it := a.interp
	it.used = true
	group := it.group
	st.group.Store(&group)
	exit := &wire.Exit{Fresh: it.fresh}
	it.fresh = false
	ended := func(ws syscall.WaitStatus) {
		killGroup(group)
		go removeGroup(group)
		a.interp = nil
		exit.Ended = true
		if ws.Signaled() {
			exit.Signal = int(ws.Signal())
		} else {
			exit.ExitCode = ws.ExitStatus()
		}
	}
	if st.killed.Load() {
		killGroup(group)
		<-it.done
		ended(it.ws)
		return exit, nil
	}
	for file, v := range map[string]string{
		"memory.max":       strconv.FormatInt(r.Memory, 10),
		"memory.oom.group": "1",
		"pids.max":         strconv.FormatInt(r.Pids, 10),
	} {
		if err := os.WriteFile(filepath.Join(group, file), []byte(v), 0); err != nil {
			return nil, fmt.Errorf("cgroup %s: %w", file, err)
		}
	}
	os.WriteFile(filepath.Join(group, "memory.swap.max"), []byte("0"), 0)
	pid := it.cmd.Process.Pid
	for _, rl := range [][3]uint64{
		{unix.RLIMIT_FSIZE, uint64(r.FileSize), uint64(r.FileSize)},
		{unix.RLIMIT_NOFILE, uint64(r.OpenFiles), uint64(r.OpenFiles)},
		{unix.RLIMIT_CORE, 0, 0},
	} {
		if err := unix.Prlimit(pid, int(rl[0]), &unix.Rlimit{Cur: rl[1], Max: rl[2]}, nil); err != nil && !it.gone() {
			return nil, fmt.Errorf("rlimit %d of the interpreter: %w", rl[0], err)
		}
	}
	ooms := func() int64 {
		return eventCount(group, "memory.events", "oom_kill") + eventCount(group, "memory.events", "oom_group_kill")
	}
	baseMS, baseOOM, basePids := cpuUsageMS(group), ooms(), eventCount(group, "pids.events", "max")

	var raw [16]byte
	rand.Read(raw[:])
	marker := []byte(hex.EncodeToString(raw[:]))
	for _, s := range it.streams {
		s.arm(marker)
	}
	rec := make([]byte, 0, 37+len(r.Code))
	rec = append(rec, 'R')
	rec = append(rec, marker...)
	rec = binary.BigEndian.AppendUint32(rec, uint32(len(r.Code)))
	rec = append(rec, r.Code...)
	start := time.Now()
	go it.cin.Write(rec) // an interpreter that died fails it; the wait below sees why
	a.send(wire.KindStarted, nil)

	var over atomic.Bool
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if cpuUsageMS(group)-baseMS >= r.CPUMS {
					over.Store(true)
					killGroup(group)
					return
				}
			}
		}
	}()
	report := make(chan int, 1) // the status it reported, -1 for none
	go func() {
		var b [34]byte
		if _, err := io.ReadFull(it.cout, b[:]); err != nil || b[0] != 'X' || !bytes.Equal(b[1:33], marker) {
			report <- -1
			return
		}
		report <- int(b[33])
	}()
	select {
	case status := <-report:
		if status < 0 {
			// Not the report of this run: the interpreter is ended.
			killGroup(group)
			<-it.done
			ended(it.ws)
			break
		}
		exit.ExitCode = status
		// Its output up to the marker, then nothing of the run runs on.
		for _, s := range it.streams {
			s.wait(2 * time.Second)
		}
		killOthers(group, pid)
	case <-it.done:
		ended(it.ws)
		for _, s := range it.streams {
			s.wait(2 * time.Second)
		}
	}
	exit.WallMS = time.Since(start).Milliseconds()
	exit.CPUMS = cpuUsageMS(group) - baseMS
	if exit.Ended {
		// The cgroup is killed; its counters stay readable until removed.
		exit.CPUMS = max(exit.CPUMS, 0)
	}
	var skip map[uint64]bool
	if a.files != nil {
		skip = a.files.committed()
	}
	exit.CPU = over.Load() || (exit.Signal == int(unix.SIGKILL) && exit.CPUMS >= r.CPUMS)
	exit.OOM = ooms() > baseOOM
	exit.Pids = eventCount(group, "pids.events", "max") > basePids
	exit.FileSize = fileAtLimit(r.FileSize, start, skip, upperFS+"/u", upperFS+"/shm")
	exit.Disk = diskFull(upperFS)
	return exit, nil
}

// killOthers kills every process of group but pid, the interpreter: what
// the run started does not outlive it.
func killOthers(group string, pid int) {
	for range 10 {
		b, err := os.ReadFile(group + "/cgroup.procs")
		if err != nil {
			return
		}
		others := 0
		for _, f := range strings.Fields(string(b)) {
			p, err := strconv.Atoi(f)
			if err != nil || p == pid {
				continue
			}
			others++
			syscall.Kill(p, syscall.SIGKILL)
		}
		if others == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// splitter forwards one output stream of the interpreter while a run is
// in progress, up to the run's marker, and drops what comes between runs.
type splitter struct {
	out  sender
	kind wire.Kind
	f    *os.File
	eof  chan struct{}

	mu      sync.Mutex
	marker  []byte // the run's; nil between runs
	pending []byte // what may be the start of the marker
	found   chan struct{}
}

// arm starts forwarding for a run whose output ends at marker.
func (s *splitter) arm(marker []byte) {
	s.mu.Lock()
	s.marker, s.pending, s.found = marker, nil, make(chan struct{})
	s.mu.Unlock()
}

// wait waits, at most d, for the marker (or the stream's end).
func (s *splitter) wait(d time.Duration) {
	s.mu.Lock()
	found := s.found
	s.mu.Unlock()
	if found == nil {
		return
	}
	select {
	case <-found:
	case <-s.eof:
	case <-time.After(d):
	}
	s.mu.Lock()
	if s.marker != nil { // not found: what came is the run's, the rest dropped
		s.forward(s.pending)
		s.end()
	}
	s.mu.Unlock()
}

func (s *splitter) loop() {
	defer close(s.eof)
	defer s.f.Close()
	buf := make([]byte, wire.MaxReport)
	for {
		n, err := s.f.Read(buf)
		if n > 0 {
			s.feed(buf[:n])
		}
		if err != nil {
			s.mu.Lock()
			if s.marker != nil {
				s.forward(s.pending)
				s.end()
			}
			s.mu.Unlock()
			return
		}
	}
}

func (s *splitter) feed(b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.marker == nil {
		return
	}
	s.pending = append(s.pending, b...)
	if i := bytes.Index(s.pending, s.marker); i >= 0 {
		s.forward(s.pending[:i])
		s.end()
		return
	}
	// Hold back only what may begin the marker: the rest goes now.
	keep := 0
	for k := min(len(s.marker)-1, len(s.pending)); k > 0; k-- {
		if bytes.HasSuffix(s.pending, s.marker[:k]) {
			keep = k
			break
		}
	}
	s.forward(s.pending[:len(s.pending)-keep])
	s.pending = append([]byte(nil), s.pending[len(s.pending)-keep:]...)
}

// end stops the forwarding; s.mu is held.
func (s *splitter) end() {
	s.marker, s.pending = nil, nil
	close(s.found)
}

// forward sends b in frames of at most MaxReport bytes; s.mu is held.
func (s *splitter) forward(b []byte) {
	for len(b) > 0 {
		n := min(len(b), wire.MaxReport)
		s.out.send(s.kind, b[:n])
		b = b[n:]
	}
}
