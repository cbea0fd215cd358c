package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/moatsandbox/moat"
)

// moat session: the sessions of a running moat serve, from the shell.
//
// It is a client of the HTTP API and nothing more: every decision (limits,
// levels, profiles, quotas) is the server's. The token is read from
// MOAT_TOKEN or --token-file, never from a flag's value, which other users
// of the machine could read in the process list.

func init() {
	commandUsage["session"] = `moat session [--url URL] [--token-file FILE] [--json] COMMAND [ARGS]

Commands (the API of a running 'moat serve'; URL from --url or MOAT_URL,
default http://` + defaultAddr + `; the token from MOAT_TOKEN or --token-file):
  create [--level L] [--interpreter] [--ttl D] [--idle-timeout D] [--network NAME] [--from-snapshot ID]
                         start a session and print its id
  list                   the token's sessions
  show ID                one session: state, level, memory, expiry
  run ID (-c CODE | FILE | -)
                         run code in the session; exits with the code's status
  put ID LOCAL [PATH]    copy a local file into the session (PATH defaults to LOCAL's name)
  get ID PATH            print a file of the session
  ls ID                  the session's files
  suspend ID             save the session to disk; nothing of it stays running
  resume ID              bring a suspended session back (any run or file operation also does)
  snapshot ID NAME       take a named snapshot; 'create --from-snapshot' forks it
  snapshots              the token's snapshots
  delete-snapshot ID     remove a snapshot
  end ID                 end the session and remove everything of it`
	commandUsage["session create"] = "moat session create [--level L] [--interpreter] [--ttl D] [--idle-timeout D] [--network NAME] [--from-snapshot ID]"
	commandUsage["session run"] = "moat session run ID (-c CODE | FILE | -)"
}

// apiClient calls one moat serve with one token.
type apiClient struct {
	base  string
	token string
	http  *http.Client
}

// apiError is an answer of the server other than a success.
type apiError struct {
	status  int
	code    string
	message string
}

func (e *apiError) Error() string {
	return fmt.Sprintf("session: server answered %d %s: %s", e.status, e.code, e.message)
}

// exit maps the server's answer onto moat's exit statuses: a server too
// busy for the request now is the environment's (3: the same request may
// pass later), a request the server refused is the caller's to fix (2), a
// server that could not serve it is moat's (125).
func (e *apiError) exit() int {
	switch {
	case busyCodes[e.code]:
		return exitEnvironment
	case e.status >= 400 && e.status < 500:
		return exitUsage
	}
	return exitInternal
}

// busyCodes are the server's error codes (server/errors.go) for a request
// refused only for now: too many runs or sessions, a session busy with
// another run, a server shutting down.
var busyCodes = map[string]bool{
	"busy": true, "token_busy": true, "queue_timeout": true, "too_many_sessions": true,
	"session_busy": true, "shutting_down": true,
}

// do sends one request and decodes a JSON answer into out (when not nil).
// A body that is an io.Reader is sent as it is, anything else as JSON.
func (c *apiClient) do(ctx context.Context, method, path string, body any, out any) error {
	var rd io.Reader
	ctype := ""
	switch b := body.(type) {
	case nil:
	case io.Reader:
		rd, ctype = b, "application/octet-stream"
	default:
		buf, err := json.Marshal(b)
		if err != nil {
			return fmt.Errorf("session: %w", err)
		}
		rd, ctype = bytes.NewReader(buf), "application/json"
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return fmt.Errorf("session: %w", moat.Invalid(err))
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("session: cannot reach moat serve at %s (is it running? --url or MOAT_URL): %w", c.base, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		var e struct {
			Error struct{ Code, Message string } `json:"error"`
		}
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if json.Unmarshal(raw, &e) != nil || e.Error.Code == "" {
			e.Error.Code, e.Error.Message = "unknown", strings.TrimSpace(string(raw))
		}
		return &apiError{resp.StatusCode, e.Error.Code, e.Error.Message}
	}
	switch o := out.(type) {
	case nil:
		return nil
	case io.Writer:
		_, err = io.Copy(o, resp.Body)
	default:
		err = json.NewDecoder(resp.Body).Decode(o)
	}
	if err != nil {
		return fmt.Errorf("session: reading the server's answer: %w", err)
	}
	return nil
}

func cmdSession(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("session")
	base := fs.String("url", "", "moat serve's URL (default $MOAT_URL, else http://"+defaultAddr+")")
	tokenFile := fs.String("token-file", "", "a file holding the token (default: $MOAT_TOKEN)")
	asJSON := fs.Bool("json", false, "print the server's JSON answers as they are")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return exitFor(stdio, fmt.Errorf("session: which command? (moat session -h): %w", moat.ErrInvalid))
	}
	c, err := newAPIClient(*base, *tokenFile)
	if err != nil {
		return exitFor(stdio, err)
	}
	code, err := sessionCommand(ctx, c, rest[0], rest[1:], *asJSON, stdio)
	var ae *apiError
	if errors.As(err, &ae) {
		fmt.Fprintf(stdio.Err, "moat: %s\n", oneLine(ae.Error()))
		return ae.exit()
	}
	if err != nil {
		return exitFor(stdio, err)
	}
	return code
}

