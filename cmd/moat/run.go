package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/moatsandbox/moat"
)

func init() {
	commandUsage["run"] = `moat run [flags] (-c CODE | FILE | -) [ARG...] [-- ARG...]

Flags may come before or after FILE. The arguments after FILE, and all
those after --, are the code's: sys.argv[1:] (sys.argv[0] is FILE's base
name, "-c" for -c, "-" for code read from standard input). An argument for
the code that starts with - goes after --; with -c, all of them do.`
}

// runOptions is what moat run was asked, flags and arguments parsed.
type runOptions struct {
	asJSON bool
	// src is the code, name what its tracebacks call it (FILE's base name,
	// "<string>" for -c, "<stdin>" for -), argv the code's sys.argv.
	src  []byte
	name string
	argv []string
	// stdin is the path given to --stdin ("-" for moat's own standard
	// input), files the --file values, out the --out directory.
	stdin string
	files []inputFile
	out   string
	force bool
}

// needsSession says whether the run needs a session of the level: a
// working directory that outlives the run, to put files in before it or
// take them out after it.
func (o *runOptions) needsSession() bool {
	return o.stdin != "" || len(o.files) > 0 || o.out != ""
}

func cmdRun(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("run")
	sf := addSandboxFlags(fs)
	code := fs.String("c", "", "the code to run")
	asJSON := fs.Bool("json", false, "print one JSON object: level, stdout, stderr, exit_code, duration_ms, reason, truncated (and out_files with --out); an error is {\"error\":{\"code\",\"message\"}}")
	stdinPath := fs.String("stdin", "", "a file that is the code's standard input, or - for moat's own (at most limits.file_size, 16MiB by default)")
	var files fileList
	fs.Var(&files, "file", "SRC[:DST]: put the local file SRC in the code's working directory as DST (relative, default SRC's base name); repeatable")
	outDir := fs.String("out", "", "after the run, copy the files it wrote in its working directory into this directory (created if missing); see --force")
	force := fs.Bool("force", false, "with --out, replace files that are already in the directory (without it, moat refuses and copies nothing)")

	flagArgs, positional, codeArgs := splitRunArgs(fs, args)
	// The flag package's own messages are caught here and re-emitted: as
	// JSON with --json, and with a hint when a flag moat does not have
	// may have been meant for the code.
	parseStdio := stdio
	var parseErr bytes.Buffer
	parseStdio.Err = &parseErr
	if c, ok := parseFlags(fs, flagArgs, parseStdio); !ok {
		msg := strings.TrimSpace(parseErr.String())
		if c == exitOK {
			return c
		}
		if _, name, ok := strings.Cut(msg, "flag provided but not defined: "); ok {
			msg += fmt.Sprintf(" (an argument for the code that starts with - goes after --: moat run FILE -- %s)", strings.Fields(name)[0])
		}
		if wantsJSON(flagArgs) {
			return printJSONError(stdio, c, "invalid", msg)
		}
		fmt.Fprintln(stdio.Err, "moat: run: "+oneLine(strings.TrimPrefix(msg, "moat: ")))
		return c
	}
	io.Copy(stdio.Err, &parseErr) // warnings, such as a deprecated spelling
	fail := func(err error) int {
		if *asJSON {
			return jsonErrorFor(stdio, err)
		}
		return exitFor(stdio, err)
	}
	codeSet := setFlags(fs)["c"]
	o, err := runRequest(codeSet, *code, positional, codeArgs, stdio.In)
	if err != nil {
		return fail(err)
	}
	o.asJSON = *asJSON
	o.stdin, o.files, o.out, o.force = *stdinPath, files, *outDir, *force
	fc, err := sf.resolve()
	if err != nil {
		return fail(err)
	}
	in, err := o.prepareInputs(stdio.In, fc.Limits.WithDefaults())
	if err != nil {
		return fail(err)
	}
	warnHardening(stdio, fc, fc.Level)
	sb, err := openLevel(ctx, fc, fc.Level)
	if err != nil {
		return fail(err)
	}
	defer sb.Close()

	req := moat.Request{}
	if !o.asJSON {
		// Stream the code's output as it comes: the sandbox passes on only
		// what is under the output cap, and ends the run past it.
		req.Stdout, req.Stderr = stdio.Out, stdio.Err
	}
	var res *moat.Result
	var copied []string
	var outErr error
	if o.needsSession() {
		res, copied, outErr, err = runInSession(ctx, sb, req, o, in, fc.Limits.WithDefaults())
	} else {
		req.Code = wrapCode(o.src, o.name, o.argv, "")
		res, err = sb.Run(ctx, req)
	}
	if err != nil {
		return fail(err)
	}
	if o.asJSON {
		return printJSONResult(stdio, res, o.out != "", copied, outErr)
	}
	if note := endNote(res, fc.Limits.WithDefaults()); note != "" {
		if res.Reason == moat.ReasonOutput {
			fmt.Fprintln(stdio.Err)
		}
		fmt.Fprintf(stdio.Err, "moat: %s\n", note)
	}
	if res.ExitCode != 0 {
		// A failed run's notes may say why (a hint like the noexec one):
		// the JSON carries them always, plain mode when they may help.
		for _, n := range res.Notes {
			fmt.Fprintf(stdio.Err, "moat: note: %s\n", n)
		}
	}
	if outErr != nil {
		return exitFor(stdio, outErr)
	}
	return res.ExitCode
}

