// Package tool defines the tools that moat offers to a language model, in
// one place: their names, descriptions and input schemas, how their input is
// checked, and how what happened is told back to the model.
//
// The agent (package agent, through the Anthropic Messages API) and the MCP
// server (package mcpserver) both use it, so a tool means the same thing
// whichever way a model reaches it. Both see the tools through [Caller]:
//
//   - [Runner] offers run_python alone, each call in a fresh run of a
//     [moat.Sandbox]: nothing is kept from one call to the next.
//   - [SessionRunner] offers run_python in one [moat.Session], so that files
//     (and, with a live interpreter, variables) persist between calls, and
//     the file tools write_file, read_file and list_files on the session's
//     working directory.
//
// run_python's input is {"code": "..."} and nothing else. The isolation
// level, the limits and every other setting belong to the operator who built
// the [moat.Sandbox]; a model cannot choose them. Bad input (a missing or
// extra field, a value of the wrong type, code or a file over its size cap, a
// file name that leaves the working directory), a missing file and sandbox
// failures come back as tool errors the model can read; a failure of the code
// itself (an exception, a non-zero exit, a limit hit) is an ordinary result.
package tool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
)

// Name is the tool's name, as the model calls it.
const Name = "run_python"

// Description tells the model what the tool does. It is the same at every
// isolation level.
const Description = "Run a Python 3 program in a sandbox and get back its stdout, stderr, exit code " +
	"and, if the run ended abnormally, why (timeout, memory, processes, file size, disk, output). " +
	"Each call starts from nothing: a fresh interpreter in an empty working directory, " +
	"with no state, files or variables kept from earlier calls, no network, and limits on " +
	"time, memory, processes and disk set by the operator. Print what you want to see; " +
	"long output is cut."

// schema is the input schema: "code" and nothing else.
const schema = `{
  "type": "object",
  "properties": {
    "code": {
      "type": "string",
      "description": "The complete Python 3 program to run. It is run as a script; print the results you need."
    }
  },
  "required": ["code"],
  "additionalProperties": false
}`

// InputSchema returns the tool's input schema, a JSON Schema object that
// allows exactly one property, "code", a required string. The caller may
// keep or change the returned slice.
func InputSchema() json.RawMessage {
	return json.RawMessage(schema)
}

// Spec describes one tool as a model is offered it: what the MCP server
// lists and what the agent sends with each request.
type Spec struct {
	Name        string          // as the model calls it, e.g. "run_python"
	Title       string          // a short title for people, e.g. "Run Python in a sandbox"
	Description string          // what the tool does, for the model
	InputSchema json.RawMessage // a JSON Schema object
	// ReadOnly is true when a call changes nothing, not even the files of
	// the session.
	ReadOnly bool
}

// Caller is what the agent and the MCP server call: a set of tools and a
// way to run one call of them. [Runner] and [SessionRunner] implement it.
type Caller interface {
	// Tools lists the tools offered, in the order they are offered.
	Tools() []Spec
	// CallTool runs one call of the tool name with args, the input as the
	// model sent it (a JSON object). It never fails: an unknown tool, bad
	// input and sandbox failures are Outcomes with IsError set. Cancelling
	// ctx cancels the call.
	CallTool(ctx context.Context, name string, args json.RawMessage) Outcome
}

// runPythonSpec is run_python's Spec, with its description for the mode.
func runPythonSpec(description string) Spec {
	return Spec{Name: Name, Title: "Run Python in a sandbox", Description: description, InputSchema: InputSchema()}
}

// Defaults for [Runner].
const (
	// DefaultMaxCode is the largest program the tool accepts, in bytes.
	DefaultMaxCode = 1 << 20
	// DefaultMaxOutput is how much of each output stream the tool's text
	// shows the model, in bytes.
	DefaultMaxOutput = 8 << 10
)

