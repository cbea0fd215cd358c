// Package attack is moat's scoreboard of hostile programs: six Python
// programs that each try one thing a sandbox must stop, run against any
// [moat.Sandbox] and judged from the outside.
//
// The attacks are the six of the tutorial: an infinite loop, a 512 MiB
// allocation, a flood of 200 processes, a 50 MiB file, reading the invoking
// user's credentials, and reaching a service on the host's loopback
// interface. [Plant] sets up the fake credentials file and the fake service
// the last two look for; [Run] runs one attack and judges it; [Scoreboard]
// and [JSON] print the outcomes; [Breaches] picks the outcomes that
// contradict what a level claims to block.
//
// Every outcome is one of three verdicts. An attack got through when there
// is proof: a success marker that only the running program can produce
// (assembled at run time around a per-run random nonce, so that a traceback
// echoing the source cannot fake it), a token that exists only in the
// planted file or in the service's answer, or a process of the run still
// alive on the host after Run returned. It was blocked when the program
// started and was stopped by an enforced limit or a denial. Anything else
// (the sandbox failed, the program never started, it ended for no reason
// the harness can name) is inconclusive: it proves nothing either way.
//
// Output is judged as it streams through [moat.Request.Stdout] and
// [moat.Request.Stderr], past the part the Result keeps.
package attack

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"

	"github.com/moatsandbox/moat"
)

// Name names an attack.
type Name string

// The attacks.
const (
	Loop        Name = "loop"        // spin forever, ignoring SIGTERM
	Memory      Name = "memory"      // allocate and touch 512 MiB
	ForkFlood   Name = "fork_flood"  // keep 200 processes alive at once
	Disk        Name = "disk"        // write a 50 MiB file
	Credentials Name = "credentials" // read the user's planted credentials
	Network     Name = "network"     // reach a service on the host's loopback
)

// All lists the attacks in the order the scoreboard shows them.
var All = []Name{Loop, Memory, ForkFlood, Disk, Credentials, Network}

// ParseName returns the attack named s, or an error wrapping
// [moat.ErrInvalid].
func ParseName(s string) (Name, error) {
	for _, n := range All {
		if string(n) == s {
			return n, nil
		}
	}
	return "", fmt.Errorf("attack: unknown attack %q (known: loop, memory, fork_flood, disk, credentials, network): %w", s, moat.ErrInvalid)
}

// Verdict is the judgement of one attack at one level.
type Verdict string

// The verdicts.
const (
	Blocked      Verdict = "blocked"      // the program ran and was stopped
	GotThrough   Verdict = "got_through"  // there is proof the attack succeeded
	Inconclusive Verdict = "inconclusive" // the run proves nothing either way
)

// Outcome is the judgement of one attack at one level.
type Outcome struct {
	Level   moat.Level `json:"level"`
	Attack  Name       `json:"attack"`
	Verdict Verdict    `json:"verdict"`
	// Blocked is Verdict == Blocked.
	Blocked bool `json:"blocked"`
	// How is a short, stable phrase: the Result's Reason ("timeout",
	// "memory", "pids", ...) or the denial the program met ("permission
	// denied", "no such file", "network unreachable", ...) when blocked;
	// "not stopped" or "left running" when the sandbox let a process live;
	// why the run proves nothing when inconclusive ("error", "not
	// started", ...).
	How string `json:"how"`
	// Detail says more, for a human: the exit code, what the program
	// reported, the sandbox's error.
	Detail string `json:"detail,omitempty"`
	// Result is what the sandbox returned, or nil.
	Result *moat.Result `json:"-"`
}

// DefaultDeadline bounds an attack when Run's context has no deadline.
const DefaultDeadline = time.Minute