// newAPIClient resolves the server's URL and the token.
func newAPIClient(base, tokenFile string) (*apiClient, error) {
	if base == "" {
		base = os.Getenv("MOAT_URL")
	}
	if base == "" {
		base = "http://" + defaultAddr
	}
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("session: --url %q is not an http(s) URL: %w", base, moat.ErrInvalid)
	}
	token := os.Getenv("MOAT_TOKEN")
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return nil, fmt.Errorf("session: --token-file: %w", moat.Invalid(err))
		}
		token = strings.TrimSpace(string(b))
	}
	if token == "" {
		return nil, fmt.Errorf("session: no token: set MOAT_TOKEN or give --token-file: %w", moat.ErrInvalid)
	}
	if strings.ContainsAny(token, " \t\r\n") {
		return nil, fmt.Errorf("session: the token holds white space: %w", moat.ErrInvalid)
	}
	// No overall timeout: a run lasts as long as the server lets it.
	return &apiClient{base: strings.TrimRight(u.String(), "/"), token: token, http: &http.Client{}}, nil
}

// sessionView is the part of a session's JSON the table shows.
type sessionView struct {
	ID             string    `json:"id"`
	Level          string    `json:"level"`
	Network        string    `json:"network"`
	Interpreter    bool      `json:"interpreter"`
	State          string    `json:"state"`
	Memory         *bool     `json:"memory"`
	ExpiresAt      time.Time `json:"expires_at"`
	SuspendedBytes int64     `json:"suspended_bytes"`
	FromSnapshot   string    `json:"from_snapshot"`
	Broken         string    `json:"broken"`
	Notes          []string  `json:"notes"`
}

