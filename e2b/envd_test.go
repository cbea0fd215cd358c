package e2b_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem/filesystemconnect"
	"github.com/moatsandbox/moat/e2b/internal/envd/process"
	"github.com/moatsandbox/moat/e2b/internal/envd/process/processconnect"
	"github.com/moatsandbox/moat/server"
)

// clients are a sandbox's Connect clients, speaking JSON as the SDKs do.
type clients struct {
	proc processconnect.ProcessClient
	fs   filesystemconnect.FilesystemClient
	http *http.Client
}

func (ts *testServer) clients(id, token string) clients {
	hc := sandboxClient(id, token)
	return clients{
		proc: processconnect.NewProcessClient(hc, ts.URL, connect.WithProtoJSON()),
		fs:   filesystemconnect.NewFilesystemClient(hc, ts.URL, connect.WithProtoJSON()),
		http: hc,
	}
}

// ran is what a command's stream said.
type ran struct {
	pid            uint32
	stdout, stderr string
	end            *process.ProcessEvent_EndEvent
}

// run starts cfg and reads its stream to the end.
func run(t testing.TB, c clients, cfg *process.ProcessConfig) (ran, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := c.proc.Start(ctx, connect.NewRequest(&process.StartRequest{Process: cfg}))
	if err != nil {
		return ran{}, err
	}
	defer stream.Close()
	var r ran
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().GetEvent().(type) {
		case *process.ProcessEvent_Start:
			r.pid = ev.Start.GetPid()
		case *process.ProcessEvent_Data:
			r.stdout += string(ev.Data.GetStdout())
			r.stderr += string(ev.Data.GetStderr())
		case *process.ProcessEvent_End:
			r.end = ev.End
		}
	}
	return r, stream.Err()
}

func bash(cmd string) *process.ProcessConfig {
	return &process.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmd}}
}

func TestCommands(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, map[string]any{"envVars": map[string]string{"FROM_CREATE": "yes", "BOTH": "create"}})
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)

	r, err := run(t, cl, bash("echo hi"))
	if err != nil || r.pid == 0 || r.stdout != "hi\n" || r.end == nil || r.end.ExitCode != 0 || !r.end.Exited {
		t.Fatalf("echo hi: %+v, %v", r, err)
	}
	r, err = run(t, cl, bash("echo out; echo err >&2; exit 3"))
	if err != nil || r.stdout != "out\n" || r.stderr != "err\n" || r.end.GetExitCode() != 3 || r.end.GetStatus() != "exit status 3" {
		t.Errorf("exit 3: %+v, %v", r, err)
	}
	// The sandbox's variables, the command's over them, HOME the
	// session's directory, the cwd mapped from /home/user.
	if _, err := run(t, cl, bash("mkdir -p sub/dir")); err != nil {
		t.Fatal(err)
	}
	cwd := "/home/user/sub"
	cfg := bash(`echo "$FROM_CREATE $BOTH $MINE"; pwd; [ "$HOME/sub" = "$PWD" ] && echo home-ok`)
	cfg.Envs, cfg.Cwd = map[string]string{"BOTH": "command", "MINE": "x y"}, &cwd
	r, err = run(t, cl, cfg)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if err != nil || len(lines) != 3 || lines[0] != "yes command x y" || !strings.HasSuffix(lines[1], "/sub") || lines[2] != "home-ok" {
		t.Errorf("envs and cwd: %q %q, %v", r.stdout, r.stderr, err)
	}
	// A relative cwd is relative to /home/user; one outside it is refused
	// before anything runs.
	rel := "sub/dir"
	cfg = bash("pwd")
	cfg.Cwd = &rel
	if r, err := run(t, cl, cfg); err != nil || !strings.HasSuffix(strings.TrimSpace(r.stdout), "/sub/dir") {
		t.Errorf("relative cwd: %q, %v", r.stdout, err)
	}
	for _, bad := range []string{"/etc", "/home/user/../../etc", "/home/userx", "/home/user/missing", "sub/dir/../../nope"} {
		cfg = bash("pwd")
		cfg.Cwd = &bad
		if _, err := run(t, cl, cfg); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("cwd %q: %v, want invalid_argument", bad, err)
		}
	}
	// The request's strings reach the command as data, never as Python.
	quote := `'''"""\n'); import os; os._exit(9) #`
	cfg = &process.ProcessConfig{Cmd: "/bin/echo", Args: []string{quote}, Envs: map[string]string{"Q": quote}}
	if r, err := run(t, cl, cfg); err != nil || r.stdout != quote+"\n" || r.end.GetExitCode() != 0 {
		t.Errorf("quotes: %q exit %d, %v", r.stdout, r.end.GetExitCode(), err)
	}
	// A missing program: 127, as a shell says.
	if r, err := run(t, cl, &process.ProcessConfig{Cmd: "/no/such/program"}); err != nil || r.end.GetExitCode() != 127 {
		t.Errorf("missing program: %+v, %v", r, err)
	}
	// Not mapped: a pty, refused before anything runs.
	ctx := context.Background()
	for name, req := range map[string]*process.StartRequest{
		"pty": {Process: bash("true"), Pty: &process.PTY{}},
	} {
		s, err := cl.proc.Start(ctx, connect.NewRequest(req))
		if err == nil {
			for s.Receive() {
			}
			err = s.Err()
			s.Close()
		}
		if connect.CodeOf(err) != connect.CodeUnimplemented {
			t.Errorf("%s: %v, want unimplemented", name, err)
		}
	}
}

