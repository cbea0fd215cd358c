package attack

import (
	"context"
	"fmt"
	"sync"

	"github.com/moatsandbox/moat"
)

// runShared runs the uid_shared_limit attack: two runs in sb at once. The
// hog opens inotify instances until its uid's limit refuses more and holds
// them; once its ready marker has streamed out, the probe asks for one
// instance. The probe got through when it was refused with EMFILE while
// the hog's run still lived: the two runs share a per-uid limit, so one run
// can starve the next. The hog is cancelled once the probe has ended.
func runShared(ctx context.Context, sb moat.Sandbox, o Outcome) Outcome {
	hog, probe := sharedSetup("hog"), sharedSetup("probe")
	hogCtx, stopHog := context.WithCancel(ctx)
	defer stopHog()
	ready := make(chan struct{})
	var once sync.Once
	hogDone := make(chan evidence, 1)
	go func() {
		hogDone <- execute(hogCtx, sb, hog, func() { once.Do(func() { close(ready) }) })
	}()
	select {
	case <-ready:
	case hev := <-hogDone:
		if !hev.ready {
			// The hog's run ended before it was ready: judge it
			// alone (a limit of its own run stopped it, or inotify is
			// denied, or it proves nothing). Its success marker is not
			// the attack's.
			hev.succeeded = false
			out := judge(o, hev, ending{})
			out.Detail = clip("the neighbour's run ended before it was ready: "+out.Detail, 300)
			out.Result = hev.result
			return out
		}
		// Ready, and ended already: the probe proves nothing now, but
		// judgeShared says so.
		hogDone <- hev
	}
	pev := execute(ctx, sb, probe, nil)
	stopHog()
	hev := <-hogDone
	out := judgeShared(o, hev, pev)
	out.Result = pev.result
	return out
}

// sharedSetup returns the setup of one of uid_shared_limit's two runs.
func sharedSetup(role string) *setup {
	nonce := randomText(32)
	return &setup{
		name: UIDSharedLimit,
		p:    params{Nonce: nonce, Tag: "moat" + nonce[:11], Role: role, Max: hogMax, Linger: lingerSeconds},
	}
}

// judgeShared judges uid_shared_limit from the hog's and the probe's
// evidence. The probe's refusal proves a shared limit only if the hog's run
// still lived when the probe's ended; its success proves the limit is not
// shared only if the hog had reached the limit, or its own run's limits
// had stopped it first.
func judgeShared(o Outcome, hog, probe evidence) Outcome {
	held := probe.ended.Before(hog.ended)
	switch {
	case hog.leftovers > 0:
		return o.gotThrough("left running", fmt.Sprintf("%d process(es) of the neighbour's run still alive after its Run returned (killed by the harness)", hog.leftovers))
	case probe.leftovers > 0 || probe.harnessErr != nil:
		return judge(o, probe, ending{})
	case probe.succeeded && held:
		return o.gotThrough("shared limit", clip("while its neighbour "+hogHeld(hog)+", "+probe.okText, 300))
	case probe.succeeded:
		return o.inconclusive("neighbour gone", "the probe was refused an inotify instance, but only after its neighbour's run had ended")
	}
	out := judge(o, probe, ending{noProof: "not shared"})
	if out.Verdict != Blocked {
		return out
	}
	switch {
	case !held:
		return o.inconclusive("neighbour gone", "the neighbour's run ended before the probe's; "+out.Detail)
	case !hog.succeeded && len(hog.errs) > 0 && hog.errs[0].Class == "own_limits":
		// The run's own limits (processes, descriptors) stopped the hog
		// first: no run can hold enough to starve the next.
		return o.blocked("own limits", clip("the neighbour was stopped by its run's own limits ("+hog.errs[0].Detail+") before any shared limit; the probe: "+out.Detail, 300))
	case !hog.succeeded:
		why := "it reported no limit"
		if len(hog.errs) > 0 {
			why = hog.errs[0].Class + ": " + hog.errs[0].Detail
		}
		return o.inconclusive("not exhausted", clip("the neighbour reached no per-uid limit ("+why+"), so the probe's "+out.How+" shows nothing", 300))
	}
	out.Detail = clip("the neighbour "+hogHeld(hog)+"; the probe: "+out.Detail, 300)
	return out
}

func hogHeld(hog evidence) string {
	if hog.okText != "" {
		return hog.okText
	}
	return "held its inotify instances"
}
