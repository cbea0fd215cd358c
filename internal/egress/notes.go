package egress

import (
	"fmt"
	"strings"
	"sync"
)

// maxNoteEntries bounds the destinations a run's note itemizes per
// decision; the rest are counted as "+N more". A sandbox that tries a
// million hosts costs the tally a fixed size.
const maxNoteEntries = 10

// tally counts a run's decisions between two calls of Notes.
type tally struct {
	mu      sync.Mutex
	allowed []*tallyEntry
	denied  []*tallyEntry
	more    [2]int // connections to destinations past maxNoteEntries: allowed, denied
	overCap int    // connections refused over the run's cap
}

// tallyEntry is one destination (and, denied, one reason).
type tallyEntry struct {
	dest   string
	why    string
	count  int
	failed int
}

// add counts d.
func (t *tally) add(d decision) {
	t.mu.Lock()
	defer t.mu.Unlock()
	list, more := &t.allowed, &t.more[0]
	dest, why := clean(d.String()), ""
	if !d.allowed {
		list, more = &t.denied, &t.more[1]
		why = d.why
	}
	var e *tallyEntry
	for _, x := range *list {
		if x.dest == dest && x.why == why {
			e = x
			break
		}
	}
	if e == nil {
		if len(*list) >= maxNoteEntries {
			*more++
			return
		}
		e = &tallyEntry{dest: dest, why: why}
		*list = append(*list, e)
	}
	e.count++
	if d.failed != "" {
		e.failed++
	}
}

// refused counts a connection refused over the cap.
func (t *tally) refused() {
	t.mu.Lock()
	t.overCap++
	t.mu.Unlock()
}

// notes returns the decisions since the last call as one line, and
// forgets them: "network: allowed pypi.test:443 (3 connections); denied
// evil.test:443 (not allowed), 10.0.0.1:80 (an IP address)". Nil when
// there were none.
func (t *tally) notes() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var parts []string
	if len(t.allowed) > 0 {
		items := make([]string, 0, len(t.allowed)+1)
		for _, e := range t.allowed {
			s := fmt.Sprintf("%s (%s", e.dest, plural(e.count, "connection"))
			if e.failed > 0 {
				s += fmt.Sprintf(", %d failed", e.failed)
			}
			items = append(items, s+")")
		}
		if t.more[0] > 0 {
			items = append(items, fmt.Sprintf("+%d more", t.more[0]))
		}
		parts = append(parts, "allowed "+strings.Join(items, ", "))
	}
	if len(t.denied) > 0 {
		items := make([]string, 0, len(t.denied)+1)
		for _, e := range t.denied {
			s := fmt.Sprintf("%s (%s", e.dest, e.why)
			if e.count > 1 {
				s += fmt.Sprintf(", %d times", e.count)
			}
			items = append(items, s+")")
		}
		if t.more[1] > 0 {
			items = append(items, fmt.Sprintf("+%d more", t.more[1]))
		}
		parts = append(parts, "denied "+strings.Join(items, ", "))
	}
	if t.overCap > 0 {
		parts = append(parts, fmt.Sprintf("refused %s over the cap of %d at once", plural(t.overCap, "connection"), maxConns))
	}
	t.allowed, t.denied, t.more, t.overCap = nil, nil, [2]int{}, 0
	if len(parts) == 0 {
		return nil
	}
	return []string{"network: " + strings.Join(parts, "; ")}
}

func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}