// A command killed with SendSignal ends with exited false and its stream
// closes; List shows it while it runs.
func TestKillAndList(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, nil)
	c := ts.create(t, keyA, nil)
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := cl.proc.Start(ctx, connect.NewRequest(&process.StartRequest{Process: bash("echo started; sleep 50"), Tag: new("sleeper")}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() {
		t.Fatalf("no start event: %v", stream.Err())
	}
	pid := stream.Msg().GetEvent().GetStart().GetPid()
	if !stream.Receive() || string(stream.Msg().GetEvent().GetData().GetStdout()) != "started\n" {
		t.Fatalf("no output: %v", stream.Err())
	}
	list, err := cl.proc.List(ctx, connect.NewRequest(&process.ListRequest{}))
	if err != nil || len(list.Msg.Processes) != 1 || list.Msg.Processes[0].GetPid() != pid || list.Msg.Processes[0].GetTag() != "sleeper" {
		t.Fatalf("list: %v, %v", list, err)
	}
	if _, err := cl.proc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}})); err != nil {
		t.Errorf("close stdin: %v", err)
	}
	start := time.Now()
	if _, err := cl.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
		Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Tag{Tag: "sleeper"}}, Signal: process.Signal_SIGNAL_SIGKILL,
	})); err != nil {
		t.Fatal(err)
	}
	var end *process.ProcessEvent_EndEvent
	for stream.Receive() {
		if e := stream.Msg().GetEvent().GetEnd(); e != nil {
			end = e
		}
	}
	if end == nil || end.Exited || end.ExitCode != -1 || end.Status != "signal: killed" {
		t.Errorf("end of a killed command: %+v, %v", end, stream.Err())
	}
	if d := time.Since(start); d > 25*time.Second {
		t.Errorf("the kill took %v", d)
	}
	list, _ = cl.proc.List(ctx, connect.NewRequest(&process.ListRequest{}))
	if len(list.Msg.GetProcesses()) != 0 {
		t.Errorf("list after the kill: %v", list.Msg.Processes)
	}
	_, err = cl.proc.SendSignal(ctx, connect.NewRequest(&process.SendSignalRequest{
		Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}, Signal: process.Signal_SIGNAL_SIGKILL,
	}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("kill of an ended command: %v, want not_found (the SDK's kill() false)", err)
	}
	// The session is usable after it.
	if r, err := run(t, cl, bash("echo after")); err != nil || r.stdout != "after\n" {
		t.Errorf("after the kill: %+v, %v", r, err)
	}
}

