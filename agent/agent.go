// Package agent runs a Claude agent whose tools run the code the model
// writes in a [moat.Sandbox].
//
// The loop talks to the Anthropic Messages API through Anthropic's official
// Go SDK: it sends the task, runs every tool call the model makes and sends
// back the results, until the model gives its final answer or the turn
// limit is reached. It prints each step as it goes — what the model said,
// the code it wrote, the result it got, its answer — to
// [Config.Transcript].
//
// By default the model has one tool, run_python, and each call starts from
// nothing. With [Config.Sessions], each Run's conversation has one
// [moat.Session] for its life: run_python's calls run in it, so that files
// (and with [Config.Interpreter], variables) persist between them, and the
// model also gets write_file, read_file and list_files on its files. The
// session is closed when Run returns.
//
// The agent takes a Sandbox, never a concrete level: the operator chooses the
// level and its limits, and changing them changes nothing here. run_python's
// input is {"code": "..."} and nothing else (see package tool).
package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/tool"
)

// Defaults for [Config].
const (
	// DefaultModel is the model used when Config.Model is empty.
	DefaultModel = anthropic.ModelClaudeSonnet5_5
	// DefaultMaxTurns is the most requests to the model in one Run.
	DefaultMaxTurns = 10
	// DefaultMaxTokens is the most tokens the model may write per turn.
	DefaultMaxTokens = 4096
	// DefaultSystem is the system prompt used when Config.System is empty
	// and Config.Sessions is off.
	DefaultSystem = "You solve the user's task. You have one tool, run_python, which runs a " +
		"Python 3 program in a sandbox and tells you its stdout, stderr and exit code. Use it " +
		"to compute, check and try things rather than guessing. Each call starts fresh: " +
		"nothing is kept between calls, and there is no network. When you are done, answer " +
		"plainly with the result."
	// DefaultSessionSystem is the system prompt used when Config.System is
	// empty, with Config.Sessions and without Config.Interpreter.
	DefaultSessionSystem = "You solve the user's task. Your tools work in one sandbox session kept for this task: " +
		"run_python runs a Python 3 program and tells you its stdout, stderr and exit code, and write_file, " +
		"read_file and list_files work on the files of its working directory. Files persist between calls; " +
		"variables do not (each run_python call is a fresh interpreter), so keep what you need in files. Use the " +
		"tools to compute, check and try things rather than guessing. There is no network. When you are done, " +
		"answer plainly with the result."
	// DefaultInterpreterSystem is the system prompt used when Config.System
	// is empty, with Config.Sessions and Config.Interpreter.
	DefaultInterpreterSystem = "You solve the user's task. Your tools work in one sandbox session kept for this task: " +
		"run_python runs Python 3 code in a live interpreter, like a notebook cell, and tells you its stdout, stderr " +
		"and exit code, and write_file, read_file and list_files work on the files of its working directory. " +
		"Variables and files persist between calls, except that a call that times out or hits a limit restarts the " +
		"interpreter and its variables are lost (the result says so). Use the tools to compute, check and try things " +
		"rather than guessing. There is no network. When you are done, answer plainly with the result."
)

// EnvAPIKey is the environment variable the command reads the key from.
const EnvAPIKey = "ANTHROPIC_API_KEY"

// ErrNoAPIKey means no API key was given. Its message says how to set one.
var ErrNoAPIKey = errors.New("agent: no Anthropic API key: set " + EnvAPIKey +
	" in the environment, e.g. `export " + EnvAPIKey + "=sk-ant-...` " +
	"(create a key in the Anthropic Console, under Settings > API Keys)")

// ErrMaxTurns means the model had not given a final answer when the turn
// limit was reached.
var ErrMaxTurns = errors.New("agent: reached the turn limit without a final answer")

