package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/moatsandbox/moat/internal/version"
	"github.com/moatsandbox/moat/mcpserver/mcptest"
)

// envMain makes the test binary stand in for the moat binary, so that a
// client can spawn `moat mcp` (the binary's name aside) as a process.
const envMain = "MOAT_CMD_TEST_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(envMain) == "1" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := testMainCommand(ctx, os.Args[1:], Stdio{In: os.Stdin, Out: os.Stdout, Err: os.Stderr})
		stop()
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// testMainCommand runs a command as main does.
func testMainCommand(ctx context.Context, args []string, stdio Stdio) int {
	if len(args) > 0 && args[0] == "mcp" {
		return cmdMCP(ctx, args[1:], stdio)
	}
	return dispatch(ctx, args, stdio)
}

// The official TypeScript client spawns `moat mcp` and talks to it over
// stdio.
func TestMCPTypeScriptClient(t *testing.T) {
	requireRoot(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	mcptest.Run(t, []string{envMain + "=1"}, "--", self, "mcp", "--wall-time", "5s")
}

func goClient(t *testing.T, tr mcp.Transport) *mcp.ClientSession {
	t.Helper()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "moat-cmd-test", Version: "v0"}, nil).Connect(context.Background(), tr, nil)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	return cs
}

func sixTimesSeven(t *testing.T, cs *mcp.ClientSession) {
	t.Helper()
	res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "run_python", Arguments: map[string]any{"code": "print(6*7)"}})
	if err != nil {
		t.Fatal(err)
	}
	if text := res.Content[0].(*mcp.TextContent).Text; res.IsError || !strings.Contains(text, "stdout:\n42\n") {
		t.Errorf("print(6*7): %q (isError %v)", text, res.IsError)
	}
	tools, err := cs.ListTools(context.Background(), nil)
	if err != nil || len(tools.Tools) != 1 || tools.Tools[0].Name != "run_python" {
		t.Errorf("tools %+v, %v", tools, err)
	}
}

func TestMCPStdio(t *testing.T) {
	requireRoot(t)
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	var stderr bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- cmdMCP(context.Background(), []string{"--wall-time", "5s"}, Stdio{In: inR, Out: outW, Err: &stderr})
		outW.Close()
	}()
	cs := goClient(t, &mcp.IOTransport{Reader: outR, Writer: inW})
	if info := cs.InitializeResult().ServerInfo; info.Version != version.String() {
		t.Errorf("server info %+v: want version %q", info, version.String())
	}
	sixTimesSeven(t, cs)
	cs.Close()
	inW.Close()
	select {
	case code := <-done:
		if code != exitOK {
			t.Errorf("exit %d after the client hung up; stderr %q", code, stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("moat mcp did not return after the client hung up")
	}
}

func TestMCPHTTP(t *testing.T) {
	requireRoot(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errR, errW := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- cmdMCP(ctx, []string{"--http", "127.0.0.1:0", "--wall-time", "5s"}, Stdio{In: strings.NewReader(""), Out: io.Discard, Err: errW})
		errW.Close()
	}()
	// The command says where it listens.
	lines := bufio.NewScanner(errR)
	var url string
	re := regexp.MustCompile(`at (http://127\.0\.0\.1:\d+/)`)
	for url == "" && lines.Scan() {
		if m := re.FindStringSubmatch(lines.Text()); m != nil {
			url = m[1]
		}
	}
	if url == "" {
		t.Fatal("moat mcp --http did not say where it listens")
	}
	go io.Copy(io.Discard, errR)

	cs := goClient(t, &mcp.StreamableClientTransport{Endpoint: url})
	sixTimesSeven(t, cs)
	cs.Close()
	cancel()
	select {
	case code := <-done:
		if code != exitOK {
			t.Errorf("exit %d after cancel", code)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("moat mcp --http did not return after its context was cancelled")
	}
}

func TestMCPBadInput(t *testing.T) {
	for _, args := range [][]string{{"--http", "0.0.0.0:8765"}, {"--http", ":8765"}, {"extra"}, {"--max-code", "x"}, {"--no-such-flag"}, {"--interpreter"}} {
		var stderr bytes.Buffer
		code := cmdMCP(context.Background(), args, Stdio{In: strings.NewReader(""), Out: io.Discard, Err: &stderr})
		if code != exitUsage || strings.Count(strings.TrimSpace(stderr.String()), "\n") > 0 || stderr.Len() == 0 {
			t.Errorf("moat mcp %q: exit %d stderr %q, want %d and one line", args, code, stderr.String(), exitUsage)
		}
	}
}

// moat mcp --sessions, or the mcp section of the config file: the file
// tools, and files (with --interpreter variables) kept between calls.
func TestMCPStdioSessions(t *testing.T) {
	requireRoot(t)
	for _, c := range []struct {
		args   []string
		interp bool
	}{
		{[]string{"--sessions"}, false},
		{[]string{"--config", writeConfig(t, `{"mcp":{"sessions":true,"interpreter":true},"agent":{"sessions":false}}`)}, true},
	} {
		inR, inW := io.Pipe()
		outR, outW := io.Pipe()
		var stderr bytes.Buffer
		done := make(chan int, 1)
		go func() {
			done <- cmdMCP(context.Background(), append(c.args, "--wall-time", "5s"), Stdio{In: inR, Out: outW, Err: &stderr})
			outW.Close()
		}()
		cs := goClient(t, &mcp.IOTransport{Reader: outR, Writer: inW})
		tools, err := cs.ListTools(context.Background(), nil)
		if err != nil || len(tools.Tools) != 4 {
			t.Fatalf("%q: tools %+v, %v; want run_python and the three file tools", c.args, tools, err)
		}
		call := func(name string, args map[string]any) string {
			t.Helper()
			res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: name, Arguments: args})
			if err != nil {
				t.Fatal(err)
			}
			text := res.Content[0].(*mcp.TextContent).Text
			if res.IsError {
				t.Fatalf("%q: %s: tool error %q", c.args, name, text)
			}
			return text
		}
		call("write_file", map[string]any{"path": "n.txt", "content": "41"})
		call("run_python", map[string]any{"code": "n = int(open('n.txt').read())"})
		text := call("run_python", map[string]any{"code": "try:\n    print(n + 1)\nexcept NameError:\n    print('no n')"})
		if want := map[bool]string{false: "stdout:\nno n\n", true: "stdout:\n42\n"}[c.interp]; !strings.Contains(text, want) {
			t.Errorf("%q: %q, want %q", c.args, text, want)
		}
		cs.Close()
		inW.Close()
		select {
		case code := <-done:
			if code != exitOK {
				t.Errorf("%q: exit %d after the client hung up; stderr %q", c.args, code, stderr.String())
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("%q: moat mcp did not return after the client hung up", c.args)
		}
	}
}