// Run runs the attack name in sb and judges it. env is needed by the
// credentials and network attacks and may be nil for the others.
//
// The attack is bounded by ctx's deadline, or by [DefaultDeadline] when ctx
// has none; the deadline should lie well past the sandbox's wall time. An
// attack that is still running at the deadline was not stopped by the
// sandbox. Cancelling ctx makes the outcome inconclusive.
//
// Run is safe for concurrent use, except that Runs of the network attack
// on one Env take turns.
func Run(ctx context.Context, sb moat.Sandbox, env *Env, name Name) Outcome {
	o := Outcome{Level: sb.Level(), Attack: name}
	p, needles, err := prepare(name, env)
	if err != nil {
		return o.inconclusive("harness", err.Error())
	}
	code, err := source(name, p)
	if err != nil {
		return o.inconclusive("harness", err.Error())
	}
	var connsBefore int64
	if name == Network {
		env.netTurn.Lock()
		defer env.netTurn.Unlock()
		connsBefore = env.conns.Load()
	}

	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultDeadline)
		defer cancel()
	}
	stdout, stderr := newScanner(p.Nonce, needles...), newScanner(p.Nonce, needles...)
	res, runErr := sb.Run(ctx, moat.Request{Code: code, Stdout: stdout, Stderr: stderr})

	ev := evidence{
		result:    res,
		runErr:    runErr,
		deadline:  errors.Is(ctx.Err(), context.DeadlineExceeded),
		canceled:  errors.Is(ctx.Err(), context.Canceled),
		leftovers: reapLeftovers(p.Tag),
	}
	if name == Network {
		ev.connections = env.conns.Load() - connsBefore
	}
	// What the Result kept counts too, should the sandbox not have
	// streamed it.
	scanners := []*scanner{stdout, stderr}
	if res != nil {
		kept, keptErr := newScanner(p.Nonce, needles...), newScanner(p.Nonce, needles...)
		kept.Write(res.Stdout)
		keptErr.Write(res.Stderr)
		scanners = append(scanners, kept, keptErr)
	}
	ev.collect(needles, scanners)
	o = judge(o, ev)
	o.Result = res
	return o
}

// prepare returns the program's parameters and the needles to look for in
// its output: the start marker, the success marker, the end marker and, for
// the attacks judged from the host side, the host's token.
func prepare(name Name, env *Env) (params, []string, error) {
	nonce := randomText(32)
	p := params{Nonce: nonce, Tag: "moat" + nonce[:11]}
	needles := []string{marker(kindStarted, nonce), marker(kindOK, nonce), marker(kindDone, nonce)}
	switch name {
	case Loop:
		p.Linger = lingerSeconds
	case Memory:
		p.MiB = memoryMiB
	case ForkFlood:
		p.Procs, p.Linger = floodProcs, lingerSeconds
	case Disk:
		p.MiB = diskMiB
	case Credentials, Network:
		if env == nil {
			return p, nil, fmt.Errorf("attack: %s needs an Env from Plant", name)
		}
		if name == Credentials {
			p.Path = env.CredentialsPath
			needles = append(needles, env.credToken)
		} else {
			p.Port = env.ServicePort
			needles = append(needles, env.serviceToken)
		}
	default:
		return p, nil, fmt.Errorf("attack: unknown attack %q", name)
	}
	return p, needles, nil
}

// evidence is everything the judge knows about one run.
type evidence struct {
	result      *moat.Result
	runErr      error
	deadline    bool  // the harness's deadline passed
	canceled    bool  // the caller cancelled
	leftovers   int   // processes of the run alive after Run returned
	connections int64 // connections the service accepted during the run

	started, succeeded, done, token bool
	errs                            []errReport
	okText                          string
}

// collect merges what the scanners found. The needles are those of prepare.
func (ev *evidence) collect(needles []string, scanners []*scanner) {
	for _, s := range scanners {
		s.mu.Lock() // against a sandbox that writes after Run returned
		defer s.mu.Unlock()
		s.finish()
		ev.started = ev.started || s.found[0]
		ev.succeeded = ev.succeeded || s.found[1]
		ev.done = ev.done || s.found[2]
		if len(needles) > 3 {
			ev.token = ev.token || s.found[3]
		}
		if len(ev.errs) == 0 {
			ev.errs = s.errs
		}
		if ev.okText == "" {
			ev.okText = s.okText
		}
	}
}

