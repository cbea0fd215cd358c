package tool

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/moatsandbox/moat"
)

// The file tools' names, as the model calls them.
const (
	WriteFileName = "write_file"
	ReadFileName  = "read_file"
	ListFilesName = "list_files"
)

// SessionDescription is run_python's description when its calls run in one
// session without a live interpreter: files persist, variables do not.
const SessionDescription = "Run a Python 3 program in this conversation's sandbox session and get back its stdout, " +
	"stderr, exit code and, if the run ended abnormally, why (timeout, memory, processes, file size, disk, output). " +
	"Each call starts a fresh interpreter, so variables, imports and definitions are NOT kept from earlier calls; " +
	"but every call runs in the same working directory, so files persist: what one call writes (with relative " +
	"paths such as open('data.csv', 'w')) the next call can read, and write_file, read_file and list_files work " +
	"on the same files. Nothing is kept after the session ends. There is no network, and the operator sets limits " +
	"on time, memory, processes and disk for each call, and may limit the session as a whole (its CPU time, its disk). " +
	"Print what you want to see; long output is cut."

// InterpreterDescription is run_python's description when its calls run in
// one session with a live interpreter: variables persist too, until a run
// ends the interpreter.
const InterpreterDescription = "Run Python 3 code in this conversation's live sandbox interpreter, like a notebook " +
	"cell, and get back its stdout, stderr, exit code and, if the run ended abnormally, why (timeout, memory, " +
	"processes, file size, disk, output). Variables, imports and definitions from earlier calls are kept, and so are " +
	"the files of the working directory (use relative paths such as open('data.csv')), which write_file, read_file " +
	"and list_files work on too. A call that times out or hits a limit ends the interpreter: the next call starts a " +
	"fresh one, with the files still there but the variables gone, and the results say so in a note. The value of " +
	"the last expression is not shown: print what you want to see; long output is cut. Nothing is kept after the " +
	"session ends. There is no network, and the operator sets limits on time, memory, processes and disk for each " +
	"call, and may limit the session as a whole (its CPU time, its disk)."

// Descriptions of the file tools.
const (
	WriteFileDescription = "Write a file in the working directory of the sandbox session that run_python's code " +
		"runs in, creating its parent directories and replacing a file of that name. " +
		"\"path\" is relative to the working directory (e.g. \"data.csv\" or \"in/data.csv\"); it must stay inside it. " +
		"\"content\" is the file's text, or, with \"encoding\": \"base64\", its bytes in standard base64. " +
		"The operator's limits on file size and disk apply."
	ReadFileDescription = "Read a file from the working directory of the sandbox session that run_python's code " +
		"runs in. \"path\" is relative to the working directory. A text file comes back as text, a binary file as " +
		"base64; a long file is cut, with a note (read the rest with run_python)."
	ListFilesDescription = "List the files and directories of the working directory of the sandbox session that " +
		"run_python's code runs in, recursively, with their sizes."
)

const writeFileSchema = `{
  "type": "object",
  "properties": {
    "path": {
      "type": "string",
      "description": "The file's path, relative to the working directory, e.g. \"data.csv\"."
    },
    "content": {
      "type": "string",
      "description": "The file's contents: text, or base64 when \"encoding\" is \"base64\"."
    },
    "encoding": {
      "type": "string",
      "enum": ["text", "base64"],
      "description": "How \"content\" is written: \"text\" (the default) or \"base64\" for binary data."
    }
  },
  "required": ["path", "content"],
  "additionalProperties": false
}`

const readFileSchema = `{
  "type": "object",
  "properties": {
    "path": {
      "type": "string",
      "description": "The file's path, relative to the working directory, e.g. \"out.txt\"."
    }
  },
  "required": ["path"],
  "additionalProperties": false
}`

const listFilesSchema = `{
  "type": "object",
  "properties": {},
  "additionalProperties": false
}`

// DefaultMaxFile is the largest file write_file accepts, in bytes (after
// base64 decoding).
const DefaultMaxFile = 1 << 20