// Runner runs the tool's calls in a sandbox. Its zero value, given a
// Sandbox, is ready to use. A Runner is safe for concurrent use when its
// Sandbox is, as every [moat.Sandbox] is; its fields must not change while
// it is in use.
type Runner struct {
	// Sandbox runs the code. It must not be nil. The Runner does not close
	// it.
	Sandbox moat.Sandbox
	// MaxCode is the largest program accepted, in bytes; a larger one is a
	// tool error. Zero means DefaultMaxCode.
	MaxCode int
	// MaxOutput is how much of each of stdout and stderr the result text
	// shows, in bytes; the middle of a longer stream is cut, keeping its
	// start and its end, with a note. Zero means DefaultMaxOutput.
	MaxOutput int
	// Logger receives one record per call. Nil means discard.
	Logger *slog.Logger
	// Tenant is every run's moat.Request.Tenant: with a level that
	// recycles instances, this Runner's calls may reuse one, reset
	// between them. Empty: no tenant, a fresh instance every call.
	Tenant string
}

var _ Caller = (*Runner)(nil)

// Tools returns run_python alone, described as running each call from
// nothing.
func (r *Runner) Tools() []Spec { return []Spec{runPythonSpec(Description)} }

// CallTool runs a call of run_python, the Runner's one tool; any other name
// is a tool error. See [Runner.Call].
func (r *Runner) CallTool(ctx context.Context, name string, args json.RawMessage) Outcome {
	if name != Name {
		return unknownTool(name, r.Tools())
	}
	return r.Call(ctx, args)
}

// Outcome is what one call of a tool produced.
type Outcome struct {
	// Tool is the name of the tool called, as the model sent it.
	Tool string
	// Code is the program the model sent to run_python, or "" when the
	// input was bad or the tool is another.
	Code string
	// Result is the sandbox's result, or nil when no code ran.
	Result *moat.Result
	// Err is why the call failed: bad input (errors.Is moat.ErrInvalid),
	// a missing file (errors.Is fs.ErrNotExist), an unknown tool or a
	// failure of the sandbox. Nil when it succeeded.
	Err error
	// Text is what the model is told: the result formatted by [Format],
	// the file tool's answer, or the error.
	Text string
	// IsError is true when Err is not nil: the call is a tool error.
	IsError bool
}

// Call checks args, the tool's input as the model sent it (a JSON object),
// runs the code and tells what happened. It never returns a Go error: bad
// input and sandbox failures are Outcomes with IsError set. Cancelling ctx
// cancels the run.
func (r *Runner) Call(ctx context.Context, args json.RawMessage) Outcome {
	log := r.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	code, err := ParseInput(args, r.maxCode())
	if err != nil {
		log.Info("tool: bad input", "tool", Name, "err", err)
		return Outcome{Tool: Name, Err: err, Text: ErrorText(err), IsError: true}
	}
	start := time.Now()
	res, err := r.Sandbox.Run(ctx, moat.Request{Code: []byte(code), Tenant: r.Tenant})
	if err != nil {
		err = fmt.Errorf("tool: sandbox: %w", err)
		log.Warn("tool: sandbox error", "tool", Name, "code_bytes", len(code), "err", err)
		return Outcome{Tool: Name, Code: code, Err: err, Text: ErrorText(err), IsError: true}
	}
	log.Info("tool: ran", "tool", Name, "level", res.Level, "code_bytes", len(code),
		"exit_code", res.ExitCode, "reason", res.Reason, "elapsed", time.Since(start))
	return Outcome{Tool: Name, Code: code, Result: res, Text: Format(res, r.maxOutput())}
}

func (r *Runner) maxCode() int   { return orDefault(r.MaxCode, DefaultMaxCode) }
func (r *Runner) maxOutput() int { return orDefault(r.MaxOutput, DefaultMaxOutput) }

func orDefault(n, def int) int {
	if n > 0 {
		return n
	}
	return def
}

