package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/sandboxtest"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// The test binary doubles as a server process: with MOAT_TEST_SERVER_STATE
// set it serves on 127.0.0.1, writes its address to the file named by
// MOAT_TEST_SERVER_ADDR, and shuts down gracefully on SIGTERM. It serves a
// subprocess sandbox, or with MOAT_TEST_SERVER_FAKE=1 the fakes of
// profileFakes (no root needed).
// After the tests, no child process of the test binary may be left.
func TestMain(m *testing.M) {
	if state := os.Getenv("MOAT_TEST_SERVER_STATE"); state != "" {
		os.Exit(serverChild(state, os.Getenv("MOAT_TEST_SERVER_ADDR")))
	}
	os.Exit(sandboxtest.CheckNoChildren(m.Run(), 2*time.Second))
}

func serverChild(state, addrFile string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	var cfg server.Config
	if os.Getenv("MOAT_TEST_SERVER_FAKE") == "1" {
		cfg = newProfileFakes().config(state)
	} else {
		sb, err := subprocess.New(subprocess.Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}, Logger: log})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer sb.Close()
		cfg = server.Config{
			Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelSubprocess: sb},
			Tokens:    []server.Token{{Name: "a", Token: tokenA}},
			StateDir:  state,
		}
	}
	cfg.Logger = log
	srv, err := server.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := os.WriteFile(addrFile+".tmp", []byte(l.Addr().String()), 0o600); err != nil {
		return 1
	}
	os.Rename(addrFile+".tmp", addrFile)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	select {
	case <-ctx.Done():
	case err := <-served:
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		fmt.Fprintln(os.Stderr, "shutdown:", err)
		return 1
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return 1
	}
	return 0
}

// childServer is a server running in a child process.
type childServer struct {
	cmd  *exec.Cmd
	URL  string
	log  string        // the file of its standard error
	done chan struct{} // closed once the process is reaped
	err  error         // cmd.Wait's
}

// startChild starts a server process on state, with env added to its
// environment.
func startChild(t *testing.T, state string, env ...string) *childServer {
	t.Helper()
	addrFile := filepath.Join(t.TempDir(), "addr")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), "MOAT_TEST_SERVER_STATE="+state, "MOAT_TEST_SERVER_ADDR="+addrFile), env...)
	cmd.Stdout = os.Stderr
	logPath := filepath.Join(t.TempDir(), "log")
	logf, _ := os.Create(logPath)
	cmd.Stderr = logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &childServer{cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { c.err = cmd.Wait(); close(c.done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-c.done
		if t.Failed() {
			logf.Seek(0, 0)
			b, _ := io.ReadAll(logf)
			t.Logf("server log:\n%s", b)
		}
	})
	eventually(t, 20*time.Second, "the child server listens", func() bool {
		b, err := os.ReadFile(addrFile)
		if err != nil {
			return false
		}
		c.URL = "http://" + string(b)
		return true
	})
	return c
}

