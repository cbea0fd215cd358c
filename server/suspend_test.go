package server_test

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// notesOf returns a run result's notes.
func notesOf(m map[string]any) []string {
	var out []string
	ns, _ := m["notes"].([]any)
	for _, n := range ns {
		s, _ := n.(string)
		out = append(out, s)
	}
	return out
}

func hasNote(notes []string, part string) bool {
	return slices.ContainsFunc(notes, func(n string) bool { return strings.Contains(n, part) })
}

// TestSuspendResumeKeepsFiles suspends a session through the API: nothing
// of it runs, its state is moat's alone on disk, and an explicit resume, a
// run and a file operation each bring it back with its files.
func TestSuspendResumeKeepsFiles(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	r := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"interpreter": true}), 201)
	if v := r.JSON(t); v["state"] != "running" || v["memory"] != nil {
		t.Errorf("a new session: %s", r.Body)
	}
	id := r.JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	must(t, call(t, "PUT", base+"/files/in/data.txt", tokenA, []byte("uploaded")), 201)
	res := must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": "import os\nv = 41\nopen('made.txt', 'w').write('made')\nprint(os.getuid())"}), 200).JSON(t)
	uid := strings.TrimSpace(res["stdout"].(string))

	v := must(t, call(t, "POST", base+"/suspend", tokenA, nil), 200).JSON(t)
	if v["state"] != "suspended" || v["memory"] != false || v["suspended_at"] == nil {
		t.Fatalf("suspended: %v", v)
	}
	if g := must(t, call(t, "GET", base, tokenA, nil), 200).JSON(t); g["state"] != "suspended" {
		t.Errorf("GET after suspend: %v", g)
	}
	// Suspending a suspended session does nothing.
	must(t, call(t, "POST", base+"/suspend", tokenA, nil), 200)
	dir := filepath.Join(ts.cfg.StateDir, "suspended", id)
	for _, p := range []string{filepath.Dir(dir), dir} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatalf("the suspended state: %v", err)
		}
		if fi.Mode().Perm() != 0o700 || fi.Sys().(*syscall.Stat_t).Uid != 0 {
			t.Errorf("%s: mode %v uid %d, want 0700 and root's", p, fi.Mode().Perm(), fi.Sys().(*syscall.Stat_t).Uid)
		}
	}
	if v := metric(t, ts, `moat_sessions{state="suspended"}`); v != 1 {
		t.Errorf(`moat_sessions{state="suspended"} = %v, want 1`, v)
	}
	if uid != "" {
		if n := processesOfUID(atoi(t, uid)); len(n) > 0 {
			t.Errorf("processes of the suspended session's uid %s: %v", uid, n)
		}
	}

	// Explicit resume.
	v = must(t, call(t, "POST", base+"/resume", tokenA, nil), 200).JSON(t)
	if v["state"] != "running" || !hasNote(notesOf(v), "resumed") || !hasNote(notesOf(v), "interpreter starts fresh") {
		t.Errorf("resumed: %v", v)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the state of a resumed session is still there: %v", err)
	}
	got := must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": "print(open('in/data.txt').read(), open('made.txt').read(), 'v' in globals())"}), 200).JSON(t)
	if got["stdout"] != "uploaded made False\n" {
		t.Errorf("after resume: %v", got)
	}

	// A run on a suspended session resumes it, and its result says so.
	must(t, call(t, "POST", base+"/suspend", tokenA, nil), 200)
	rr := must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": "print(open('made.txt').read())"}), 200)
	got = rr.JSON(t)
	if got["stdout"] != "made\n" || !hasNote(notesOf(got), "resumed") || rr.Header.Get("X-Moat-Resumed") != "true" {
		t.Errorf("a run on a suspended session: %v %v", got, rr.Header)
	}
	// So does a file operation.
	must(t, call(t, "POST", base+"/suspend", tokenA, nil), 200)
	fr := must(t, call(t, "GET", base+"/files/in/data.txt", tokenA, nil), 200)
	if string(fr.Body) != "uploaded" || fr.Header.Get("X-Moat-Resumed") != "true" {
		t.Errorf("a download from a suspended session: %q %v", fr.Body, fr.Header)
	}
	// Another token's session stays out of reach, suspended or not.
	must(t, call(t, "POST", base+"/suspend", tokenB, nil), 404)
	must(t, call(t, "POST", base+"/resume", tokenB, nil), 404)
	// DELETE of a suspended session removes its state.
	must(t, call(t, "POST", base+"/suspend", tokenA, nil), 200)
	must(t, call(t, "DELETE", base, tokenA, nil), 204)
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the state of a deleted session is still there: %v", err)
	}
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	var n int
	for _, c := range s {
		if c < '0' || c > '9' {
			t.Fatalf("not a number: %q", s)
		}
		n = n*10 + int(c-'0')
	}
	return n
}