// SessionTools returns the tools of a [SessionRunner]: run_python,
// described for a session with or without a live interpreter, and the
// file tools.
func SessionTools(interpreter bool) []Spec {
	desc := SessionDescription
	if interpreter {
		desc = InterpreterDescription
	}
	return []Spec{
		runPythonSpec(desc),
		{Name: WriteFileName, Title: "Write a file in the sandbox session", Description: WriteFileDescription, InputSchema: json.RawMessage(writeFileSchema)},
		{Name: ReadFileName, Title: "Read a file of the sandbox session", Description: ReadFileDescription, InputSchema: json.RawMessage(readFileSchema), ReadOnly: true},
		{Name: ListFilesName, Title: "List the files of the sandbox session", Description: ListFilesDescription, InputSchema: json.RawMessage(listFilesSchema), ReadOnly: true},
	}
}

// SessionRunner runs the tools' calls in one [moat.Session]: run_python runs
// its code in the session, so that the files of one call are there for the
// next (and, with a live interpreter, its variables), and write_file,
// read_file and list_files work on the session's files through [moat.Files].
//
// Its zero value, given a Session, is ready to use. It is safe for
// concurrent use, as every moat.Session is (the session takes its runs in
// turn); its fields must not change while it is in use. It does not close
// the Session.
type SessionRunner struct {
	// Session runs the code and holds the files. It must not be nil.
	Session moat.Session
	// Interpreter must say whether Session was made with
	// moat.SessionOptions.Interpreter: run_python's description tells the
	// model whether its variables persist between calls.
	Interpreter bool
	// MaxCode is the largest program accepted, in bytes. Zero means
	// DefaultMaxCode.
	MaxCode int
	// MaxOutput is how much of each of stdout and stderr a run's text
	// shows, and how much of a file read_file shows, in bytes. Zero means
	// DefaultMaxOutput.
	MaxOutput int
	// MaxFile is the largest file write_file accepts, in bytes. Zero means
	// DefaultMaxFile. The session's own file size and disk limits apply
	// too.
	MaxFile int
	// Logger receives one record per call. Nil means discard.
	Logger *slog.Logger
}

var _ Caller = (*SessionRunner)(nil)

// Tools returns SessionTools(r.Interpreter).
func (r *SessionRunner) Tools() []Spec { return SessionTools(r.Interpreter) }

// CallTool runs one call of run_python or of a file tool; see [Caller].
func (r *SessionRunner) CallTool(ctx context.Context, name string, args json.RawMessage) Outcome {
	log := r.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var out Outcome
	start := time.Now()
	switch name {
	case Name:
		out = r.runPython(ctx, args, log)
	case WriteFileName:
		out = r.writeFile(ctx, args)
	case ReadFileName:
		out = r.readFile(ctx, args)
	case ListFilesName:
		out = r.listFiles(ctx, args)
	default:
		return unknownTool(name, r.Tools())
	}
	out.Tool = name
	if name != Name {
		if out.Err != nil {
			log.Info("tool: failed", "tool", name, "err", out.Err)
		} else {
			log.Info("tool: done", "tool", name, "elapsed", time.Since(start))
		}
	}
	return out
}

func (r *SessionRunner) maxOutput() int { return orDefault(r.MaxOutput, DefaultMaxOutput) }

// runPython runs code in the session. Its text is the result's, with the
// result's notes, which say when a live interpreter was ended or restarted.
func (r *SessionRunner) runPython(ctx context.Context, args json.RawMessage, log *slog.Logger) Outcome {
	code, err := ParseInput(args, r.MaxCode)
	if err != nil {
		log.Info("tool: bad input", "tool", Name, "err", err)
		return failed(err)
	}
	start := time.Now()
	res, err := r.Session.Run(ctx, moat.Request{Code: []byte(code)})
	if err != nil {
		if errors.Is(err, moat.ErrSpent) {
			err = fmt.Errorf("tool: session: %w; run_python runs no more code in this session, while read_file and list_files still work", err)
		} else {
			err = fmt.Errorf("tool: session: %w", err)
		}
		log.Warn("tool: session error", "tool", Name, "code_bytes", len(code), "err", err)
		out := failed(err)
		out.Code = code
		return out
	}
	log.Info("tool: ran", "tool", Name, "level", res.Level, "code_bytes", len(code),
		"exit_code", res.ExitCode, "reason", res.Reason, "notes", len(res.Notes), "elapsed", time.Since(start))
	text := Format(res, r.maxOutput())
	if len(res.Notes) > 0 {
		var b strings.Builder
		for _, n := range res.Notes {
			fmt.Fprintf(&b, "note: %s\n", strings.ToValidUTF8(n, "\uFFFD"))
		}
		text = b.String() + text
	}
	return Outcome{Code: code, Result: res, Text: text}
}