// The access token of one sandbox opens no other, and a sandbox side
// request without one is refused; either way nothing runs.
func TestAccessToken(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	a := ts.create(t, keyA, nil)
	other := ts.create(t, keyA, nil)
	b := ts.create(t, keyB, nil)
	for name, tok := range map[string]string{"none": "", "wrong": "ea_0000", "another sandbox's": other.EnvdAccessToken, "another key's": b.EnvdAccessToken, "the api key": keyA} {
		cl := ts.clients(a.SandboxID, tok)
		if _, err := run(t, cl, bash("echo pwned > /home/user/pwned")); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("%s token: start: %v, want unauthenticated", name, err)
		}
		if _, err := cl.fs.Stat(context.Background(), connect.NewRequest(&filesystem.StatRequest{Path: "/home/user"})); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("%s token: stat: %v, want unauthenticated", name, err)
		}
		resp, err := cl.http.Post(ts.URL+"/files?path=pwned", "application/octet-stream", strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		if body := readAll(t, resp); resp.StatusCode != 401 {
			t.Errorf("%s token: write: %d %s, want 401", name, resp.StatusCode, body)
		}
		resp, _ = cl.http.Get(ts.URL + "/health")
		if readAll(t, resp); resp.StatusCode != 204 {
			t.Errorf("%s token: health: %d, want 204 (envd's health needs no token)", name, resp.StatusCode)
		}
	}
	cl := ts.clients(a.SandboxID, a.EnvdAccessToken)
	if _, err := cl.fs.Stat(context.Background(), connect.NewRequest(&filesystem.StatRequest{Path: "pwned"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a refused write left a file: %v", err)
	}
	// An unknown sandbox is 502, as E2B's proxy answers; a Connect client
	// sees unavailable (the SDK's "sandbox is probably not running").
	unknown := ts.clients("s_000000000000000000000000", a.EnvdAccessToken)
	if _, err := run(t, unknown, bash("true")); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Errorf("unknown sandbox: %v, want unavailable", err)
	}
	// The code interpreter's port needs the token too; its contexts are
	// not served yet, said plainly.
	for _, tc := range []struct {
		token, path string
		status      int
	}{{"", "/execute", 401}, {other.EnvdAccessToken, "/execute", 401}, {other.EnvdAccessToken, "/contexts", 401}} {
		req, _ := http.NewRequest("POST", ts.URL+tc.path, strings.NewReader(`{"code":"1"}`))
		req.Header.Set("E2b-Sandbox-Id", a.SandboxID)
		req.Header.Set("E2b-Sandbox-Port", "49999")
		if tc.token != "" {
			req.Header.Set("X-Access-Token", tc.token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if body := readAll(t, resp); resp.StatusCode != tc.status || !strings.Contains(body, "e2b: ") {
			t.Errorf("port 49999 %s: %d %s, want %d", tc.path, resp.StatusCode, body, tc.status)
		}
	}
}

func TestFilesystem(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx := context.Background()

	mk, err := cl.fs.MakeDir(ctx, connect.NewRequest(&filesystem.MakeDirRequest{Path: "/home/user/a/b"}))
	if err != nil || mk.Msg.GetEntry().GetPath() != "/home/user/a/b" || mk.Msg.GetEntry().GetType() != filesystem.FileType_FILE_TYPE_DIRECTORY {
		t.Fatalf("mkdir: %v, %v", mk, err)
	}
	if _, err := cl.fs.MakeDir(ctx, connect.NewRequest(&filesystem.MakeDirRequest{Path: "a/b"})); connect.CodeOf(err) != connect.CodeAlreadyExists {
		t.Errorf("mkdir of an existing dir: %v, want already_exists (the SDK's makeDir false)", err)
	}
	// Octet-stream and multipart uploads, as the SDKs send them.
	resp, err := cl.http.Post(ts.URL+"/files?path=/home/user/a/one.txt", "application/octet-stream", strings.NewReader("one"))
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 200 || !strings.Contains(body, `"path":"/home/user/a/one.txt"`) {
		t.Errorf("octet-stream write: %d %s", resp.StatusCode, body)
	}
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	for _, f := range []struct{ name, data string }{{"a/b/two.txt", "two"}, {"/home/user/three.txt", "three"}} {
		w, _ := mw.CreateFormFile("file", f.name)
		io.WriteString(w, f.data)
	}
	mw.Close()
	resp, err = cl.http.Post(ts.URL+"/files", mw.FormDataContentType(), &mp)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 200 || !strings.Contains(body, "/home/user/a/b/two.txt") || !strings.Contains(body, "/home/user/three.txt") {
		t.Errorf("multipart write: %d %s", resp.StatusCode, body)
	}
	// What the files API wrote, a command sees, and the other way round.
	r, err := run(t, cl, bash("cat a/one.txt a/b/two.txt three.txt; echo four > a/four.txt"))
	if err != nil || r.stdout != "onetwothree" {
		t.Errorf("cat: %q, %v", r.stdout, err)
	}
	resp, _ = cl.http.Get(ts.URL + "/files?path=/home/user/a/four.txt")
	if body := readAll(t, resp); resp.StatusCode != 200 || body != "four" {
		t.Errorf("read: %d %q", resp.StatusCode, body)
	}
	st, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "a/one.txt"}))
	if err != nil || st.Msg.Entry.GetSize() != 3 || st.Msg.Entry.GetName() != "one.txt" || st.Msg.Entry.GetType() != filesystem.FileType_FILE_TYPE_FILE {
		t.Errorf("stat: %v, %v", st, err)
	}
	ls, err := cl.fs.ListDir(ctx, connect.NewRequest(&filesystem.ListDirRequest{Path: "/home/user/a", Depth: 1}))
	var names []string
	for _, e := range ls.Msg.GetEntries() {
		names = append(names, e.GetPath())
	}
	if err != nil || strings.Join(names, " ") != "/home/user/a/b /home/user/a/four.txt /home/user/a/one.txt" {
		t.Errorf("list depth 1: %v, %v", names, err)
	}
	ls, _ = cl.fs.ListDir(ctx, connect.NewRequest(&filesystem.ListDirRequest{Path: "/home/user", Depth: 3}))
	if n := len(ls.Msg.GetEntries()); n != 6 {
		t.Errorf("list depth 3 of home: %d entries, want 6", n)
	}
	mv, err := cl.fs.Move(ctx, connect.NewRequest(&filesystem.MoveRequest{Source: "a/one.txt", Destination: "/home/user/moved.txt"}))
	if err != nil || mv.Msg.Entry.GetPath() != "/home/user/moved.txt" {
		t.Errorf("move: %v, %v", mv, err)
	}
	if _, err := cl.fs.Remove(ctx, connect.NewRequest(&filesystem.RemoveRequest{Path: "/home/user/a"})); err != nil {
		t.Errorf("remove of a full directory: %v", err)
	}
	if _, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "a"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("stat after remove: %v, want not_found", err)
	}
	// Outside /home/user: refused, on every operation.
	for _, p := range []string{"/etc/passwd", "/home/user/../../etc/passwd", "/tmp", "/"} {
		if _, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: p})); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("stat %s: %v, want invalid_argument", p, err)
		}
		resp, _ := cl.http.Get(ts.URL + "/files?path=" + p)
		if readAll(t, resp); resp.StatusCode != 400 {
			t.Errorf("read %s: %d, want 400", p, resp.StatusCode)
		}
	}
	resp, _ = cl.http.Get(ts.URL + "/files?path=nope.txt")
	if body := readAll(t, resp); resp.StatusCode != 404 || !strings.Contains(body, `"code":404`) {
		t.Errorf("read of a missing file: %d %s, want 404", resp.StatusCode, body)
	}
	// A file over the cap is refused whole: 413 and no file.
	big := strings.Repeat("x", 64<<10+1)
	resp, _ = cl.http.Post(ts.URL+"/files?path=big.txt", "application/octet-stream", strings.NewReader(big))
	if readAll(t, resp); resp.StatusCode != 413 {
		t.Errorf("a file over the cap: %d, want 413", resp.StatusCode)
	}
	if _, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "big.txt"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a refused upload left a file: %v", err)
	}
	resp, _ = cl.http.Post(ts.URL+"/files?path=full.txt", "application/octet-stream", strings.NewReader(big[:64<<10]))
	if readAll(t, resp); resp.StatusCode != 200 {
		t.Errorf("a file at the cap: %d, want 200", resp.StatusCode)
	}
}