// TestSuspendWaitsForTheRun: a suspend during a run waits for it and loses
// nothing; one that waits longer than queue_wait is 409 session_busy, and
// the run goes on.
func TestSuspendWaitsForTheRun(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(c *server.Config) { c.QueueWait = moat.Duration(time.Second) })
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, nil), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	for _, c := range []struct {
		sleep  string
		status int
	}{{"0.3", 200}, {"4", 409}} {
		var wg sync.WaitGroup
		var run response
		wg.Add(1)
		go func() {
			defer wg.Done()
			run = call(t, "POST", base+"/runs", tokenA, map[string]any{"code": "import time\ntime.sleep(" + c.sleep + ")\nopen('f', 'w').write('" + c.sleep + "')\nprint('done')"})
		}()
		eventually(t, 5*time.Second, "the run started", func() bool { return metric(t, ts, "moat_runs_in_progress") == 1 })
		r := call(t, "POST", base+"/suspend", tokenA, nil)
		wg.Wait()
		if r.Status != c.status || (c.status == 409 && r.ErrorCode(t) != "session_busy") {
			t.Errorf("suspend during a run of %ss: %d %s, want %d", c.sleep, r.Status, r.Body, c.status)
		}
		if run.Status != 200 || !strings.Contains(string(run.Body), "done") {
			t.Errorf("the run during the suspend: %d %s", run.Status, run.Body)
		}
		if f := must(t, call(t, "GET", base+"/files/f", tokenA, nil), 200); string(f.Body) != c.sleep {
			t.Errorf("the run's file: %q", f.Body)
		}
	}
}

// TestSuspendOnIdle: with on_idle suspend, the sweep suspends an idle
// session instead of ending it, and its next run finds its files.
func TestSuspendOnIdle(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(c *server.Config) { c.OnIdle = server.OnIdleSuspend })
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"idle_timeout": "300ms"}), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	must(t, call(t, "PUT", base+"/files/kept.txt", tokenA, []byte("kept")), 201)
	eventually(t, 10*time.Second, "the idle session is suspended", func() bool {
		return must(t, call(t, "GET", base, tokenA, nil), 200).JSON(t)["state"] == "suspended"
	})
	// The count follows the state by a moment.
	eventually(t, 5*time.Second, "one idle suspend counted", func() bool {
		return metric(t, ts, `moat_session_suspends_total{cause="idle",result="ok"}`) == 1
	})
	got := must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": "print(open('kept.txt').read())"}), 200).JSON(t)
	if got["stdout"] != "kept\n" {
		t.Errorf("after the idle suspend: %v", got)
	}
}