// unknownTool is the Outcome of a call to a tool that is not offered.
func unknownTool(name string, offered []Spec) Outcome {
	names := make([]string, len(offered))
	for i, t := range offered {
		names[i] = t.Name
	}
	err := fmt.Errorf("tool: unknown tool %q; the tools are %s", name, strings.Join(names, ", "))
	if len(names) == 1 {
		err = fmt.Errorf("tool: unknown tool %q; the only tool is %s", name, names[0])
	}
	return Outcome{Tool: name, Err: err, Text: ErrorText(err), IsError: true}
}

// ParseInput checks the tool's input and returns the code. The input must be
// a JSON object whose only field is "code", a non-empty string of at most
// maxCode bytes (zero or less means DefaultMaxCode). The error is an
// *[InputError], written for the model: it says what was wrong and what the
// tool takes.
func ParseInput(args json.RawMessage, maxCode int) (string, error) {
	if maxCode <= 0 {
		maxCode = DefaultMaxCode
	}
	in, err := parseFields(args, `{"code": "print(1)"}`, Name+` takes only "code" (the operator sets the level and the limits)`,
		field{name: "code", required: true, what: "a string holding the Python program"})
	if err != nil {
		return "", err
	}
	code := in["code"]
	if code == "" {
		return "", invalid(`"code" is empty`)
	}
	if len(code) > maxCode {
		return "", invalid(fmt.Sprintf(`"code" is %d bytes, over the cap of %d bytes`, len(code), maxCode))
	}
	return code, nil
}

// field is one string field of a tool's input.
type field struct {
	name     string
	required bool
	what     string // what it holds, for the message when it is missing
}

// parseFields checks a tool's input: a JSON object (or nothing, when no
// field is required) whose fields are among fields, each a string, the
// required ones present. It returns the values by name. example is a good
// input and takes says what the tool takes, for the messages; the error is
// an *InputError.
func parseFields(args json.RawMessage, example, takes string, fields ...field) (map[string]string, error) {
	missing := func(f field) error {
		return invalid(fmt.Sprintf("missing the required field %q (%s)", f.name, f.what))
	}
	trimmed := strings.TrimSpace(string(args))
	var raw map[string]json.RawMessage
	if trimmed != "" && trimmed != "null" {
		if err := json.Unmarshal(args, &raw); err != nil || raw == nil {
			return nil, invalid("the input must be a JSON object like " + example)
		}
	}
	var extra []string
	for k := range raw {
		if !slices.ContainsFunc(fields, func(f field) bool { return f.name == k }) {
			extra = append(extra, strconv.Quote(k))
		}
	}
	if len(extra) > 0 {
		slices.Sort(extra)
		noun := "field"
		if len(extra) > 1 {
			noun = "fields"
		}
		return nil, invalid(fmt.Sprintf("unknown %s %s: %s", noun, strings.Join(extra, ", "), takes))
	}
	out := make(map[string]string, len(fields))
	for _, f := range fields {
		v, ok := raw[f.name]
		if !ok {
			if f.required {
				return nil, missing(f)
			}
			continue
		}
		var s string
		if kind := jsonKind(v); kind != "a string" || json.Unmarshal(v, &s) != nil {
			return nil, invalid(fmt.Sprintf("%q must be a string, not %s", f.name, kind))
		}
		out[f.name] = s
	}
	return out, nil
}

// InputError says what is wrong with the tool's input. It matches
// moat.ErrInvalid under errors.Is.
type InputError struct {
	Msg string // for the model, e.g. `"code" must be a string, not a number`
}

func (e *InputError) Error() string { return "tool: bad input: " + e.Msg }

// Is reports whether target is moat.ErrInvalid.
func (e *InputError) Is(target error) bool { return target == moat.ErrInvalid }

func invalid(msg string) error { return &InputError{Msg: msg} }

