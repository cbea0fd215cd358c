package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/version"
	"github.com/moatsandbox/moat/mcpserver"
)

func init() {
	commandUsage["mcp"] = "moat mcp [flags] [--sessions [--interpreter]] [--http ADDR]"
}

// addToolFlags registers --sessions and --interpreter on fs, setting sec;
// per says what one session lasts for.
func addToolFlags(fs *flag.FlagSet, sec *toolSection, per string) {
	fs.BoolVar(&sec.Sessions, "sessions", false, "run the tools in one sandbox session per "+per+": files persist between calls, and write_file, read_file and list_files are offered")
	fs.BoolVar(&sec.Interpreter, "interpreter", false, "with --sessions, keep a live Python interpreter in the session: variables persist between calls too")
}

// cmdMCP serves the tools over MCP: over stdio (the default, for a client
// that starts moat), or streamable HTTP on a loopback address.
func cmdMCP(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("mcp")
	sf := addSandboxFlags(fs)
	addr := fs.String("http", "", "serve streamable HTTP on ADDR, a loopback address such as "+mcpserver.DefaultAddr+", instead of stdio")
	var maxCode, maxOutput moat.Bytes
	fs.Var(&maxCode, "max-code", "largest program the tool accepts (default 1MiB)")
	fs.Var(&maxOutput, "tool-output", "how much of each output stream a tool result shows (default 8KiB)")
	addToolFlags(fs, &sf.flags.MCP, "connection")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	if fs.NArg() > 0 {
		return exitFor(stdio, fmt.Errorf("mcp: unexpected argument %q (the tool's code comes from the client): %w", fs.Arg(0), moat.ErrInvalid))
	}
	httpMode := false
	fs.Visit(func(f *flag.Flag) { httpMode = httpMode || f.Name == "http" })

	fc, err := sf.resolve()
	if err != nil {
		return exitFor(stdio, err)
	}
	// Logs go to stderr: over stdio, stdout is the protocol's.
	cfg := mcpserver.Config{MaxCode: int(maxCode), MaxOutput: int(maxOutput), Sessions: fc.MCP.Sessions, Interpreter: fc.MCP.Interpreter,
		Version: version.String(), Logger: slog.New(slog.NewTextHandler(stdio.Err, nil))}
	if !httpMode {
		// Over stdio the one client is the agent that started moat: its
		// calls are one tenant's. Over HTTP clients may be anyone's.
		cfg.Tenant = "mcp-stdio"
	}
	if err := cfg.Validate(); err != nil {
		return exitFor(stdio, err)
	}
	// Listen first: a refused address needs no sandbox.
	var ln net.Listener
	if httpMode {
		var err error
		if ln, err = mcpserver.Listen(*addr); err != nil {
			return exitFor(stdio, err)
		}
		defer ln.Close()
	}
	warnHardening(stdio, fc, fc.Level)
	sb, err := openLevel(ctx, fc, fc.Level)
	if err != nil {
		return exitFor(stdio, err)
	}
	defer sb.Close()
	srv, err := mcpserver.New(sb, cfg)
	if err != nil {
		return exitFor(stdio, err)
	}
	defer srv.Close() // before the sandbox: the sessions it holds
	if httpMode {
		what := "run_python"
		if cfg.Sessions {
			what = "run_python and the file tools, one session per connection,"
		}
		fmt.Fprintf(stdio.Err, "moat: mcp: serving %s (level %s) over streamable HTTP at http://%s/\n", what, sb.Level(), ln.Addr())
		err = srv.Serve(ctx, ln)
	} else {
		err = srv.Run(ctx, srv.Stdio(stdio.In, stdio.Out))
	}
	if err != nil {
		return exitFor(stdio, err)
	}
	return exitOK
}