// Config configures an [Agent]. Its zero value, with an APIKey, is ready to
// use.
type Config struct {
	// APIKey authenticates to the Messages API. It is required: New fails
	// with ErrNoAPIKey without one. Nothing is read from the environment
	// here; see [APIKeyFromEnv].
	APIKey string `json:"-"`
	// Model is the Claude model to use. Empty means DefaultModel.
	Model string `json:"model,omitempty"`
	// MaxTurns is the most requests to the model in one Run; each turn
	// may run the tool. Zero means DefaultMaxTurns.
	MaxTurns int `json:"max_turns,omitempty"`
	// MaxTokens is the most tokens the model may write in one turn. Zero
	// means DefaultMaxTokens.
	MaxTokens int64 `json:"max_tokens,omitempty"`
	// BaseURL is the API's address. Empty means the SDK's default, the
	// production API. Tests point it at a local server.
	BaseURL string `json:"base_url,omitempty"`
	// System is the system prompt. Empty means DefaultSystem, or with
	// Sessions DefaultSessionSystem or DefaultInterpreterSystem.
	System string `json:"system,omitempty"`
	// MaxCode is the largest program the tool accepts, in bytes. Zero means
	// tool.DefaultMaxCode (1 MiB).
	MaxCode int `json:"max_code,omitempty"`
	// MaxOutput is how much of each of stdout and stderr a tool result
	// shows the model, in bytes; the middle of longer output is cut, with a
	// note. Zero means tool.DefaultMaxOutput (8 KiB).
	MaxOutput int `json:"max_output,omitempty"`
	// Sessions gives each Run's conversation one moat session for its
	// life, made when Run starts and closed when it returns: run_python's
	// calls run in it, so that files persist between them, and the model
	// also gets write_file, read_file and list_files on its files. The
	// sandbox must implement moat.Sessioner (New fails otherwise); when it
	// cannot make a session, Run fails with that error before asking the
	// model anything. False means run_python alone, each call from nothing.
	Sessions bool `json:"sessions,omitempty"`
	// Interpreter, with Sessions, keeps a live Python interpreter in the
	// session (moat.SessionOptions.Interpreter), so that variables persist
	// between run_python calls too, until a call times out or hits a
	// limit. It needs Sessions.
	Interpreter bool `json:"interpreter,omitempty"`
	// Transcript receives each step, readably, as it happens. Nil means
	// discard.
	Transcript io.Writer `json:"-"`
	// Logger receives operational records (requests, tool calls). Nil
	// means discard.
	Logger *slog.Logger `json:"-"`
}

// Validate reports whether c can be used. A missing key is ErrNoAPIKey;
// negative limits wrap moat.ErrInvalid.
func (c Config) Validate() error {
	if strings.TrimSpace(c.APIKey) == "" {
		return ErrNoAPIKey
	}
	var bad []string
	if c.MaxTurns < 0 {
		bad = append(bad, fmt.Sprintf("max turns %d is negative", c.MaxTurns))
	}
	if c.MaxTokens < 0 {
		bad = append(bad, fmt.Sprintf("max tokens %d is negative", c.MaxTokens))
	}
	if c.MaxCode < 0 {
		bad = append(bad, fmt.Sprintf("max code %d is negative", c.MaxCode))
	}
	if c.MaxOutput < 0 {
		bad = append(bad, fmt.Sprintf("max output %d is negative", c.MaxOutput))
	}
	if c.Interpreter && !c.Sessions {
		bad = append(bad, "a live interpreter needs sessions (set sessions too)")
	}
	if len(bad) > 0 {
		return fmt.Errorf("agent: config: %s: %w", strings.Join(bad, "; "), moat.ErrInvalid)
	}
	return nil
}

// APIKeyFromEnv returns the key in ANTHROPIC_API_KEY, looked up with lookup
// (os.LookupEnv in the command, a map in tests), or ErrNoAPIKey.
func APIKeyFromEnv(lookup func(string) (string, bool)) (string, error) {
	key, _ := lookup(EnvAPIKey)
	if strings.TrimSpace(key) == "" {
		return "", ErrNoAPIKey
	}
	return key, nil
}

// Agent runs tasks. It is safe for concurrent use: each Run has its own
// conversation (and with Sessions its own moat session). It holds no
// resources between Runs; the caller closes the Sandbox.
type Agent struct {
	cfg       Config
	client    anthropic.Client
	tools     []anthropic.ToolUnionParam
	names     map[string]bool // of the tools offered
	sb        moat.Sandbox
	runner    *tool.Runner   // without sessions
	sessioner moat.Sessioner // with sessions
	out       io.Writer
	log       *slog.Logger
}

