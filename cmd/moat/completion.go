package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
)

func init() {
	commandUsage["completion"] = `moat completion bash|zsh

Prints a completion script for the shell. Load it with
  source <(moat completion bash)        # in ~/.bashrc
  source <(moat completion zsh)         # in ~/.zshrc, after compinit`
}

// cmdCompletion prints a shell completion script. Its commands are
// commands(), and each command's flags are those its own flag set prints
// for -h: a flag added to a command is completed with nothing more to do.
func cmdCompletion(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("completion")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	if fs.NArg() != 1 || (fs.Arg(0) != "bash" && fs.Arg(0) != "zsh") {
		fmt.Fprintln(stdio.Err, "moat: completion: want one shell, bash or zsh (moat completion bash)")
		return exitUsage
	}
	specs := completionSpecs(ctx)
	if fs.Arg(0) == "bash" {
		writeBash(stdio.Out, specs)
	} else {
		writeZsh(stdio.Out, specs)
	}
	return exitOK
}

// completionSpec is what the scripts complete for one command.
type completionSpec struct {
	name, usage string
	flags       []string // with their dashes: -c, --json
	subcommands []string // moat session's
}

func completionSpecs(ctx context.Context) []completionSpec {
	var out []completionSpec
	for _, c := range commands() {
		s := completionSpec{name: c.name, usage: c.usage}
		switch c.name {
		case "completion":
			s.subcommands = []string{"bash", "zsh"}
		case "image":
			// Its flags are its subcommands'.
			s.subcommands = []string{"build", "status"}
			s.flags = union(commandFlags(ctx, c, "build"), commandFlags(ctx, c, "status"))
		case "session":
			s.flags = commandFlags(ctx, c)
			s.subcommands = usageCommands(commandUsage["session"])
		default:
			s.flags = commandFlags(ctx, c)
		}
		out = append(out, s)
	}
	return out
}

// commandFlags are the flags c's flag set lists for -h (after args, a
// subcommand), which parses nothing else and runs nothing. Deprecated
// spellings are left out.
func commandFlags(ctx context.Context, c command, args ...string) []string {
	var out strings.Builder
	c.run(ctx, append(args, "-h"), Stdio{In: strings.NewReader(""), Out: &out, Err: io.Discard})
	lines := strings.Split(out.String(), "\n")
	var flags []string
	for i, line := range lines {
		if !strings.HasPrefix(line, "  -") {
			continue
		}
		head, desc, oneLine := strings.Cut(line, "\t")
		if !oneLine && i+1 < len(lines) {
			desc = strings.TrimSpace(lines[i+1])
		}
		if strings.HasPrefix(desc, deprecatedPrefix) {
			continue
		}
		name := strings.Fields(head)[0][1:]
		if len(name) == 1 {
			flags = append(flags, "-"+name)
		} else {
			flags = append(flags, "--"+name)
		}
	}
	sort.Strings(flags)
	return flags
}

// usageCommands are the subcommands a usage text lists under "Commands":
// the first word of each line indented by two spaces.
func usageCommands(usage string) []string {
	var out []string
	_, list, _ := strings.Cut(usage, "Commands")
	for _, line := range strings.Split(list, "\n") {
		if rest, ok := strings.CutPrefix(line, "  "); ok && rest != "" && rest[0] >= 'a' && rest[0] <= 'z' {
			out = append(out, strings.Fields(rest)[0])
		}
	}
	return out
}

// Values of flags the scripts complete from a list, not from files.
var completionValues = map[string]string{
	"--level":     "subprocess container gvisor microvm",
	"--hardening": "strict tutorial",
}

func writeBash(w io.Writer, specs []completionSpec) {
	var names []string
	for _, s := range specs {
		names = append(names, s.name)
	}
	fmt.Fprintf(w, `# bash completion for moat. Load it with: source <(moat completion bash)
_moat() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"
    if [[ $COMP_CWORD -eq 1 ]]; then
        COMPREPLY=($(compgen -W %q -- "$cur"))
        return
    fi
    case "$prev" in
`, strings.Join(append(names, "help", "--version", "--help"), " "))
	for _, f := range sortedKeys(completionValues) {
		fmt.Fprintf(w, "        %s) COMPREPLY=($(compgen -W %q -- \"$cur\")); return ;;\n", f, completionValues[f])
	}
	fmt.Fprintf(w, "    esac\n    local flags=\"\" subs=\"\"\n    case \"${COMP_WORDS[1]}\" in\n")
	for _, s := range specs {
		fmt.Fprintf(w, "        %s) flags=%q", s.name, strings.Join(s.flags, " "))
		if len(s.subcommands) > 0 {
			fmt.Fprintf(w, "; subs=%q", strings.Join(s.subcommands, " "))
		}
		fmt.Fprintf(w, " ;;\n")
	}
	fmt.Fprint(w, `    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$flags" -- "$cur"))
        return
    fi
    if [[ -n $subs ]]; then
        local i
        for ((i = 2; i < COMP_CWORD; i++)); do
            [[ ${COMP_WORDS[i]} != -* ]] && return
        done
        COMPREPLY=($(compgen -W "$subs" -- "$cur"))
    fi
}
complete -o default -F _moat moat
`)
}

func writeZsh(w io.Writer, specs []completionSpec) {
	fmt.Fprint(w, `#compdef moat
# zsh completion for moat. Load it with: source <(moat completion zsh)
# (after compinit), or save it as _moat in a directory of $fpath.
_moat() {
    local -a cmds flags subs
    cmds=(
`)
	for _, s := range specs {
		fmt.Fprintf(w, "        %s\n", zshQuote(s.name+":"+s.usage))
	}
	fmt.Fprint(w, `    )
    if (( CURRENT == 2 )); then
        _describe -t commands 'moat command' cmds
        return
    fi
    case $words[CURRENT-1] in
`)
	for _, f := range sortedKeys(completionValues) {
		fmt.Fprintf(w, "        %s) compadd -- %s; return ;;\n", f, completionValues[f])
	}
	fmt.Fprint(w, "    esac\n    case $words[2] in\n")
	for _, s := range specs {
		fmt.Fprintf(w, "        %s) flags=(%s)", s.name, strings.Join(s.flags, " "))
		if len(s.subcommands) > 0 {
			fmt.Fprintf(w, "; subs=(%s)", strings.Join(s.subcommands, " "))
		}
		fmt.Fprint(w, " ;;\n")
	}
	fmt.Fprint(w, `    esac
    if [[ $PREFIX == -* ]]; then
        compadd -- $flags
        return
    fi
    if (( $#subs )) && (( ${#${(@)words[3,CURRENT-1]:#-*}} == 0 )); then
        compadd -- $subs
        return
    fi
    _files
}
if [[ $funcstack[1] == _moat ]]; then
    _moat "$@"
else
    compdef _moat moat
fi
`)
}

// zshQuote quotes s for zsh in single quotes, with ":" escaped as
// _describe wants it in the description.
func zshQuote(s string) string {
	name, desc, _ := strings.Cut(s, ":")
	return "'" + strings.ReplaceAll(name+":"+strings.ReplaceAll(desc, ":", `\:`), "'", `'\''`) + "'"
}

func union(a, b []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range append(a, b...) {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	sort.Strings(out)
	return out
}

func sortedKeys(m map[string]string) []string {
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
