package e2b_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/moatsandbox/moat"
)

// The cost of E2B's calls over a session's own run, at the subprocess
// level: go test -run XXX -bench . -benchtime 50x ./e2b

// BenchmarkSessionRun is the floor: a run of print(1) in a session,
// through the server's seam, no HTTP.
func BenchmarkSessionRun(b *testing.B) {
	ts := startServer(b, moat.Limits{}, nil)
	c := ts.create(b, keyA, nil)
	for b.Loop() {
		res, err := ts.srv.RunSession(context.Background(), "a", c.SandboxID, moat.Request{Code: []byte("print(1)")})
		if err != nil || res.ExitCode != 0 {
			b.Fatal(res, err)
		}
	}
}

// BenchmarkCommandRun is commands.run('true') over Connect-RPC: the
// launcher, then bash.
func BenchmarkCommandRun(b *testing.B) {
	ts := startServer(b, moat.Limits{}, nil)
	c := ts.create(b, keyA, nil)
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	for b.Loop() {
		r, err := run(b, cl, bash("true"))
		if err != nil || r.end.GetExitCode() != 0 {
			b.Fatal(r, err)
		}
	}
}

// BenchmarkExecute is runCode('1 + 1') in a live interpreter.
func BenchmarkExecute(b *testing.B) {
	ts := startServer(b, moat.Limits{}, nil)
	c := ts.create(b, keyA, map[string]any{"templateID": "code-interpreter-v1"})
	for b.Loop() {
		_, objs := execute(b, ts, c, map[string]any{"code": "1 + 1"})
		if r, _ := of(objs, "result"); len(r) != 1 {
			b.Fatal(objs)
		}
	}
}

// BenchmarkExecuteInContext is runCode('1 + 1') in a context of the live
// interpreter (with 8 contexts in the sandbox): against BenchmarkExecute,
// what a context costs a cell.
func BenchmarkExecuteInContext(b *testing.B) {
	ts := startServer(b, moat.Limits{}, nil)
	c := ts.create(b, keyA, map[string]any{"templateID": "code-interpreter-v1"})
	var id string
	for range 8 {
		st, body := interp(b, ts, c, "POST", "/contexts", `{}`, map[string]string{"X-Access-Token": c.EnvdAccessToken})
		var ctx map[string]string
		if json.Unmarshal([]byte(body), &ctx); st != 200 {
			b.Fatal(st, body)
		}
		id = ctx["id"]
	}
	for b.Loop() {
		_, objs := execute(b, ts, c, map[string]any{"code": "1 + 1", "context_id": id})
		if r, _ := of(objs, "result"); len(r) != 1 {
			b.Fatal(objs)
		}
	}
}

// BenchmarkCreateContext is createCodeContext: a record written to the
// server's database, no process.
func BenchmarkCreateContext(b *testing.B) {
	ts := startServer(b, moat.Limits{}, nil)
	c := ts.create(b, keyA, map[string]any{"templateID": "code-interpreter-v1"})
	tok := map[string]string{"X-Access-Token": c.EnvdAccessToken}
	for b.Loop() {
		st, body := interp(b, ts, c, "POST", "/contexts", `{}`, tok)
		if st != 200 {
			b.Fatal(st, body)
		}
		var ctx map[string]string
		json.Unmarshal([]byte(body), &ctx)
		if st, _ := interp(b, ts, c, "DELETE", "/contexts/"+ctx["id"], "", tok); st != 204 {
			b.Fatal(st)
		}
	}
}

// BenchmarkWatchPoll is the listing that a watch takes at each poll (every
// 0.5 s at most), of a sandbox with 1000 files.
func BenchmarkWatchPoll(b *testing.B) {
	ts := startServer(b, moat.Limits{}, nil)
	c := ts.create(b, keyA, nil)
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	if _, err := run(b, cl, bash("mkdir -p d && for i in $(seq 1000); do echo $i > d/$i.txt; done")); err != nil {
		b.Fatal(err)
	}
	sess, done, err := ts.srv.UseSession(context.Background(), "a", c.SandboxID)
	if err != nil {
		b.Fatal(err)
	}
	defer done()
	for b.Loop() {
		files, err := sess.ListFiles(context.Background())
		if err != nil || len(files) < 1000 {
			b.Fatal(len(files), err)
		}
	}
}