// New returns an Agent that runs its tools' code in sb. With cfg.Sessions,
// sb must implement moat.Sessioner; New fails with an error wrapping
// moat.ErrUnavailable if it does not.
func New(sb moat.Sandbox, cfg Config) (*Agent, error) {
	if sb == nil {
		return nil, fmt.Errorf("agent: nil sandbox: %w", moat.ErrInvalid)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Model == "" {
		cfg.Model = DefaultModel
	}
	if cfg.MaxTurns == 0 {
		cfg.MaxTurns = DefaultMaxTurns
	}
	if cfg.MaxTokens == 0 {
		cfg.MaxTokens = DefaultMaxTokens
	}
	a := &Agent{cfg: cfg, sb: sb, out: cfg.Transcript, log: cfg.Logger, names: map[string]bool{}}
	if a.out == nil {
		a.out = io.Discard
	}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	var specs []tool.Spec
	switch {
	case cfg.Sessions:
		sessioner, ok := sb.(moat.Sessioner)
		if !ok {
			return nil, &moat.UnavailableError{Level: sb.Level(), Reason: "the agent was asked for a session, and this sandbox keeps none",
				Remedy: "run without sessions, or choose a level that keeps them"}
		}
		a.sessioner = sessioner
		specs = tool.SessionTools(cfg.Interpreter)
	default:
		a.runner = &tool.Runner{Sandbox: sb, MaxCode: cfg.MaxCode, MaxOutput: cfg.MaxOutput, Logger: a.log, Tenant: "agent"}
		specs = a.runner.Tools()
	}
	if a.cfg.System == "" {
		switch {
		case cfg.Interpreter:
			a.cfg.System = DefaultInterpreterSystem
		case cfg.Sessions:
			a.cfg.System = DefaultSessionSystem
		default:
			a.cfg.System = DefaultSystem
		}
	}
	for _, t := range specs {
		var schema anthropic.ToolInputSchemaParam
		if err := json.Unmarshal(t.InputSchema, &schema); err != nil {
			return nil, fmt.Errorf("agent: the schema of %s: %w", t.Name, err)
		}
		a.tools = append(a.tools, anthropic.ToolUnionParam{OfTool: &anthropic.ToolParam{
			Name:        t.Name,
			Description: anthropic.String(t.Description),
			InputSchema: schema,
		}})
		a.names[t.Name] = true
	}

	// The environment is not consulted (no ANTHROPIC_BASE_URL, no
	// profiles): what the caller configured is what is used.
	opts := []option.RequestOption{option.WithoutEnvironmentDefaults(), option.WithAPIKey(cfg.APIKey)}
	if cfg.BaseURL != "" {
		opts = append(opts, option.WithBaseURL(cfg.BaseURL))
	}
	a.client = anthropic.NewClient(opts...)
	return a, nil
}

// Answer is how a Run ended.
type Answer struct {
	// Text is the model's final text (its last turn's, when the turn limit
	// was reached).
	Text string
	// StopReason is why the model's last turn ended: "end_turn" for a
	// final answer, "max_tokens" when it was cut, "tool_use" when the turn
	// limit stopped the loop, ...
	StopReason string
	// Turns is the number of requests made to the model.
	Turns int
	// ToolCalls is the number of tool calls made, bad ones included.
	ToolCalls int
}

// Run gives the model task and runs the loop until the model answers
// without calling a tool, or MaxTurns requests have been made. It returns
// the answer, or with ErrMaxTurns the Answer so far. An error from the API,
// or ctx's cancellation, ends the loop with that error. Failures of the
// model's code, and bad tool calls, are told to the model and do not end
// the loop. With Sessions, Run first makes the conversation's moat session,
// failing if it cannot, and closes it before it returns.
func (a *Agent) Run(ctx context.Context, task string) (*Answer, error) {
	if strings.TrimSpace(task) == "" {
		return nil, fmt.Errorf("agent: empty task: %w", moat.ErrInvalid)
	}
	var caller tool.Caller = a.runner
	kept := "nothing kept between calls"
	if a.sessioner != nil {
		sess, err := a.sessioner.NewSession(ctx, moat.SessionOptions{Interpreter: a.cfg.Interpreter})
		if err != nil {
			return nil, fmt.Errorf("agent: the conversation's sandbox session: %w", err)
		}
		defer func() {
			if err := sess.Close(); err != nil {
				a.log.Warn("agent: closing the sandbox session", "err", err)
			}
		}()
		caller = &tool.SessionRunner{Session: sess, Interpreter: a.cfg.Interpreter, MaxCode: a.cfg.MaxCode, MaxOutput: a.cfg.MaxOutput, Logger: a.log}
		kept = "one session: files kept between calls"
		if a.cfg.Interpreter {
			kept = "one session with a live interpreter: files and variables kept between calls"
		}
	}
	fmt.Fprintf(a.out, "task: %s\n", task)
	fmt.Fprintf(a.out, "model: %s, level: %s (%s), at most %d turns\n", a.cfg.Model, a.sb.Level(), kept, a.cfg.MaxTurns)

	messages := []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(task))}
	ans := &Answer{}
	for ans.Turns < a.cfg.MaxTurns {
		ans.Turns++
		turn := ans.Turns
		fmt.Fprintf(a.out, "\n--- turn %d ---\n", turn)
		start := time.Now()
		msg, err := a.client.Messages.New(ctx, anthropic.MessageNewParams{
			Model:     a.cfg.Model,
			MaxTokens: a.cfg.MaxTokens,
			System:    []anthropic.TextBlockParam{{Text: a.cfg.System}},
			Messages:  messages,
			Tools:     a.tools,
		})
		if err != nil {
			return ans, fmt.Errorf("agent: turn %d: messages api: %w", turn, err)
		}
		a.log.Info("agent: model turn", "turn", turn, "stop_reason", msg.StopReason,
			"input_tokens", msg.Usage.InputTokens, "output_tokens", msg.Usage.OutputTokens, "elapsed", time.Since(start))
		ans.StopReason = string(msg.StopReason)
		ans.Text = textOf(msg)
		messages = append(messages, msg.ToParam())

		if msg.StopReason != anthropic.StopReasonToolUse {
			a.printAnswer(msg, ans.Text)
			return ans, nil
		}
		for _, block := range msg.Content {
			if t, ok := block.AsAny().(anthropic.TextBlock); ok && strings.TrimSpace(t.Text) != "" {
				fmt.Fprintf(a.out, "claude: %s\n", strings.TrimSpace(t.Text))
			}
		}
		if ans.Turns == a.cfg.MaxTurns {
			// The results could not be sent back: do not run the code.
			for _, block := range msg.Content {
				if use, ok := block.AsAny().(anthropic.ToolUseBlock); ok {
					fmt.Fprintf(a.out, "%s call not run (no turn left for its result):\n%s", use.Name, indent(clip(string(use.Input))))
				}
			}
			break
		}
		var results []anthropic.ContentBlockParamUnion
		for _, block := range msg.Content {
			use, ok := block.AsAny().(anthropic.ToolUseBlock)
			if !ok {
				continue
			}
			ans.ToolCalls++
			results = append(results, a.call(ctx, caller, use))
			if err := ctx.Err(); err != nil {
				return ans, fmt.Errorf("agent: %w", err)
			}
		}
		if len(results) == 0 {
			// stop_reason said tool_use, but there was no tool_use block.
			a.printAnswer(msg, ans.Text)
			return ans, nil
		}
		messages = append(messages, anthropic.NewUserMessage(results...))
	}
	fmt.Fprintf(a.out, "\nstopped: no final answer after %d turns (the limit)\n", a.cfg.MaxTurns)
	return ans, fmt.Errorf("%w (%d turns)", ErrMaxTurns, a.cfg.MaxTurns)
}

