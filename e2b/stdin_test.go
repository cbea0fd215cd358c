package e2b_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem"
	"github.com/moatsandbox/moat/e2b/internal/envd/process"
	"github.com/moatsandbox/moat/server"
)

// started is a command in progress with its stream read in the background.
type started struct {
	pid  uint32
	done chan ran
}

// startStdin starts cfg with stdin and reads its stream to the end on a
// goroutine.
func startStdin(t *testing.T, ctx context.Context, cl clients, cfg *process.ProcessConfig) started {
	t.Helper()
	stream, err := cl.proc.Start(ctx, connect.NewRequest(&process.StartRequest{Process: cfg, Stdin: new(true)}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || stream.Msg().GetEvent().GetStart() == nil {
		t.Fatalf("no start event: %v", stream.Err())
	}
	s := started{pid: stream.Msg().GetEvent().GetStart().GetPid(), done: make(chan ran, 1)}
	go func() {
		defer stream.Close()
		var r ran
		for stream.Receive() {
			switch ev := stream.Msg().GetEvent().GetEvent().(type) {
			case *process.ProcessEvent_Data:
				r.stdout += string(ev.Data.GetStdout())
				r.stderr += string(ev.Data.GetStderr())
			case *process.ProcessEvent_End:
				r.end = ev.End
			}
		}
		s.done <- r
	}()
	return s
}

func pidSel(pid uint32) *process.ProcessSelector {
	return &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
}

func sendStdin(ctx context.Context, cl clients, pid uint32, data string) error {
	_, err := cl.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{
		Process: pidSel(pid), Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: []byte(data)}}}))
	return err
}

func closeStdin(ctx context.Context, cl clients, pid uint32) error {
	_, err := cl.proc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: pidSel(pid)}))
	return err
}

func waitRan(t *testing.T, s started) ran {
	t.Helper()
	select {
	case r := <-s.done:
		return r
	case <-time.After(60 * time.Second):
		t.Fatal("the command did not end")
		return ran{}
	}
}