// pathField is the "path" field of the file tools' input.
var pathField = field{name: "path", required: true, what: "the file's path, relative to the working directory"}

// parsePath returns the "path" field, without a leading "./". The session
// checks the rest (see moat.Session).
func parsePath(in map[string]string) (string, error) {
	p := in["path"]
	for strings.HasPrefix(p, "./") {
		p = p[2:]
	}
	if p == "" {
		return "", invalid(`"path" is empty: give a file's path relative to the working directory, e.g. "data.csv"`)
	}
	return p, nil
}

func (r *SessionRunner) writeFile(ctx context.Context, args json.RawMessage) Outcome {
	in, err := parseFields(args, `{"path": "data.csv", "content": "a,b\n1,2\n"}`,
		WriteFileName+` takes "path", "content" and, for binary data, "encoding": "base64"`,
		pathField,
		field{name: "content", required: true, what: `the file's text, or base64 with "encoding": "base64"`},
		field{name: "encoding", what: `"text" or "base64"`})
	if err != nil {
		return failed(err)
	}
	name, err := parsePath(in)
	if err != nil {
		return failed(err)
	}
	data := []byte(in["content"])
	switch enc := in["encoding"]; enc {
	case "", "text":
	case "base64":
		if data, err = decodeBase64(in["content"]); err != nil {
			return failed(invalid(`"content" is not valid base64 (the standard alphabet, A-Z a-z 0-9 + /): ` + err.Error()))
		}
	default:
		return failed(invalid(fmt.Sprintf(`"encoding" must be "text" or "base64", not %q`, enc)))
	}
	if limit := orDefault(r.MaxFile, DefaultMaxFile); len(data) > limit {
		return failed(invalid(fmt.Sprintf(`"content" is %d bytes, over the cap of %d bytes for one file`, len(data), limit)))
	}
	if err := r.Session.WriteFile(ctx, name, bytes.NewReader(data)); err != nil {
		return failed(fileError(name, err))
	}
	return Outcome{Text: fmt.Sprintf("wrote %s (%s)", name, plural(int64(len(data)), "byte"))}
}

// decodeBase64 decodes standard base64, with or without padding, ignoring
// white space.
func decodeBase64(s string) ([]byte, error) {
	s = strings.Map(func(r rune) rune {
		if r == ' ' || r == '\n' || r == '\r' || r == '\t' {
			return -1
		}
		return r
	}, s)
	return base64.RawStdEncoding.DecodeString(strings.TrimRight(s, "="))
}