// jsonKind names the JSON type of a value, for error messages.
func jsonKind(raw json.RawMessage) string {
	s := strings.TrimSpace(string(raw))
	if s == "" {
		return "nothing"
	}
	switch s[0] {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

// reasons says in words why a run ended abnormally.
var reasons = map[moat.Reason]string{
	moat.ReasonTimeout:  "the run passed its time limit and was killed",
	moat.ReasonMemory:   "the run hit its memory limit",
	moat.ReasonPids:     "the run hit its limit on processes and threads",
	moat.ReasonFileSize: "a file reached the size limit for one file",
	moat.ReasonDisk:     "the run used up its disk space",
	moat.ReasonOutput:   "an output stream passed the sandbox's output cap and was cut there",
	moat.ReasonSignal:   "the code was killed by a signal",
	moat.ReasonCanceled: "the run was cancelled",
}

// Format tells a result to the model: the exit code, the reason for an
// abnormal end, stdout and stderr. A stream longer than maxOutput bytes
// (zero or less means DefaultMaxOutput) keeps its start and its end, with a
// note saying how much was cut. Bytes that are not UTF-8 become U+FFFD.
func Format(res *moat.Result, maxOutput int) string {
	if maxOutput <= 0 {
		maxOutput = DefaultMaxOutput
	}
	var b strings.Builder
	fmt.Fprintf(&b, "exit code: %d\n", res.ExitCode)
	if res.Reason != moat.ReasonNone {
		why := reasons[res.Reason]
		if why == "" {
			why = "the run ended abnormally"
		}
		fmt.Fprintf(&b, "reason: %s (%s)\n", res.Reason, why)
	}
	if res.Signal != "" {
		fmt.Fprintf(&b, "signal: %s\n", res.Signal)
	}
	if res.Truncated && res.Reason != moat.ReasonOutput {
		b.WriteString("note: the output passed the sandbox's output cap; what came after it is lost\n")
	}
	writeStream(&b, "stdout", res.Stdout, maxOutput)
	writeStream(&b, "stderr", res.Stderr, maxOutput)
	return strings.TrimSuffix(b.String(), "\n")
}

func writeStream(b *strings.Builder, name string, data []byte, max int) {
	if len(data) == 0 {
		fmt.Fprintf(b, "%s: (empty)\n", name)
		return
	}
	s := strings.ToValidUTF8(string(data), "\uFFFD")
	if len(s) <= max {
		fmt.Fprintf(b, "%s:\n%s", name, s)
	} else {
		head, tail := cut(s, max)
		n := len(s) - len(head) - len(tail)
		fmt.Fprintf(b, "%s (%d bytes; the middle %d bytes are cut, showing the first %d and the last %d):\n%s",
			name, len(s), n, len(head), len(tail), head)
		if !strings.HasSuffix(head, "\n") {
			b.WriteString("\n")
		}
		fmt.Fprintf(b, "[... %d bytes cut ...]\n%s", n, tail)
	}
	if !strings.HasSuffix(s, "\n") {
		b.WriteString("\n")
	}
}

// cut returns the start and the end of s, together at most max bytes, the
// end being a quarter of them (a traceback is at the end), each split on a
// rune boundary.
func cut(s string, max int) (head, tail string) {
	tailLen := max / 4
	headLen := max - tailLen
	h := headLen
	for h > 0 && !runeStart(s[h]) {
		h--
	}
	t := len(s) - tailLen
	for t < len(s) && !runeStart(s[t]) {
		t++
	}
	return s[:h], s[t:]
}

func runeStart(c byte) bool { return c&0xC0 != 0x80 }

// ErrorText is the text of a tool error: "bad input: ..." for an
// *[InputError], "error: ..." for anything else (a sandbox failure, an
// unknown tool).
func ErrorText(err error) string {
	if ie, ok := errors.AsType[*InputError](err); ok {
		return "bad input: " + ie.Msg
	}
	return "error: " + err.Error()
}