// Malformed requests get Connect's errors, and the server goes on.
func TestMalformedFrames(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	hc := sandboxClient(c.SandboxID, c.EnvdAccessToken)
	for _, tc := range []struct {
		name, path, ctype string
		body              []byte
	}{
		{"bad json, unary", "/filesystem.Filesystem/Stat", "application/json", []byte(`{"path":`)},
		{"unknown field type, unary", "/filesystem.Filesystem/Stat", "application/json", []byte(`{"path":7}`)},
		{"short envelope", "/process.Process/Start", "application/connect+json", []byte{0, 0, 0}},
		{"envelope longer than its body", "/process.Process/Start", "application/connect+json", []byte{0, 0, 0, 0, 100, '{', '}'}},
		{"envelope over the read limit", "/process.Process/Start", "application/connect+json", append([]byte{0, 0x7f, 0xff, 0xff, 0xff}, '{')},
		{"garbage in an envelope", "/process.Process/Start", "application/connect+json", append([]byte{0, 0, 0, 0, 4}, "nope"...)},
	} {
		resp, err := hc.Post(ts.URL+tc.path, tc.ctype, bytes.NewReader(tc.body))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		body := readAll(t, resp)
		// Unary errors are a status; a stream's is in its end frame, on 200.
		if resp.StatusCode/100 == 5 || (resp.StatusCode == 200 && !strings.Contains(body, `"error"`)) {
			t.Errorf("%s: %d %q", tc.name, resp.StatusCode, body)
		}
	}
	if r, err := run(t, ts.clients(c.SandboxID, c.EnvdAccessToken), bash("echo still")); err != nil || r.stdout != "still\n" {
		t.Errorf("after malformed frames: %+v, %v", r, err)
	}
}