func (r *SessionRunner) readFile(ctx context.Context, args json.RawMessage) Outcome {
	in, err := parseFields(args, `{"path": "out.txt"}`, ReadFileName+` takes only "path"`, pathField)
	if err != nil {
		return failed(err)
	}
	name, err := parsePath(in)
	if err != nil {
		return failed(err)
	}
	info, err := r.Session.Stat(ctx, name)
	if err != nil {
		return failed(fileError(name, err))
	}
	if info.IsDir {
		return failed(invalid(fmt.Sprintf("%q is a directory, not a file: list_files shows what is in it", name)))
	}
	rc, err := r.Session.ReadFile(ctx, name)
	if err != nil {
		return failed(fileError(name, err))
	}
	defer rc.Close()
	limit := r.maxOutput()
	// One byte more than shown, to know whether the file is longer than
	// what is shown whatever Stat said.
	data, err := io.ReadAll(io.LimitReader(rc, int64(limit)+1))
	if err != nil {
		return failed(fileError(name, err))
	}
	size := max(info.Size, int64(len(data)))
	cut := len(data) > limit
	if cut {
		data = data[:limit]
	}
	if isText(data, cut) {
		shown := data
		if cut {
			for len(shown) > 0 && !utf8.Valid(shown) {
				shown = shown[:len(shown)-1]
			}
		}
		if !cut && int64(len(data)) >= size {
			if len(data) == 0 {
				return Outcome{Text: fmt.Sprintf("%s: empty (0 bytes)", name)}
			}
			return Outcome{Text: fmt.Sprintf("%s: %s of text:\n%s", name, plural(size, "byte"), shown)}
		}
		return Outcome{Text: fmt.Sprintf("%s: %s of text; the first %d are shown:\n%s\n[... the rest is cut; read it with run_python ...]",
			name, plural(size, "byte"), len(shown), strings.TrimSuffix(string(shown), "\n"))}
	}
	raw := data[:min(len(data), limit/4*3)] // its base64 fits in limit
	note := ""
	if int64(len(raw)) < size {
		note = fmt.Sprintf("; the first %d bytes are shown, the rest is cut (read it with run_python)", len(raw))
	}
	return Outcome{Text: fmt.Sprintf("%s: %s, binary, shown as base64%s:\n%s",
		name, plural(size, "byte"), note, base64.StdEncoding.EncodeToString(raw))}
}

// isText says whether data reads as text: UTF-8 without NUL bytes (a rune
// split at the end of a cut file excepted).
func isText(data []byte, cut bool) bool {
	if slices.Contains(data, 0) {
		return false
	}
	if utf8.Valid(data) {
		return true
	}
	if !cut {
		return false
	}
	for i := 1; i < utf8.UTFMax && i <= len(data); i++ {
		if utf8.Valid(data[:len(data)-i]) {
			return true
		}
	}
	return false
}

func (r *SessionRunner) listFiles(ctx context.Context, args json.RawMessage) Outcome {
	if _, err := parseFields(args, `{}`, ListFilesName+" takes no input: send {}"); err != nil {
		return failed(err)
	}
	files, err := r.Session.ListFiles(ctx)
	if err != nil {
		return failed(fmt.Errorf("tool: session: %w", err))
	}
	if len(files) == 0 {
		return Outcome{Text: "the working directory is empty"}
	}
	slices.SortFunc(files, func(a, b moat.FileInfo) int { return strings.Compare(a.Name, b.Name) })
	var b strings.Builder
	fmt.Fprintf(&b, "%s in the working directory:\n", plural(int64(len(files)), "entry"))
	limit := r.maxOutput()
	for i, f := range files {
		var line string
		name := strings.ToValidUTF8(f.Name, "\uFFFD")
		switch {
		case f.IsDir:
			line = name + "/\n"
		case f.Mode&fs.ModeSymlink != 0:
			line = name + " (symbolic link)\n"
		case !f.Mode.IsRegular():
			line = name + " (" + f.Mode.Type().String() + ")\n"
		default:
			line = fmt.Sprintf("%s  %s\n", name, plural(f.Size, "byte"))
		}
		if b.Len()+len(line) > limit {
			fmt.Fprintf(&b, "[... %d more not shown; list them with run_python ...]\n", len(files)-i)
			break
		}
		b.WriteString(line)
	}
	return Outcome{Text: strings.TrimSuffix(b.String(), "\n")}
}

// failed is the Outcome of a call that failed with err.
func failed(err error) Outcome { return Outcome{Err: err, Text: ErrorText(err), IsError: true} }

// fileError says what went wrong with the file name, for the model: a
// missing file, a name the session refused, or a failure of the session.
func fileError(name string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("tool: no file %q in the working directory (list_files shows what is there): %w", name, err)
	case errors.Is(err, moat.ErrInvalid):
		return fmt.Errorf("tool: %q: %w", name, err)
	}
	return fmt.Errorf("tool: session: %w", err)
}

// plural is n and noun, with an s (or ies) unless n is 1.
func plural(n int64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	if s, ok := strings.CutSuffix(noun, "y"); ok {
		return fmt.Sprintf("%d %sies", n, s)
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