// serveOn serves cfg on loopback; stop shuts the server down gracefully.
func serveOn(t *testing.T, cfg server.Config) (url string, stop func()) {
	t.Helper()
	srv, err := server.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := srv.Shutdown(ctx); err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			if err := <-served; err != http.ErrServerClosed {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return "http://" + l.Addr().String(), stop
}

// TestSuspendAcrossRestart: with on_idle suspend, a graceful shutdown
// suspends the running sessions and a new server on the same state
// directory resumes them with their files, their time to live counting
// on; with on_idle end it ends the running ones and keeps the suspended.
func TestSuspendAcrossRestart(t *testing.T) {
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	// Registered first, run last: after every server has stopped.
	t.Cleanup(func() {
		sb.Close()
		if left := leftovers(); len(left) > 0 {
			t.Errorf("left behind: %v", left)
		}
	})
	state := t.TempDir()
	cfg := func(onIdle string) server.Config {
		return server.Config{
			Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelSubprocess: sb},
			Tokens:    []server.Token{{Name: "a", Token: tokenA}},
			StateDir:  state,
			OnIdle:    onIdle,
		}
	}
	url, stop := serveOn(t, cfg(server.OnIdleSuspend))
	created := must(t, call(t, "POST", url+"/v1/sessions", tokenA, map[string]any{"ttl": "1h"}), 201).JSON(t)
	id := created["id"].(string)
	must(t, call(t, "PUT", url+"/v1/sessions/"+id+"/files/a.txt", tokenA, []byte("before the restart")), 201)
	stop()

	url, stop = serveOn(t, cfg(server.OnIdleEnd))
	v := must(t, call(t, "GET", url+"/v1/sessions/"+id, tokenA, nil), 200).JSON(t)
	if v["state"] != "suspended" || v["expires_at"] != created["expires_at"] {
		t.Errorf("after the restart: %v, created %v", v, created)
	}
	got := must(t, call(t, "POST", url+"/v1/sessions/"+id+"/runs", tokenA, map[string]any{"code": "print(open('a.txt').read())"}), 200).JSON(t)
	if got["stdout"] != "before the restart\n" {
		t.Errorf("after the restart: %v", got)
	}
	// on_idle end: the running session is ended at shutdown, a
	// suspended one kept.
	kept := must(t, call(t, "POST", url+"/v1/sessions", tokenA, nil), 201).JSON(t)["id"].(string)
	must(t, call(t, "PUT", url+"/v1/sessions/"+kept+"/files/b.txt", tokenA, []byte("suspended")), 201)
	must(t, call(t, "POST", url+"/v1/sessions/"+kept+"/suspend", tokenA, nil), 200)
	stop()

	url, _ = serveOn(t, cfg(server.OnIdleEnd))
	must(t, call(t, "GET", url+"/v1/sessions/"+id, tokenA, nil), 404)
	if f := must(t, call(t, "GET", url+"/v1/sessions/"+kept+"/files/b.txt", tokenA, nil), 200); string(f.Body) != "suspended" {
		t.Errorf("the suspended session after the restart: %q", f.Body)
	}
}

// TestSuspendedSurvivesKill: after SIGKILL, the next server keeps a
// suspended session (resumable, with its files), removes the running one
// as before, and removes what a suspend cut short left.
func TestSuspendedSurvivesKill(t *testing.T) {
	requireRoot(t)
	state := t.TempDir()
	first := startChild(t, state)
	url := first.URL
	var ids []string
	for _, name := range []string{"suspended", "running"} {
		id := must(t, call(t, "POST", url+"/v1/sessions", tokenA, nil), 201).JSON(t)["id"].(string)
		must(t, call(t, "PUT", url+"/v1/sessions/"+id+"/files/f.txt", tokenA, []byte(name)), 201)
		ids = append(ids, id)
	}
	must(t, call(t, "POST", url+"/v1/sessions/"+ids[0]+"/suspend", tokenA, nil), 200)
	partial := filepath.Join(state, "suspended", "."+ids[1]+".partial-XYZ")
	if err := os.MkdirAll(filepath.Join(partial, "files"), 0o700); err != nil {
		t.Fatal(err)
	}
	first.cmd.Process.Signal(syscall.SIGKILL)
	<-first.done

	second := startChild(t, state)
	ts2 := &testServer{URL: second.URL}
	if v := must(t, call(t, "GET", second.URL+"/v1/sessions/"+ids[0], tokenA, nil), 200).JSON(t); v["state"] != "suspended" {
		t.Errorf("the suspended session after SIGKILL: %v", v)
	}
	must(t, call(t, "GET", second.URL+"/v1/sessions/"+ids[1], tokenA, nil), 404)
	if v := metric(t, ts2, "moat_sessions_recovered_total"); v != 1 {
		t.Errorf("recovered: %v, want 1 (the running session)", v)
	}
	if _, err := os.Stat(partial); !os.IsNotExist(err) {
		t.Errorf("the partial state is left: %v", err)
	}
	got := must(t, call(t, "POST", second.URL+"/v1/sessions/"+ids[0]+"/runs", tokenA, map[string]any{"code": "print(open('f.txt').read())"}), 200).JSON(t)
	if got["stdout"] != "suspended\n" {
		t.Errorf("the suspended session's run after SIGKILL: %v", got)
	}
}