// judge turns the evidence into a verdict. Proof of success comes first:
// it cannot be faked by the program's output or undone by a later failure.
func judge(o Outcome, ev evidence) Outcome {
	res := ev.result
	switch {
	case ev.leftovers > 0:
		return o.gotThrough("left running", fmt.Sprintf("%d process(es) of the run still alive after Run returned (killed by the harness)", ev.leftovers))
	case ev.token:
		return o.gotThrough("", "the host's secret token appeared in the output")
	case ev.succeeded:
		return o.gotThrough("", clip("the program printed its success marker: "+ev.okText, 300))
	case ev.connections > 0:
		return o.gotThrough("connected", fmt.Sprintf("the service accepted %d connection(s) during the run", ev.connections))
	case ev.runErr != nil:
		return o.inconclusive("error", ev.runErr.Error())
	case res == nil:
		return o.inconclusive("error", "the sandbox returned neither a result nor an error")
	case ev.canceled:
		return o.inconclusive("canceled", "the caller cancelled the run")
	case !ev.started:
		return o.inconclusive("not started", describe(res, ev))
	}
	if o.Attack == Loop {
		switch {
		case res.Reason == moat.ReasonTimeout:
			return o.blocked("timeout", describe(res, ev))
		case ev.deadline:
			return o.gotThrough("not stopped", "still running at the harness's deadline; "+describe(res, ev))
		case res.Reason != moat.ReasonNone:
			return o.inconclusive(string(res.Reason), "the loop ended without a timeout; "+describe(res, ev))
		}
		return o.inconclusive("exited", "the loop ended by itself; "+describe(res, ev))
	}
	switch {
	case ev.deadline:
		return o.inconclusive("deadline", "still running at the harness's deadline; "+describe(res, ev))
	case res.Reason != moat.ReasonNone:
		return o.blocked(string(res.Reason), describe(res, ev))
	case len(ev.errs) > 0 && ev.errs[0].Class == "exception":
		return o.inconclusive("probe crashed", describe(res, ev))
	case len(ev.errs) > 0:
		return o.blocked(howOf(ev.errs[0].Class), describe(res, ev))
	case ev.done && (o.Attack == Credentials || o.Attack == Network):
		return o.blocked("no token", "the program ran to its end without the token; "+describe(res, ev))
	}
	return o.inconclusive("no verdict", "no success and no failure reported; "+describe(res, ev))
}

// hows maps the error classes the programs report to the Outcome's How.
// Classes not listed read as themselves, with spaces.
var hows = map[string]string{
	"permission_denied":            "permission denied",
	"file_not_found":               "no such file",
	"network_unreachable":          "network unreachable",
	"host_unreachable":             "host unreachable",
	"address_family_not_supported": "no address family",
	"address_not_available":        "address unavailable",
	"connection_refused":           "connection refused",
	"timed_out":                    "timed out",
	"name_resolution":              "no name resolution",
	"out_of_memory":                "out of memory",
	"resource_unavailable":         "resource limit",
	"fork_refused":                 "fork refused",
	"children_died":                "children died",
	"file_too_large":               "file too large",
	"short_file":                   "short file",
	"no_space":                     "no space",
	"quota_exceeded":               "quota",
	"read_only":                    "read-only",
	"not_implemented":              "not implemented",
	"too_many_files":               "too many files",
}

func howOf(class string) string {
	if h, ok := hows[class]; ok {
		return h
	}
	return strings.ReplaceAll(class, "_", " ")
}

// describe sums a run up in one line: how it ended and the program's first
// error report.
func describe(res *moat.Result, ev evidence) string {
	var parts []string
	if res != nil {
		s := fmt.Sprintf("exit %d", res.ExitCode)
		if res.Reason != moat.ReasonNone {
			s += ", reason " + string(res.Reason)
		}
		if res.Signal != "" {
			s += ", signal " + res.Signal
		}
		parts = append(parts, s)
	}
	if len(ev.errs) > 0 {
		parts = append(parts, ev.errs[0].Class+": "+ev.errs[0].Detail)
	} else if res != nil && !ev.started {
		if line := lastLine(res.Stderr); line != "" {
			parts = append(parts, "stderr: "+line)
		}
	}
	return clip(strings.Join(parts, "; "), 300)
}

// lastLine returns the last non-empty line of b, printable.
func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(strings.ToValidUTF8(string(b), "\uFFFD")), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

// clip cuts s to at most n runes and drops what does not print.
func clip(s string, n int) string {
	s = strings.Map(func(r rune) rune {
		if unicode.IsPrint(r) {
			return r
		}
		return ' '
	}, s)
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

func (o Outcome) blocked(how, detail string) Outcome {
	o.Verdict, o.Blocked, o.How, o.Detail = Blocked, true, how, detail
	return o
}

func (o Outcome) gotThrough(how, detail string) Outcome {
	o.Verdict, o.Blocked, o.How, o.Detail = GotThrough, false, how, detail
	return o
}

func (o Outcome) inconclusive(how, detail string) Outcome {
	o.Verdict, o.Blocked, o.How, o.Detail = Inconclusive, false, how, detail
	return o
}
