package mcpserver

import (
	"context"
	"os"
	"testing"

	"github.com/moatsandbox/moat/mcpserver/mcptest"
)

// TestTypeScriptClient drives the server with the official TypeScript SDK's
// client (see package mcptest), a client moat did not write.
//
// Over stdio the client spawns this test binary, which TestMain turns into
// the server `moat mcp` runs (the same Server over stdin and stdout, on the
// real subprocess level); cmd/moat's tests spawn `moat mcp` itself. Over
// HTTP the client connects to a server started here.
func TestTypeScriptClient(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Run("stdio", func(t *testing.T) {
		mcptest.Run(t, []string{envServe + "=stdio"}, "--", self)
	})
	t.Run("http", func(t *testing.T) {
		s := newServer(t, Config{})
		ln, err := Listen("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		served := make(chan error, 1)
		go func() { served <- s.Serve(ctx, ln) }()
		defer func() {
			cancel()
			if err := <-served; err != nil {
				t.Errorf("Serve: %v", err)
			}
		}()
		mcptest.Run(t, nil, "--url", "http://"+ln.Addr().String()+"/")
	})
}
