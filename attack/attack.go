// Package attack is moat's scoreboard of hostile programs: Python programs
// that each try one thing a sandbox must stop, run against any
// [moat.Sandbox] and judged from the outside.
//
// The first six are the tutorial's: an infinite loop, a 512 MiB allocation,
// a flood of 200 processes, a 50 MiB file, reading the invoking user's
// credentials, and reaching a service on the host's loopback interface. The
// others each probe one class of hole a hostile review found: reaching a
// host daemon's unix socket by path (stream and datagram, through a socket
// of the program's own or a re-aimed socketpair end), reaching or binding
// an abstract unix name in the host's network namespace, opening io_uring
// (a second system call interface), creating a vsock socket (vsock ports
// are not namespaced), seeing the host's processes, reading the host's
// network interfaces, and exhausting a per-uid kernel limit that a
// neighbouring run of the same uid shares. [Plant] sets up what the
// host-side attacks look for; [Run] runs one attack and judges it;
// [Scoreboard] and [JSON] print the outcomes; [Breaches] picks the outcomes
// that contradict what a level claims to block.
//
// Every outcome is one of three verdicts. An attack got through when there
// is proof: a success marker that only the running program can produce
// (assembled at run time around a per-run random nonce, so that a traceback
// echoing the source cannot fake it), a token that exists only on the host
// (in the planted file, in the service's answer, in a host process's
// command line, a host interface's address), something the harness sees on
// the host (its socket received the run's greeting, the name the run was to
// bind appeared in the host's namespace, the service accepted a
// connection), or a process of the run still alive on the host after Run
// returned. It was blocked when the program started and was stopped by an
// enforced limit or a denial, or ran to its end without proof where the
// proof is the host's to see. Anything else (the sandbox failed, the
// program never started, it ended for no reason the harness can name) is
// inconclusive: it proves nothing either way.
//
// Output is judged as it streams through [moat.Request.Stdout] and
// [moat.Request.Stderr], past the part the Result keeps.
package attack

import (
	"context"
	"errors"
	"fmt"
	"slices"
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

	UnixPathStream Name = "unix_path_stream" // reach a host unix stream socket by path
	UnixPathDgram  Name = "unix_path_dgram"  // reach a host unix datagram socket by path
	AbstractUnix   Name = "abstract_unix"    // reach an abstract unix name of the host's
	AbstractBind   Name = "abstract_bind"    // bind an abstract unix name in the host's namespace
	IOURing        Name = "io_uring"         // open an io_uring
	Vsock          Name = "vsock"            // create an AF_VSOCK socket (never connected)
	HostProcs      Name = "host_procs"       // see a process of the host's
	HostNet        Name = "host_net"         // read a host interface's MAC address
	UIDSharedLimit Name = "uid_shared_limit" // exhaust a per-uid limit a neighbouring run shares
)

// All lists the attacks in the order the scoreboard shows them.
var All = []Name{Loop, Memory, ForkFlood, Disk, Credentials, Network,
	UnixPathStream, UnixPathDgram, AbstractUnix, AbstractBind, IOURing, Vsock,
	HostProcs, HostNet, UIDSharedLimit}

// ParseName returns the attack named s, or an error wrapping
// [moat.ErrInvalid].
func ParseName(s string) (Name, error) {
	var names []string
	for _, n := range append(append([]Name(nil), All...), EgressAttacks...) {
		if string(n) == s {
			return n, nil
		}
		names = append(names, string(n))
	}
	return "", fmt.Errorf("attack: unknown attack %q (known: %s): %w", s, strings.Join(names, ", "), moat.ErrInvalid)
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
// credentials, network, unix_path_stream, unix_path_dgram and abstract_unix
// attacks and may be nil for the others.
//
// The attack is bounded by ctx's deadline, or by [DefaultDeadline] when ctx
// has none; the deadline should lie well past the sandbox's wall time. An
// attack that is still running at the deadline was not stopped by the
// sandbox. Cancelling ctx makes the outcome inconclusive.
//
// The uid_shared_limit attack is two runs at once in sb: a neighbour that
// exhausts a per-uid limit and holds it, and, while it holds, the probe.
//
// Run is safe for concurrent use, except that Runs of the network attack
// on one Env take turns, and that a Run of uid_shared_limit exhausts, for
// as long as it lasts, a per-uid limit (inotify instances) of the uid the
// sandbox runs code as: other runs of that uid meanwhile may fail to get
// one, and a concurrent Run of uid_shared_limit may be judged wrongly.
func Run(ctx context.Context, sb moat.Sandbox, env *Env, name Name) Outcome {
	o := Outcome{Level: sb.Level(), Attack: name}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultDeadline)
		defer cancel()
	}
	if name == UIDSharedLimit {
		return runShared(ctx, sb, o)
	}
	s, err := prepare(name, env)
	if err != nil {
		return o.inconclusive("harness", err.Error())
	}
	if s.undo != nil {
		defer s.undo()
	}
	ev := execute(ctx, sb, s, nil)
	o = judge(o, ev, s.end)
	o.Result = ev.result
	return o
}