// TestResumeDamagedIsBroken: a suspended state changed on disk is refused
// on resume; the session is then broken (409 session_broken, a clear
// reason, nothing started) until it is deleted.
func TestResumeDamagedIsBroken(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, nil), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	must(t, call(t, "PUT", base+"/files/data.txt", tokenA, []byte("original")), 201)
	must(t, call(t, "POST", base+"/suspend", tokenA, nil), 200)
	dir := filepath.Join(ts.cfg.StateDir, "suspended", id)
	if err := os.WriteFile(filepath.Join(dir, "files", "data.txt"), []byte("tampered"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ method, path string }{{"POST", "/runs"}, {"GET", "/files/data.txt"}, {"POST", "/resume"}} {
		var body any
		if c.path == "/runs" {
			body = map[string]any{"code": "print(open('data.txt').read())"}
		}
		r := call(t, c.method, base+c.path, tokenA, body)
		if r.Status != 409 || r.ErrorCode(t) != "session_broken" || !strings.Contains(string(r.Body), "data.txt") {
			t.Errorf("%s %s of a damaged session: %d %s", c.method, c.path, r.Status, r.Body)
		}
	}
	v := must(t, call(t, "GET", base, tokenA, nil), 200).JSON(t)
	if v["state"] != "broken" || !strings.Contains(v["broken"].(string), "not what was saved") {
		t.Errorf("a damaged session: %v", v)
	}
	if r := call(t, "POST", base+"/suspend", tokenA, nil); r.Status != 409 {
		t.Errorf("suspend of a broken session: %d %s", r.Status, r.Body)
	}
	if v := metric(t, ts, `moat_session_resumes_total{result="broken"}`); v != 1 {
		t.Errorf("broken resumes: %v, want 1", v)
	}
	must(t, call(t, "DELETE", base, tokenA, nil), 204)
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("a deleted broken session's state is left: %v", err)
	}
}

// TestSnapshotForks: a snapshot of a running session (which goes on) and
// one of a suspended session each start sessions with the files of the
// moment it was taken; forks of one snapshot do not see each other's
// writes, nor their parent's; the snapshots are the token's, listed,
// deleted, and held to its quota.
func TestSnapshotForks(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(c *server.Config) { c.MaxSnapshotBytesPerToken = 64 * moat.KiB })
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, nil), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	must(t, call(t, "PUT", base+"/files/f.txt", tokenA, []byte("at the snapshot")), 201)
	snap := must(t, call(t, "POST", base+"/snapshots", tokenA, map[string]any{"name": "one"}), 201).JSON(t)
	if snap["bytes"].(float64) <= 0 || snap["session"] != id {
		t.Errorf("snapshot: %v", snap)
	}
	if v := must(t, call(t, "GET", base, tokenA, nil), 200).JSON(t); v["state"] != "running" {
		t.Errorf("the session after its snapshot: %v", v)
	}
	must(t, call(t, "PUT", base+"/files/f.txt", tokenA, []byte("parent after")), 201)

	var forks []string
	for i := range 2 {
		r := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"from_snapshot": snap["id"]}), 201).JSON(t)
		if r["from_snapshot"] != snap["id"] || r["state"] != "running" {
			t.Errorf("fork %d: %v", i, r)
		}
		forks = append(forks, r["id"].(string))
	}
	must(t, call(t, "PUT", ts.URL+"/v1/sessions/"+forks[0]+"/files/f.txt", tokenA, []byte("fork 0 wrote")), 201)
	for i, want := range []string{"fork 0 wrote", "at the snapshot"} {
		if f := must(t, call(t, "GET", ts.URL+"/v1/sessions/"+forks[i]+"/files/f.txt", tokenA, nil), 200); string(f.Body) != want {
			t.Errorf("fork %d reads %q, want %q", i, f.Body, want)
		}
	}
	if f := must(t, call(t, "GET", base+"/files/f.txt", tokenA, nil), 200); string(f.Body) != "parent after" {
		t.Errorf("the parent reads %q", f.Body)
	}

	// A snapshot of a suspended session copies its state.
	must(t, call(t, "POST", base+"/suspend", tokenA, nil), 200)
	two := must(t, call(t, "POST", base+"/snapshots", tokenA, map[string]any{"name": "two"}), 201).JSON(t)
	fork := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"from_snapshot": two["id"]}), 201).JSON(t)["id"].(string)
	if f := must(t, call(t, "GET", ts.URL+"/v1/sessions/"+fork+"/files/f.txt", tokenA, nil), 200); string(f.Body) != "parent after" {
		t.Errorf("a fork of the suspended session reads %q", f.Body)
	}
	if v := must(t, call(t, "GET", base, tokenA, nil), 200).JSON(t); v["state"] != "suspended" {
		t.Errorf("a suspended session after its snapshot: %v", v)
	}

	// Another token sees none of it.
	if l := must(t, call(t, "GET", ts.URL+"/v1/snapshots", tokenB, nil), 200).JSON(t); len(l["snapshots"].([]any)) != 0 {
		t.Errorf("token b's snapshots: %v", l)
	}
	must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenB, map[string]any{"from_snapshot": snap["id"]}), 404)
	must(t, call(t, "DELETE", ts.URL+"/v1/snapshots/"+snap["id"].(string), tokenB, nil), 404)
	l := must(t, call(t, "GET", ts.URL+"/v1/snapshots", tokenA, nil), 200).JSON(t)
	if len(l["snapshots"].([]any)) != 2 || l["bytes"].(float64) != snap["bytes"].(float64)+two["bytes"].(float64) {
		t.Errorf("token a's snapshots: %v", l)
	}

	// The quota: a snapshot that would pass it is refused, and nothing of
	// it is left.
	big := make([]byte, 64*1024)
	must(t, call(t, "PUT", base+"/files/big.bin", tokenA, big), 201)
	if r := call(t, "POST", base+"/snapshots", tokenA, map[string]any{"name": "big"}); r.Status != 507 || r.ErrorCode(t) != "snapshot_quota" {
		t.Errorf("a snapshot over the quota: %d %s", r.Status, r.Body)
	}
	entries, _ := os.ReadDir(filepath.Join(ts.cfg.StateDir, "snapshots"))
	if len(entries) != 2 {
		t.Errorf("snapshot directories: %d, want 2", len(entries))
	}
	must(t, call(t, "DELETE", ts.URL+"/v1/snapshots/"+snap["id"].(string), tokenA, nil), 204)
	must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"from_snapshot": snap["id"]}), 404)
	if _, err := os.Stat(filepath.Join(ts.cfg.StateDir, "snapshots", snap["id"].(string))); !os.IsNotExist(err) {
		t.Errorf("a deleted snapshot's state: %v", err)
	}
}

