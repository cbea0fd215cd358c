package server_test

import (
	"context"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
)

// tenantEcho is a level whose runs print the tenant they were run for.
type tenantEcho struct{}

func (tenantEcho) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	return &moat.Result{Level: moat.LevelGVisor, Stdout: []byte("tenant=" + req.Tenant)}, nil
}
func (tenantEcho) Level() moat.Level { return moat.LevelGVisor }
func (tenantEcho) Close() error      { return nil }

// TestRunTenantIsTheToken checks that every one-shot run carries its
// token as the tenant, so that a level recycling instances never hands one
// token's instance to another's run. No root: the level is a fake.
func TestRunTenantIsTheToken(t *testing.T) {
	srv, err := server.New(server.Config{
		Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelGVisor: tenantEcho{}},
		Tokens:    []server.Token{{Name: "a", Token: tokenA}, {Name: "b", Token: tokenB}},
		StateDir:  t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	url := serveHandler(t, srv.Handler())
	for tok, want := range map[string]string{tokenA: "tenant=a", tokenB: "tenant=b"} {
		r := must(t, call(t, "POST", url+"/v1/runs", tok, map[string]any{"code": "print(1)"}), 200)
		if got := r.JSON(t)["stdout"]; got != want {
			t.Errorf("run's stdout %q, want %q", got, want)
		}
	}
}