// TestRestartRecovery kills the server with SIGKILL in the middle of runs,
// starts it again on the same state directory, and checks that nothing of
// the dead server's sessions is left: records, directories, processes,
// cgroups.
func TestRestartRecovery(t *testing.T) {
	requireRoot(t)
	state := t.TempDir()
	first := startChild(t, state)
	ts := &testServer{URL: first.URL}

	type sess struct {
		id, dir string
		uid     int
	}
	var sessions []sess
	var streams []*http.Response
	for _, interp := range []bool{false, true} {
		id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"interpreter": interp}), 201).JSON(t)["id"].(string)
		must(t, call(t, "PUT", ts.URL+"/v1/sessions/"+id+"/files/data.txt", tokenA, []byte("data")), 201)
		// A run that is going on when the server dies, with a child.
		body := `{"code":"import os, subprocess\nsubprocess.Popen(['sleep','300'])\nprint(os.getcwd(), os.getuid(), flush=True)\nimport time; time.sleep(300)","stream":true}`
		req, _ := http.NewRequest("POST", ts.URL+"/v1/sessions/"+id+"/runs", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+tokenA)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, resp)
		events := make(chan event, 4)
		go readEvents(resp.Body, events)
		ev := <-events
		var d map[string]string
		json.Unmarshal([]byte(ev.Data), &d)
		f := strings.Fields(d["data"])
		if ev.Name != "stdout" || len(f) != 2 {
			t.Fatalf("first event: %+v", ev)
		}
		uid, _ := strconv.Atoi(f[1])
		sessions = append(sessions, sess{id, f[0], uid})
	}
	for _, s := range sessions {
		if _, err := os.Stat(filepath.Join(s.dir, "data.txt")); err != nil {
			t.Fatalf("session %s: its directory is not where the run said: %v", s.id, err)
		}
		if len(processesOfUID(s.uid)) < 2 {
			t.Fatalf("session %s: no processes of uid %d running", s.id, s.uid)
		}
	}
	ownerID, _, _ := strings.Cut(filepath.Base(sessions[0].dir), "-")

	first.cmd.Process.Signal(syscall.SIGKILL)
	<-first.done
	for _, r := range streams {
		r.Body.Close()
	}
	// What the dead server leaves until someone reaps it: its session
	// directories (mounted tmpfs) and cgroups. Their presence now shows
	// that the checks below can fail.
	for _, s := range sessions {
		if _, err := os.Stat(s.dir); err != nil {
			t.Errorf("the session directory %s vanished before the restart: the restart check proves nothing", s.dir)
		}
	}

	second := startChild(t, state)
	ts2 := &testServer{URL: second.URL}
	must(t, call(t, "GET", ts2.URL+"/healthz", "", nil), 200)
	if r := must(t, call(t, "GET", ts2.URL+"/v1/sessions", tokenA, nil), 200); strings.TrimSpace(string(r.Body)) != `{"sessions":[]}` {
		t.Errorf("sessions after the restart: %s", r.Body)
	}
	if v := metric(t, ts2, "moat_sessions_recovered_total"); v != 2 {
		t.Errorf("recovered sessions: %v, want 2", v)
	}
	for _, s := range sessions {
		if r := call(t, "GET", ts2.URL+"/v1/sessions/"+s.id, tokenA, nil); r.Status != 404 {
			t.Errorf("session %s after the restart: %d", s.id, r.Status)
		}
		if _, err := os.Stat(s.dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("session directory %s left: %v", s.dir, err)
		}
		eventually(t, 10*time.Second, "no process of the dead server's sessions", func() bool {
			return len(processesOfUID(s.uid)) == 0
		})
	}
	if mounts, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mounts), "/run/moat/runs/"+ownerID+"-") {
		t.Errorf("mounts of the dead server left")
	}
	for _, dir := range []string{"/run/moat/runs", "/sys/fs/cgroup/memory/moat", "/sys/fs/cgroup/pids/moat", "/sys/fs/cgroup/cpuacct/moat", "/sys/fs/cgroup/moat"} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), ownerID+"-") {
				t.Errorf("left by the dead server: %s", filepath.Join(dir, e.Name()))
			}
		}
	}

	// The second server works, and shuts down gracefully on SIGTERM,
	// ending its sessions without leaving them for recovery.
	id := must(t, call(t, "POST", ts2.URL+"/v1/sessions", tokenA, map[string]any{}), 201).JSON(t)["id"].(string)
	r := must(t, call(t, "POST", ts2.URL+"/v1/sessions/"+id+"/runs", tokenA, map[string]any{"code": "import os; print(os.getcwd())"}), 200)
	dir := strings.TrimSpace(r.JSON(t)["stdout"].(string))
	second.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-second.done:
		if second.err != nil {
			t.Errorf("graceful shutdown: %v", second.err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the server did not stop on SIGTERM")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("session directory %s left after a graceful shutdown: %v", dir, err)
	}
	third := startChild(t, state)
	if v := metric(t, &testServer{URL: third.URL}, "moat_sessions_recovered_total"); v != 0 {
		t.Errorf("after a graceful shutdown, %v sessions were left for recovery", v)
	}
}