// splitRunArgs sorts moat run's arguments into the flags (with their
// values), the positional arguments before "--" and those after it. A flag
// is recognised anywhere before "--": an argument that starts with "-" (and
// is not "-" alone) is a flag, and when fs has it as a flag that is not a
// boolean and its value is not given with "=", the next argument is its
// value. Unknown flags are left among the flags, for the flag package to
// refuse.
func splitRunArgs(fs *flag.FlagSet, args []string) (flags, positional, afterDashes []string) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			return flags, positional, append([]string{}, args[i+1:]...)
		case len(a) > 1 && a[0] == '-':
			flags = append(flags, a)
			name := strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-")
			if strings.Contains(name, "=") {
				continue
			}
			f := fs.Lookup(name)
			if f == nil {
				continue
			}
			if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
				continue
			}
			if i+1 < len(args) {
				i++
				flags = append(flags, args[i])
			}
		default:
			positional = append(positional, a)
		}
	}
	return flags, positional, nil
}

// wantsJSON says whether the flags ask for --json, before they are parsed:
// the parse's own errors are JSON then too.
func wantsJSON(flags []string) bool {
	on := false
	for _, a := range flags {
		name, val, hasVal := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		if name == "json" {
			on = !hasVal || val == "true" || val == "1" || val == "t" || val == "T" || val == "TRUE" || val == "True"
		}
	}
	return on
}

// runRequest reads the code and makes the code's argv: from -c, a FILE,
// or standard input ("-").
func runRequest(codeSet bool, code string, positional, codeArgs []string, stdin io.Reader) (*runOptions, error) {
	o := &runOptions{}
	switch {
	case codeSet && len(positional) > 0:
		return nil, fmt.Errorf("run: give the code either with -c or as a file, not both (arguments for -c's code go after --: moat run -c CODE -- %s): %w", positional[0], moat.ErrInvalid)
	case codeSet:
		o.src, o.name = []byte(code), "<string>"
		o.argv = append([]string{"-c"}, codeArgs...)
	case len(positional) == 0:
		return nil, fmt.Errorf("run: no code: give -c CODE, a FILE, or - for standard input: %w", moat.ErrInvalid)
	case positional[0] == "-":
		b, err := io.ReadAll(stdin)
		if err != nil {
			return nil, fmt.Errorf("run: reading standard input: %w", err)
		}
		o.src, o.name = b, "<stdin>"
		o.argv = append(append([]string{"-"}, positional[1:]...), codeArgs...)
	default:
		b, err := os.ReadFile(positional[0])
		if err != nil {
			return nil, fmt.Errorf("run: %w: %w", err, moat.ErrInvalid)
		}
		o.src, o.name = b, filepath.Base(positional[0])
		o.argv = append(append([]string{o.name}, positional[1:]...), codeArgs...)
	}
	if len(o.src) == 0 {
		return nil, fmt.Errorf("run: the code is empty: %w", moat.ErrInvalid)
	}
	return o, nil
}