// A command started with stdin reads what SendInput sends, in order, past
// the number of chunks the spool holds at once, and the end of it at
// CloseStdin; its exit status is its own; the spool is gone after it and
// never listed. In a sandbox with a live interpreter too, whose names
// outlive the command.
func TestStdin(t *testing.T) {
	for _, tpl := range []string{"base", "code-interpreter-v1"} {
		t.Run(tpl, func(t *testing.T) {
			ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, nil)
			c := ts.create(t, keyA, map[string]any{"templateID": tpl})
			cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()

			s := startStdin(t, ctx, cl, bash(`n=0; while read -r l; do n=$((n+1)); echo "got $l"; done; echo "lines $n"; exit 7`))
			var want strings.Builder
			for i := range 20 {
				if err := sendStdin(ctx, cl, s.pid, fmt.Sprintf("line%d\n", i)); err != nil {
					t.Fatalf("send %d: %v", i, err)
				}
				fmt.Fprintf(&want, "got line%d\n", i)
			}
			// Listings during the command do not show the spool.
			list, err := cl.fs.ListDir(ctx, connect.NewRequest(&filesystem.ListDirRequest{Path: "/home/user", Depth: 5}))
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range list.Msg.GetEntries() {
				if strings.Contains(e.GetPath(), ".moat-stdin") {
					t.Errorf("listed: %s", e.GetPath())
				}
			}
			if err := closeStdin(ctx, cl, s.pid); err != nil {
				t.Fatal(err)
			}
			if err := sendStdin(ctx, cl, s.pid, "late\n"); connect.CodeOf(err) != connect.CodeFailedPrecondition && connect.CodeOf(err) != connect.CodeNotFound {
				t.Errorf("send after close: %v, want failed_precondition", err)
			}
			r := waitRan(t, s)
			want.WriteString("lines 20\n")
			if r.stdout != want.String() || r.end.GetExitCode() != 7 || !r.end.GetExited() {
				t.Errorf("stdout %q, end %+v; want %q and exit 7", r.stdout, r.end, want.String())
			}
			// Nothing of the spool is left in the session.
			sess, done, err := ts.srv.UseSession(ctx, "a", c.SandboxID)
			if err != nil {
				t.Fatal(err)
			}
			files, err := sess.ListFiles(ctx)
			done()
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range files {
				if strings.HasPrefix(f.Name, ".moat-stdin") {
					t.Errorf("left after the command: %s", f.Name)
				}
			}

			// A command that does not read its input can be killed while
			// a send waits for it; killed by a signal, it says so.
			s = startStdin(t, ctx, cl, bash(`kill -TERM $$`))
			r = waitRan(t, s)
			// With a live interpreter, which outlives the command, the
			// status is the shell's 128+15, as the interpreter reports
			// its child's.
			if tpl == "base" && (r.end.GetExited() || r.end.GetStatus() != "signal: terminated" || r.end.Error != nil) ||
				tpl != "base" && r.end.GetExitCode() != 143 {
				t.Errorf("a command killed by SIGTERM: %+v", r.end)
			}
			s = startStdin(t, ctx, cl, bash(`sleep 50`))
			sent := make(chan error, 1)
			go func() {
				var err error
				// 40 of 64KiB: more than the pipe and the spool hold.
				chunk := strings.Repeat("x", 64<<10)
				for i := 0; i < 40 && err == nil; i++ {
					err = sendStdin(ctx, cl, s.pid, chunk)
				}
				sent <- err
			}()
			time.Sleep(500 * time.Millisecond)
			if _, err := cl.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pidSel(s.pid), Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
				t.Fatal(err)
			}
			waitRan(t, s)
			select {
			case err := <-sent:
				if err == nil {
					t.Error("40 sends to a command that reads nothing all succeeded: the spool is not bounded")
				}
			case <-time.After(30 * time.Second):
				t.Error("a send waiting for a killed command did not end")
			}

			// Without stdin: SendInput is refused, CloseStdin succeeds.
			stream, err := cl.proc.Start(ctx, connect.NewRequest(&process.StartRequest{Process: bash("sleep 50")}))
			if err != nil {
				t.Fatal(err)
			}
			defer stream.Close()
			if !stream.Receive() {
				t.Fatal(stream.Err())
			}
			pid := stream.Msg().GetEvent().GetStart().GetPid()
			if err := sendStdin(ctx, cl, pid, "x"); connect.CodeOf(err) != connect.CodeFailedPrecondition {
				t.Errorf("send to a command without stdin: %v, want failed_precondition", err)
			}
			if err := closeStdin(ctx, cl, pid); err != nil {
				t.Errorf("close stdin of a command without it: %v", err)
			}
			cl.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pidSel(pid), Signal: process.Signal_SIGNAL_SIGKILL}))
			for stream.Receive() {
			}
		})
	}
}

