package e2b_test

import (
	"context"
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