func TestMapPath(t *testing.T) {
	for in, want := range map[string]string{
		"": ".", "/home/user": ".", "/home/user/": ".", "a.txt": "a.txt", "/home/user/a/b.txt": "a/b.txt",
		"./a": "a", "/home/user/a/../b": "b", "/home/user//x": "x",
	} {
		if got, err := e2b.MapPath(in); err != nil || got != want {
			t.Errorf("MapPath(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"/", "/etc/passwd", "/home/userx", "/home", "../x", "/home/user/../../etc", "/root"} {
		if got, err := e2b.MapPath(in); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("MapPath(%q) = %q, %v; want ErrInvalid", in, got, err)
		}
	}
}

// A client that stops reading a command's output is dropped after the
// write timeout, and the command ends with it, long before the wall time:
// it holds no run slot and no session for ever.
func TestSlowClientEndsCommand(t *testing.T) {
	wall := 60 * time.Second
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(wall), Output: 256 * moat.MiB}, func(_ *server.Config, c *e2b.Config) {
		c.WriteTimeout = moat.Duration(300 * time.Millisecond)
	})
	c := ts.create(t, keyA, nil)
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	conn, err := net.Dial("tcp", strings.TrimPrefix(ts.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.(*net.TCPConn).SetReadBuffer(4096)
	msg := []byte(`{"process":{"cmd":"/bin/bash","args":["-c","yes aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]}}`)
	body := append([]byte{0, 0, 0, 0, byte(len(msg))}, msg...)
	fmt.Fprintf(conn, "POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n"+
		"E2b-Sandbox-Id: %s\r\nE2b-Sandbox-Port: 49983\r\nX-Access-Token: %s\r\nContent-Length: %d\r\n\r\n", c.SandboxID, c.EnvdAccessToken, len(body))
	conn.Write(body)
	// It starts, then its client reads nothing more.
	ctx := context.Background()
	deadline := time.Now().Add(wall / 2)
	started := false
	for {
		list, err := cl.proc.List(ctx, connect.NewRequest(&process.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		n := len(list.Msg.GetProcesses())
		if n > 0 {
			started = true
		}
		if started && n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a command whose client stopped reading still runs after half its wall time (started %v)", started)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if r, err := run(t, cl, bash("echo next")); err != nil || r.stdout != "next\n" {
		t.Errorf("the next command: %+v, %v", r, err)
	}
}