// A command's end is its own, not that of a process it left holding its
// input: when the command has ended, the relay stops feeding the pipe,
// even one full and never read, and the end comes while that process
// still runs. In a live interpreter the relay's thread has gone by then.
func TestStdinEndsWithCommand(t *testing.T) {
	for _, tpl := range []string{"base", "code-interpreter-v1"} {
		t.Run(tpl, func(t *testing.T) {
			ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, nil)
			c := ts.create(t, keyA, map[string]any{"templateID": tpl})
			cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			// The background shell keeps the pipe's read end and reads
			// nothing; the command waits until its input is past what
			// the pipe holds, then exits.
			s := startStdin(t, ctx, cl, bash(`sh -c 'sleep 8; touch bg-done' <&0 & while [ ! -e sent ]; do sleep 0.05; done; echo main`))
			chunk := strings.Repeat("x", 64<<10)
			for i := range 3 {
				if err := sendStdin(ctx, cl, s.pid, chunk); err != nil {
					t.Fatalf("send %d: %v", i, err)
				}
			}
			// The relay has written the first chunk: the pipe is full.
			time.Sleep(300 * time.Millisecond)
			if _, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "/home/user/sent"})); err == nil {
				t.Fatal("sent exists before the test made it")
			}
			sess, done, err := ts.srv.UseSession(ctx, "a", c.SandboxID)
			if err != nil {
				t.Fatal(err)
			}
			err = sess.WriteFile(ctx, "sent", strings.NewReader(""))
			done()
			if err != nil {
				t.Fatal(err)
			}
			r := waitRan(t, s)
			if r.stdout != "main\n" || r.end.GetExitCode() != 0 {
				t.Errorf("stdout %q, end %+v", r.stdout, r.end)
			}
			if _, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "/home/user/bg-done"})); err == nil {
				t.Error("the command's end came only once the process holding its input had ended")
			}

			// A FIFO where the next chunk goes (the code's own doing)
			// ends the input; it does not hold the relay.
			s = startStdin(t, ctx, cl, bash(`mkfifo "$(echo ~/.moat-stdin/*)/0" && cat && echo planted`))
			r = waitRan(t, s)
			if r.stdout != "planted\n" || r.end.GetExitCode() != 0 || r.end.Error != nil {
				t.Errorf("a FIFO in the spool: stdout %q, end %+v", r.stdout, r.end)
			}
			if tpl == "base" {
				return
			}
			// The relay's thread is gone, and no name of it is left.
			_, objs := execute(t, ts, c, map[string]any{"code": "import threading\n(threading.active_count(), [n for n in ('relay', 'clean', '_moat_child') if n in globals()])"})
			if res, _ := of(objs, "result"); len(res) != 1 || res[0]["text"] != "(1, [])" {
				t.Errorf("the interpreter after the commands: %v", objs)
			}
		})
	}
}

// A send that waits for the command to read holds the command's input;
// the calls behind it still end with their own deadlines, and a kill ends
// the one that waits.
func TestStdinCallsBehindAWaitingSend(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, nil)
	c := ts.create(t, keyA, map[string]any{"templateID": "base"})
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s := startStdin(t, ctx, cl, bash(`sleep 50`))
	chunk := strings.Repeat("x", 64<<10)
	// Fill the pipe and the spool: a send with a short deadline fails
	// once the next one would wait.
	full := false
	for i := 0; i < 40 && !full; i++ {
		sctx, scancel := context.WithTimeout(ctx, time.Second)
		err := sendStdin(sctx, cl, s.pid, chunk)
		scancel()
		if connect.CodeOf(err) == connect.CodeDeadlineExceeded {
			full = true
		} else if err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	if !full {
		t.Fatal("40 sends of 64KiB to a command that reads nothing all succeeded")
	}
	waiting := make(chan error, 1)
	go func() { waiting <- sendStdin(ctx, cl, s.pid, chunk) }()
	time.Sleep(200 * time.Millisecond)
	for name, call := range map[string]func(context.Context) error{
		"close": func(ctx context.Context) error { return closeStdin(ctx, cl, s.pid) },
		"send":  func(ctx context.Context) error { return sendStdin(ctx, cl, s.pid, "y") },
	} {
		sctx, scancel := context.WithTimeout(ctx, 500*time.Millisecond)
		err := call(sctx)
		scancel()
		if connect.CodeOf(err) != connect.CodeDeadlineExceeded {
			t.Errorf("%s behind a waiting send: %v, want deadline_exceeded", name, err)
		}
		select {
		case err := <-waiting:
			t.Fatalf("the waiting send ended before the %s behind it: %v", name, err)
		default:
		}
	}
	// On the server's side too: nothing but the waiting send is left of
	// those calls once their deadlines have passed (the client gives up
	// at its deadline whatever the server does).
	var left int
	for range 50 {
		left = stdinCallsLeft()
		if left == 1 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if left != 1 {
		t.Errorf("%d calls on the command's input in progress on the server, want 1 (the waiting send)", left)
	}
	if _, err := cl.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pidSel(s.pid), Signal: process.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	waitRan(t, s)
	if err := <-waiting; connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("the waiting send after the kill: %v, want not_found", err)
	}
}