// TestSuspendedExpires: a suspended session's time to live runs on; once
// past, the sweep ends it and removes its state.
func TestSuspendedExpires(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"ttl": "1s"}), 201).JSON(t)["id"].(string)
	must(t, call(t, "POST", ts.URL+"/v1/sessions/"+id+"/suspend", tokenA, nil), 200)
	dir := filepath.Join(ts.cfg.StateDir, "suspended", id)
	if _, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the expired suspended session is ended", func() bool {
		return call(t, "GET", ts.URL+"/v1/sessions/"+id, tokenA, nil).Status == 404
	})
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("an expired session's state is left: %v", err)
	}
}

// TestResumeRecordedRunning: a server that stopped after a suspend had
// put its state in place but before its record said so leaves a record
// that says running; the next server keeps it as suspended.
func TestResumeRecordedRunning(t *testing.T) {
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	state := t.TempDir()
	cfg := server.Config{
		Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelSubprocess: sb},
		Tokens:    []server.Token{{Name: "a", Token: tokenA}},
		StateDir:  state,
	}
	url, stop := serveOn(t, cfg)
	id := must(t, call(t, "POST", url+"/v1/sessions", tokenA, nil), 201).JSON(t)["id"].(string)
	must(t, call(t, "PUT", url+"/v1/sessions/"+id+"/files/f.txt", tokenA, []byte("saved")), 201)
	must(t, call(t, "POST", url+"/v1/sessions/"+id+"/suspend", tokenA, nil), 200)
	stop()
	db, err := bolt.Open(filepath.Join(state, "server.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("sessions"))
		var rec map[string]any
		if err := json.Unmarshal(b.Get([]byte(id)), &rec); err != nil {
			return err
		}
		rec["state"] = "running"
		delete(rec, "state_dir")
		data, _ := json.Marshal(rec)
		return b.Put([]byte(id), data)
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	url, _ = serveOn(t, cfg)
	if v := must(t, call(t, "GET", url+"/v1/sessions/"+id, tokenA, nil), 200).JSON(t); v["state"] != "suspended" {
		t.Errorf("after the restart: %v", v)
	}
	if f := must(t, call(t, "GET", url+"/v1/sessions/"+id+"/files/f.txt", tokenA, nil), 200); string(f.Body) != "saved" {
		t.Errorf("after the restart: %q", f.Body)
	}
}