// call runs one tool_use block with caller and returns its tool_result.
func (a *Agent) call(ctx context.Context, caller tool.Caller, use anthropic.ToolUseBlock) anthropic.ContentBlockParamUnion {
	switch {
	case !a.names[use.Name]:
		fmt.Fprintf(a.out, "tool call to unknown tool %q\n", use.Name)
	case use.Name == tool.Name:
		if code, err := tool.ParseInput(use.Input, a.cfg.MaxCode); err == nil {
			fmt.Fprintf(a.out, "run_python:\n%s", indent(clip(code)))
		} else {
			fmt.Fprintf(a.out, "run_python with bad input:\n%s", indent(clip(string(use.Input))))
		}
	default:
		fmt.Fprintf(a.out, "%s:\n%s", use.Name, indent(clip(string(use.Input))))
	}
	start := time.Now()
	out := caller.CallTool(ctx, use.Name, use.Input)
	fmt.Fprintf(a.out, "result (%s%s):\n%s", time.Since(start).Round(time.Millisecond), errNote(out.IsError), indent(out.Text))
	return anthropic.NewToolResultBlock(use.ID, out.Text, out.IsError)
}

func (a *Agent) printAnswer(msg *anthropic.Message, text string) {
	switch msg.StopReason {
	case anthropic.StopReasonEndTurn, anthropic.StopReasonStopSequence:
		fmt.Fprintf(a.out, "answer:\n%s\n", strings.TrimSpace(text))
	case anthropic.StopReasonMaxTokens:
		fmt.Fprintf(a.out, "answer (cut at the token limit):\n%s\n", strings.TrimSpace(text))
	case anthropic.StopReasonRefusal:
		fmt.Fprintf(a.out, "the model declined:\n%s\n", strings.TrimSpace(text))
	default:
		fmt.Fprintf(a.out, "answer (stop reason %q):\n%s\n", msg.StopReason, strings.TrimSpace(text))
	}
}

// textOf joins the text blocks of msg.
func textOf(msg *anthropic.Message) string {
	var parts []string
	for _, block := range msg.Content {
		if t, ok := block.AsAny().(anthropic.TextBlock); ok && t.Text != "" {
			parts = append(parts, t.Text)
		}
	}
	return strings.Join(parts, "\n")
}

// maxShown is the most of the model's code the transcript shows.
const maxShown = 16 << 10

// clip cuts s to maxShown bytes for the transcript, with a note.
func clip(s string) string {
	if len(s) <= maxShown {
		return s
	}
	i := maxShown
	for i > 0 && s[i]&0xC0 == 0x80 {
		i--
	}
	return fmt.Sprintf("%s\n[... %d more bytes not shown ...]", s[:i], len(s)-i)
}

func errNote(isError bool) string {
	if isError {
		return ", tool error"
	}
	return ""
}

// indent prefixes every line of s with four spaces and ends it with a
// newline.
func indent(s string) string {
	s = strings.TrimSuffix(s, "\n")
	return "    " + strings.ReplaceAll(s, "\n", "\n    ") + "\n"
}