// stdinCallsLeft counts the server's goroutines in a SendInput or a
// CloseStdin.
func stdinCallsLeft() int {
	buf := make([]byte, 8<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "e2b.(*processService).SendInput(") || strings.Contains(g, "e2b.(*processService).CloseStdin(") {
			n++
		}
	}
	return n
}

// slowStat is a sandbox whose sessions take statTime for each Stat in a
// stdin spool, as a file operation does at the levels that run a program
// in the instance for it, and count them.
type slowStat struct {
	moat.Sandbox
	statTime time.Duration
	stats    *atomic.Int64
}

func (s slowStat) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	sess, err := s.Sandbox.(moat.Sessioner).NewSession(ctx, opts)
	if err != nil {
		return nil, err
	}
	return slowStatSession{sess, s}, nil
}

type slowStatSession struct {
	moat.Session
	s slowStat
}

func (ss slowStatSession) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	if strings.HasPrefix(name, ".moat-stdin/") {
		ss.s.stats.Add(1)
		time.Sleep(ss.s.statTime)
	}
	return ss.Session.Stat(ctx, name)
}

// A send waiting for a command that does not read looks at the spool at a
// pace set by what a look costs: at most a tenth of the time (a fifth
// here, for the scheduler's noise) goes to looking.
func TestStdinWaitPace(t *testing.T) {
	const statTime = 20 * time.Millisecond
	var stats atomic.Int64
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, func(sc *server.Config, _ *e2b.Config) {
		sc.Sandboxes[moat.LevelSubprocess] = slowStat{sc.Sandboxes[moat.LevelSubprocess], statTime, &stats}
	})
	c := ts.create(t, keyA, map[string]any{"templateID": "base"})
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s := startStdin(t, ctx, cl, bash(`sleep 50`))
	chunk := strings.Repeat("x", 64<<10)
	for i := 0; ; i++ {
		if i == 40 {
			t.Fatal("40 sends of 64KiB to a command that reads nothing all succeeded")
		}
		stats.Store(0)
		start := time.Now()
		sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
		err := sendStdin(sctx, cl, s.pid, chunk)
		scancel()
		if connect.CodeOf(err) == connect.CodeDeadlineExceeded {
			waited, looked := time.Since(start), time.Duration(stats.Load())*statTime
			t.Logf("a send waited %v and spent %v (%d looks) looking at the spool", waited, looked, stats.Load())
			if looked*5 > waited {
				t.Errorf("a send waited %v and spent %v (%d looks) looking at the spool: over a fifth", waited, looked, stats.Load())
			}
			break
		}
		if err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	cl.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{Process: pidSel(s.pid), Signal: process.Signal_SIGNAL_SIGKILL}))
	waitRan(t, s)
}

// slowSuspend is a sandbox whose sessions take suspendTime more to
// suspend.
type slowSuspend struct {
	moat.Sandbox
	suspendTime time.Duration
}

func (s slowSuspend) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	sess, err := s.Sandbox.(moat.Sessioner).NewSession(ctx, opts)
	if err != nil {
		return nil, err
	}
	return slowSuspendSession{sess, s.suspendTime}, nil
}

func (s slowSuspend) ResumeSession(ctx context.Context, dir string) (moat.Session, moat.SuspendInfo, error) {
	sess, info, err := s.Sandbox.(moat.Resumer).ResumeSession(ctx, dir)
	if err != nil {
		return nil, info, err
	}
	return slowSuspendSession{sess, s.suspendTime}, info, nil
}

type slowSuspendSession struct {
	moat.Session
	suspendTime time.Duration
}

func (ss slowSuspendSession) Suspend(ctx context.Context, dir string) (moat.SuspendInfo, error) {
	time.Sleep(ss.suspendTime)
	return ss.Session.(moat.Suspender).Suspend(ctx, dir)
}