// sessionCommand runs one command of moat session.
func sessionCommand(ctx context.Context, c *apiClient, name string, args []string, asJSON bool, stdio Stdio) (int, error) {
	need := func(n int, what string) error {
		if len(args) != n {
			return fmt.Errorf("session %s: want %s, got %d argument(s): %w", name, what, len(args), moat.ErrInvalid)
		}
		return nil
	}
	sess := func(id string) string { return "/v1/sessions/" + url.PathEscape(id) }
	// show prints one JSON answer as it is, or through pretty.
	show := func(raw json.RawMessage, pretty func(json.RawMessage)) (int, error) {
		if asJSON {
			fmt.Fprintln(stdio.Out, string(raw))
		} else {
			pretty(raw)
		}
		return exitOK, nil
	}
	switch name {
	case "create":
		return sessionCreate(ctx, c, args, asJSON, stdio)
	case "run":
		return sessionRun(ctx, c, args, asJSON, stdio)
	case "list", "snapshots":
		if err := need(0, "no argument"); err != nil {
			return 0, err
		}
		path := map[string]string{"list": "/v1/sessions", "snapshots": "/v1/snapshots"}[name]
		var raw json.RawMessage
		if err := c.do(ctx, "GET", path, nil, &raw); err != nil {
			return 0, err
		}
		return show(raw, func(raw json.RawMessage) {
			if name == "list" {
				printSessions(stdio.Out, raw)
			} else {
				printSnapshots(stdio.Out, raw)
			}
		})
	case "show", "suspend", "resume":
		if err := need(1, "a session ID"); err != nil {
			return 0, err
		}
		method, path := "POST", sess(args[0])+"/"+name
		if name == "show" {
			method, path = "GET", sess(args[0])
		}
		var raw json.RawMessage
		if err := c.do(ctx, method, path, nil, &raw); err != nil {
			return 0, err
		}
		return show(raw, func(raw json.RawMessage) { printSession(stdio.Out, raw) })
	case "snapshot":
		if err := need(2, "a session ID and a snapshot name"); err != nil {
			return 0, err
		}
		var raw json.RawMessage
		if err := c.do(ctx, "POST", sess(args[0])+"/snapshots", map[string]string{"name": args[1]}, &raw); err != nil {
			return 0, err
		}
		return show(raw, func(raw json.RawMessage) {
			var s struct {
				ID     string `json:"id"`
				Memory bool   `json:"memory"`
				Bytes  int64  `json:"bytes"`
			}
			json.Unmarshal(raw, &s)
			fmt.Fprintf(stdio.Out, "%s\t%s, memory %v\n", s.ID, moat.Bytes(s.Bytes), s.Memory)
		})
	case "delete-snapshot", "end":
		if err := need(1, "an ID"); err != nil {
			return 0, err
		}
		path := sess(args[0])
		if name == "delete-snapshot" {
			path = "/v1/snapshots/" + url.PathEscape(args[0])
		}
		return exitOK, c.do(ctx, "DELETE", path, nil, nil)
	case "ls":
		if err := need(1, "a session ID"); err != nil {
			return 0, err
		}
		var raw json.RawMessage
		if err := c.do(ctx, "GET", sess(args[0])+"/files", nil, &raw); err != nil {
			return 0, err
		}
		return show(raw, func(raw json.RawMessage) { printFiles(stdio.Out, raw) })
	case "get":
		if err := need(2, "a session ID and a path"); err != nil {
			return 0, err
		}
		return exitOK, c.do(ctx, "GET", sess(args[0])+"/files/"+escapePath(args[1]), nil, stdio.Out)
	case "put":
		if len(args) != 2 && len(args) != 3 {
			return 0, fmt.Errorf("session put: want a session ID, a local file and maybe a path, got %d argument(s): %w", len(args), moat.ErrInvalid)
		}
		f, err := os.Open(args[1])
		if err != nil {
			return 0, fmt.Errorf("session put: %w", moat.Invalid(err))
		}
		defer f.Close()
		dst := args[1][strings.LastIndexByte(args[1], '/')+1:]
		if len(args) == 3 {
			dst = args[2]
		}
		return exitOK, c.do(ctx, "PUT", sess(args[0])+"/files/"+escapePath(dst), f, nil)
	}
	return 0, fmt.Errorf("session: unknown command %q (moat session -h): %w", name, moat.ErrInvalid)
}

// escapePath escapes each element of a session path for the URL.
func escapePath(p string) string {
	parts := strings.Split(p, "/")
	for i := range parts {
		parts[i] = url.PathEscape(parts[i])
	}
	return strings.Join(parts, "/")
}

func sessionCreate(ctx context.Context, c *apiClient, args []string, asJSON bool, stdio Stdio) (int, error) {
	fs := newFlagSet("session create")
	level := fs.String("level", "", "the level (default: the server's)")
	interp := fs.Bool("interpreter", false, "keep one Python interpreter alive between runs")
	ttl := fs.String("ttl", "", "time to live, e.g. 30m (the server bounds it)")
	idle := fs.String("idle-timeout", "", "end or suspend the session after this long unused")
	network := fs.String("network", "", "a network profile of the operator's this token may use")
	from := fs.String("from-snapshot", "", "start from this snapshot (a fork)")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code, nil
	}
	if fs.NArg() != 0 {
		return 0, fmt.Errorf("session create: unexpected argument %q: %w", fs.Arg(0), moat.ErrInvalid)
	}
	body := map[string]any{}
	for k, v := range map[string]string{"level": *level, "ttl": *ttl, "idle_timeout": *idle, "network": *network, "from_snapshot": *from} {
		if v != "" {
			body[k] = v
		}
	}
	if *interp {
		body["interpreter"] = true
	}
	var raw json.RawMessage
	if err := c.do(ctx, "POST", "/v1/sessions", body, &raw); err != nil {
		return 0, err
	}
	if asJSON {
		fmt.Fprintln(stdio.Out, string(raw))
		return exitOK, nil
	}
	var v sessionView
	json.Unmarshal(raw, &v)
	fmt.Fprintln(stdio.Out, v.ID)
	return exitOK, nil
}