// endNote says in one line why a run ended abnormally, naming the limit
// that ended it and its value, or "" when the code simply exited.
func endNote(res *moat.Result, lim moat.Limits) string {
	exit := fmt.Sprintf("(exit %d)", res.ExitCode)
	switch res.Reason {
	case moat.ReasonNone:
		return ""
	case moat.ReasonOutput:
		var cut []string
		if int64(len(res.Stdout)) >= int64(lim.Output) {
			cut = append(cut, "stdout")
		}
		if int64(len(res.Stderr)) >= int64(lim.Output) {
			cut = append(cut, "stderr")
		}
		where := ""
		if len(cut) > 0 {
			where = " on " + strings.Join(cut, " and ")
		}
		return fmt.Sprintf("output cut at %s%s (limits.output, --output): the run was ended there %s", lim.Output, where, exit)
	case moat.ReasonTimeout:
		return fmt.Sprintf("run ended: timeout: it passed its wall time (%s, --wall-time) or its CPU time (%s, --cpu-time) %s", lim.WallTime, lim.CPUTime, exit)
	case moat.ReasonMemory:
		return fmt.Sprintf("run ended: memory: it reached the memory limit (%s, --memory) %s", lim.Memory, exit)
	case moat.ReasonPids:
		return fmt.Sprintf("run ended: pids: a fork or a thread was refused at the process limit (%d, --pids) %s", lim.Pids, exit)
	case moat.ReasonFileSize:
		return fmt.Sprintf("run ended: filesize: a file reached the file size limit (%s, --file-size) %s", lim.FileSize, exit)
	case moat.ReasonDisk:
		return fmt.Sprintf("run ended: disk: its files reached the disk limit (%s, --disk) %s", lim.Disk, exit)
	case moat.ReasonSignal:
		return fmt.Sprintf("run ended: signal: killed by %s %s", res.Signal, exit)
	}
	return fmt.Sprintf("run ended: %s %s", res.Reason, exit)
}

// jsonError is what moat run --json prints for an error: one object,
// {"error": {"code": ..., "message": ...}}.
type jsonError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// errorCode is the stable code of err in a JSON error: "invalid" for bad
// input (exit 2), "unavailable" for a level that cannot apply its
// protections here (exit 125), "internal" for moat's own failures (125).
func errorCode(err error) string {
	switch {
	case errors.Is(err, moat.ErrInvalid):
		return "invalid"
	case errors.Is(err, moat.ErrUnavailable):
		return "unavailable"
	}
	return "internal"
}

// jsonErrorFor prints err as a JSON error and returns the exit status
// exitFor would.
func jsonErrorFor(stdio Stdio, err error) int {
	status := exitInternal
	if errors.Is(err, moat.ErrInvalid) {
		status = exitUsage
	}
	return printJSONError(stdio, status, errorCode(err), err.Error())
}

func printJSONError(stdio Stdio, status int, code, msg string) int {
	msg = oneLine(msg)
	if !strings.HasPrefix(msg, "moat: ") {
		msg = "moat: " + msg
	}
	json.NewEncoder(stdio.Out).Encode(map[string]jsonError{"error": {code, msg}})
	return status
}

// printJSONResult prints the one object of moat run --json: the Result,
// with out_files (the files --out copied, when it was given) and error
// (when copying them failed: the exit status is then the error's).
func printJSONResult(stdio Stdio, res *moat.Result, withOut bool, copied []string, outErr error) int {
	b, err := json.Marshal(res)
	if err != nil {
		return jsonErrorFor(stdio, fmt.Errorf("run: %w", err))
	}
	status := res.ExitCode
	var extra []string
	if withOut {
		if copied == nil {
			copied = []string{}
		}
		f, _ := json.Marshal(copied)
		extra = append(extra, `"out_files":`+string(f))
	}
	if outErr != nil {
		status = exitInternal
		if errors.Is(outErr, moat.ErrInvalid) {
			status = exitUsage
		}
		e, _ := json.Marshal(jsonError{errorCode(outErr), "moat: " + oneLine(outErr.Error())})
		extra = append(extra, `"error":`+string(e))
	}
	if len(extra) > 0 {
		b = append(append(b[:len(b)-1], ','), strings.Join(extra, ",")+"}"...)
	}
	stdio.Out.Write(append(b, '\n'))
	return status
}

// readCode takes the code from -c, a file, or standard input ("-"): what
// moat session run reads.
func readCode(fs *flag.FlagSet, codeSet bool, code string, stdin io.Reader) ([]byte, error) {
	rest := fs.Args()
	var src []byte
	switch {
	case codeSet && len(rest) > 0:
		return nil, fmt.Errorf("give the code either with -c or as a file, not both: %w", moat.ErrInvalid)
	case codeSet:
		src = []byte(code)
	case len(rest) > 1:
		return nil, fmt.Errorf("one file at a time (got %d): %w", len(rest), moat.ErrInvalid)
	case len(rest) == 1 && rest[0] == "-":
		b, err := io.ReadAll(stdin)
		if err != nil {
			return nil, fmt.Errorf("reading standard input: %w", err)
		}
		src = b
	case len(rest) == 1:
		b, err := os.ReadFile(rest[0])
		if err != nil {
			return nil, moat.Invalid(err)
		}
		src = b
	default:
		return nil, fmt.Errorf("no code: give -c CODE, a FILE, or - for standard input: %w", moat.ErrInvalid)
	}
	if len(src) == 0 {
		return nil, fmt.Errorf("the code is empty: %w", moat.ErrInvalid)
	}
	return src, nil
}