// Cleaning a command's spool up never wakes its sandbox: one whose
// suspend began as the command ended (the suspend waited for it) stays
// suspended.
func TestStdinCleanupDoesNotResume(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, func(sc *server.Config, _ *e2b.Config) {
		sc.Sandboxes[moat.LevelSubprocess] = slowSuspend{sc.Sandboxes[moat.LevelSubprocess], time.Second}
	})
	c := ts.create(t, keyA, map[string]any{"templateID": "base"})
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s := startStdin(t, ctx, cl, bash(`touch up; sleep 0.5`))
	// Once the command runs (the start event comes before), the suspend
	// waits for it to end.
	for {
		if _, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "/home/user/up"})); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := ts.srv.SuspendSession(ctx, "a", c.SandboxID); err != nil {
		t.Fatal(err)
	}
	waitRan(t, s)
	// The cleanup has had the time to run.
	time.Sleep(time.Second)
	if info, err := ts.srv.Session("a", c.SandboxID); err != nil || info.State != "suspended" {
		t.Errorf("the sandbox suspended as a command ended: %+v %v, want suspended", info, err)
	}
}

// killedAfterEOF is a sandbox whose sessions' write of a spool's "eof"
// fails after it was done, once the command had the time to end: what a
// run's end does at the container level, where it kills every process of
// the instance, the one that wrote the file too.
type killedAfterEOF struct{ moat.Sandbox }

func (s killedAfterEOF) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	sess, err := s.Sandbox.(moat.Sessioner).NewSession(ctx, opts)
	if err != nil {
		return nil, err
	}
	return killedAfterEOFSession{sess}, nil
}

type killedAfterEOFSession struct{ moat.Session }

func (ss killedAfterEOFSession) WriteFile(ctx context.Context, name string, r io.Reader) error {
	if err := ss.Session.WriteFile(ctx, name, r); err != nil || !strings.HasSuffix(name, "/eof") {
		return err
	}
	time.Sleep(300 * time.Millisecond)
	return errors.New("session exec /usr/bin/python3: exit 137")
}

// The end of a command's input is closed when the command ends with it,
// even if the write of the end failed with the command's end.
func TestStdinCloseAsTheCommandEnds(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, func(sc *server.Config, _ *e2b.Config) {
		sc.Sandboxes[moat.LevelSubprocess] = killedAfterEOF{sc.Sandboxes[moat.LevelSubprocess]}
	})
	c := ts.create(t, keyA, map[string]any{"templateID": "base"})
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s := startStdin(t, ctx, cl, bash(`cat; echo eof`))
	if err := sendStdin(ctx, cl, s.pid, "one\n"); err != nil {
		t.Fatal(err)
	}
	if err := closeStdin(ctx, cl, s.pid); err != nil {
		t.Errorf("close as the command ends: %v", err)
	}
	if r := waitRan(t, s); r.stdout != "one\neof\n" || r.end.GetExitCode() != 0 {
		t.Errorf("stdout %q, end %+v", r.stdout, r.end)
	}
}

// The relay waits on a descriptor of any number: in a live interpreter
// that holds more than 1024 files (select's limit) a command still gets
// its input.
func TestStdinManyFiles(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second), OpenFiles: 4096}, nil)
	c := ts.create(t, keyA, map[string]any{"templateID": "code-interpreter-v1"})
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, objs := execute(t, ts, c, map[string]any{"code": "import os\nheld = [os.open('/dev/null', os.O_RDONLY) for _ in range(1100)]\nlen(held)"})
	if res, _ := of(objs, "result"); len(res) != 1 || res[0]["text"] != "1100" {
		t.Fatalf("holding 1100 files: %v", objs)
	}
	s := startStdin(t, ctx, cl, bash(`cat`))
	if err := sendStdin(ctx, cl, s.pid, "through\n"); err != nil {
		t.Fatal(err)
	}
	if err := closeStdin(ctx, cl, s.pid); err != nil {
		t.Fatal(err)
	}
	if r := waitRan(t, s); r.stdout != "through\n" || r.stderr != "" || r.end.GetExitCode() != 0 {
		t.Errorf("stdout %q, stderr %q, end %+v", r.stdout, r.stderr, r.end)
	}
}