func sessionRun(ctx context.Context, c *apiClient, args []string, asJSON bool, stdio Stdio) (int, error) {
	if len(args) == 0 {
		return 0, fmt.Errorf("session run: want a session ID, then -c CODE, a FILE or -: %w", moat.ErrInvalid)
	}
	id := args[0]
	fs := newFlagSet("session run")
	code := fs.String("c", "", "the code to run")
	if code, ok := parseFlags(fs, args[1:], stdio); !ok {
		return code, nil
	}
	codeSet := false
	fs.Visit(func(f *flag.Flag) { codeSet = codeSet || f.Name == "c" })
	src, err := readCode(fs, codeSet, *code, stdio.In)
	if err != nil {
		return 0, err
	}
	var raw json.RawMessage
	if err := c.do(ctx, "POST", "/v1/sessions/"+url.PathEscape(id)+"/runs", map[string]string{"code": string(src)}, &raw); err != nil {
		return 0, err
	}
	var res struct {
		Stdout   string   `json:"stdout"`
		Stderr   string   `json:"stderr"`
		ExitCode int      `json:"exit_code"`
		Reason   string   `json:"reason"`
		Notes    []string `json:"notes"`
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		return 0, fmt.Errorf("session run: the server's result: %w", err)
	}
	if asJSON {
		fmt.Fprintln(stdio.Out, string(raw))
		return res.ExitCode, nil
	}
	io.WriteString(stdio.Out, res.Stdout)
	io.WriteString(stdio.Err, res.Stderr)
	for _, n := range res.Notes {
		fmt.Fprintf(stdio.Err, "moat: note: %s\n", n)
	}
	if res.Reason != "" {
		fmt.Fprintf(stdio.Err, "moat: run ended: %s (exit %d)\n", res.Reason, res.ExitCode)
	}
	return res.ExitCode, nil
}

func printSession(w io.Writer, raw json.RawMessage) {
	var v sessionView
	json.Unmarshal(raw, &v)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row := func(k, v string) {
		if v != "" {
			fmt.Fprintf(tw, "%s\t%s\n", k, v)
		}
	}
	row("id", v.ID)
	row("state", v.State)
	row("level", v.Level)
	row("network", v.Network)
	row("interpreter", fmt.Sprint(v.Interpreter))
	if v.Memory != nil {
		row("memory kept", fmt.Sprint(*v.Memory))
	}
	if v.SuspendedBytes > 0 {
		row("on disk", moat.Bytes(v.SuspendedBytes).String())
	}
	row("from snapshot", v.FromSnapshot)
	if !v.ExpiresAt.IsZero() {
		row("expires", v.ExpiresAt.Local().Format(time.RFC3339))
	}
	row("broken", v.Broken)
	for _, n := range v.Notes {
		row("note", n)
	}
	tw.Flush()
}

func printSessions(w io.Writer, raw json.RawMessage) {
	var l struct{ Sessions []sessionView }
	json.Unmarshal(raw, &l)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tLEVEL\tINTERPRETER\tEXPIRES")
	for _, v := range l.Sessions {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%s\n", v.ID, v.State, v.Level, v.Interpreter, v.ExpiresAt.Local().Format(time.RFC3339))
	}
	tw.Flush()
}

func printSnapshots(w io.Writer, raw json.RawMessage) {
	var l struct {
		Snapshots []struct {
			ID, Name, Level, Session string
			Memory                   bool
			Bytes                    int64
		}
	}
	json.Unmarshal(raw, &l)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAME\tLEVEL\tMEMORY\tSIZE\tSESSION")
	for _, s := range l.Snapshots {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%s\t%s\n", s.ID, s.Name, s.Level, s.Memory, moat.Bytes(s.Bytes), s.Session)
	}
	tw.Flush()
}

func printFiles(w io.Writer, raw json.RawMessage) {
	var l struct {
		Files []struct {
			Name string `json:"name"`
			Size int64  `json:"size"`
			Dir  bool   `json:"is_dir"`
		}
	}
	json.Unmarshal(raw, &l)
	for _, f := range l.Files {
		if f.Dir {
			fmt.Fprintf(w, "%s/\n", f.Name)
		} else {
			fmt.Fprintf(w, "%s\t%d\n", f.Name, f.Size)
		}
	}
}