// execute runs the program of s in sb and gathers the evidence. onReady,
// when not nil, is called (once, from the sandbox's writing goroutine) as
// soon as the program's ready marker appears on its stdout.
func execute(ctx context.Context, sb moat.Sandbox, s *setup, onReady func()) evidence {
	code, err := source(s.name, s.p)
	if err != nil {
		return evidence{harnessErr: err}
	}
	nonce := s.p.Nonce
	needles := append([]string{marker(kindStarted, nonce), marker(kindOK, nonce), marker(kindDone, nonce),
		marker(kindReady, nonce)}, s.tokens...)
	stdout, stderr := newScanner(nonce, needles...), newScanner(nonce, needles...)
	if onReady != nil {
		stdout.onFound(needleReady, onReady)
	}
	var end func() (string, string)
	if s.watch != nil {
		end = s.watch()
	}
	res, runErr := sb.Run(ctx, moat.Request{Code: code, Stdout: stdout, Stderr: stderr})
	ev := evidence{
		result:   res,
		runErr:   runErr,
		ended:    time.Now(),
		deadline: errors.Is(ctx.Err(), context.DeadlineExceeded),
		canceled: errors.Is(ctx.Err(), context.Canceled),
	}
	if end != nil {
		ev.hostHow, ev.hostDetail = end()
	}
	ev.leftovers = reapLeftovers(s.p.Tag)
	// What the Result kept counts too, should the sandbox not have
	// streamed it.
	scanners := []*scanner{stdout, stderr}
	if res != nil {
		kept, keptErr := newScanner(nonce, needles...), newScanner(nonce, needles...)
		kept.Write(res.Stdout)
		keptErr.Write(res.Stderr)
		scanners = append(scanners, kept, keptErr)
	}
	ev.collect(scanners)
	return ev
}

// The needles every run's scanners look for, by index; the host's tokens
// follow from needleTokens.
const (
	needleStarted = iota
	needleOK
	needleDone
	needleReady
	needleTokens
)

// evidence is everything the judge knows about one run.
type evidence struct {
	harnessErr error // the harness could not run the program
	result     *moat.Result
	runErr     error
	ended      time.Time // when the sandbox's Run returned
	deadline   bool      // the harness's deadline passed
	canceled   bool      // the caller cancelled
	leftovers  int       // processes of the run alive after Run returned
	// hostHow and hostDetail are the host-side proof that the attack got
	// through, when the harness saw one.
	hostHow, hostDetail string

	started, succeeded, done, ready, token bool
	errs                                   []errReport
	okText                                 string
}

// collect merges what the scanners found.
func (ev *evidence) collect(scanners []*scanner) {
	for _, s := range scanners {
		s.mu.Lock() // against a sandbox that writes after Run returned
		defer s.mu.Unlock()
		s.finish()
		ev.started = ev.started || s.found[needleStarted]
		ev.succeeded = ev.succeeded || s.found[needleOK]
		ev.done = ev.done || s.found[needleDone]
		ev.ready = ev.ready || s.found[needleReady]
		for _, f := range s.found[needleTokens:] {
			ev.token = ev.token || f
		}
		if len(ev.errs) == 0 {
			ev.errs = s.errs
		}
		if ev.okText == "" {
			ev.okText = s.okText
		}
	}
}

// An ending says what a program that ran to its end without proof means.
type ending struct {
	// noProof is the How of such an end; "" when it proves nothing.
	noProof string
	// overErrs is set for the probes that try several ways and whose
	// proof is the host's to see: an end (the program exits 3 instead
	// when every way failed) means some way seemed to work inside the
	// sandbox, yet the host saw nothing, so the end outranks the errors
	// of the ways that failed.
	overErrs bool
}

// judge turns the evidence into a verdict. Proof of success comes first:
// it cannot be faked by the program's output or undone by a later failure.
// end says what a program that ran to its end without proof means.
func judge(o Outcome, ev evidence, end ending) Outcome {
	res := ev.result
	switch {
	case ev.harnessErr != nil:
		return o.inconclusive("harness", ev.harnessErr.Error())
	case ev.leftovers > 0:
		return o.gotThrough("left running", fmt.Sprintf("%d process(es) of the run still alive after Run returned (killed by the harness)", ev.leftovers))
	case ev.token:
		return o.gotThrough("", "the host's secret token appeared in the output")
	case ev.succeeded:
		return o.gotThrough("", clip("the program printed its success marker: "+ev.okText, 300))
	case ev.hostHow != "":
		return o.gotThrough(ev.hostHow, ev.hostDetail)
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
	case len(ev.errs) > 0 && ev.errs[0].Class == "exception",
		end.overErrs && slices.ContainsFunc(ev.errs, func(e errReport) bool { return e.Class == "exception" }):
		return o.inconclusive("probe crashed", describe(res, ev))
	case ev.done && end.overErrs && end.noProof != "":
		return o.blocked(end.noProof, "the program ran to its end without proof; "+describe(res, ev))
	case len(ev.errs) > 0:
		return o.blocked(howOf(ev.errs[0].Class), describe(res, ev))
	case ev.done && end.noProof != "":
		return o.blocked(end.noProof, "the program ran to its end without proof; "+describe(res, ev))
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
