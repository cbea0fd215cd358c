package attack

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/moatsandbox/moat"
)

// Scoreboard writes outcomes as a text table: one row per attack, one column
// per level, each cell the verdict ("blocked (timeout)", "GOT THROUGH",
// "inconclusive (not started)"), and a last row counting, per level, the
// attacks blocked out of those run. Levels appear lightest first, attacks
// in the order of [All]; a cell with no outcome reads "-".
func Scoreboard(w io.Writer, outcomes []Outcome) error {
	levels, attacks := axes(outcomes)
	cells := make(map[moat.Level]map[Name]Outcome)
	for _, o := range outcomes {
		if cells[o.Level] == nil {
			cells[o.Level] = make(map[Name]Outcome)
		}
		cells[o.Level][o.Attack] = o
	}
	tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)
	row := func(cols ...string) { fmt.Fprintln(tw, strings.Join(cols, "\t")) }
	head := []string{"attack"}
	for _, l := range levels {
		head = append(head, string(l))
	}
	row(head...)
	for _, a := range attacks {
		cols := []string{string(a)}
		for _, l := range levels {
			o, ok := cells[l][a]
			if !ok {
				cols = append(cols, "-")
				continue
			}
			cols = append(cols, cell(o))
		}
		row(cols...)
	}
	total := []string{"blocked"}
	for _, l := range levels {
		blocked := 0
		for _, o := range cells[l] {
			if o.Verdict == Blocked {
				blocked++
			}
		}
		total = append(total, fmt.Sprintf("%d/%d", blocked, len(cells[l])))
	}
	row(total...)
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("attack: scoreboard: %w", err)
	}
	return nil
}

// cell is the text of one cell of the scoreboard.
func cell(o Outcome) string {
	v := string(o.Verdict)
	if o.Verdict == GotThrough {
		v = "GOT THROUGH"
	}
	if o.How != "" {
		v += " (" + o.How + ")"
	}
	return v
}

// axes returns the levels (lightest first, unknown ones after in order of
// appearance) and the attacks (in the order of All, unknown ones after)
// that outcomes cover.
func axes(outcomes []Outcome) ([]moat.Level, []Name) {
	var levels []moat.Level
	var attacks []Name
	for _, o := range outcomes {
		if !slices.Contains(levels, o.Level) {
			levels = append(levels, o.Level)
		}
		if !slices.Contains(attacks, o.Attack) {
			attacks = append(attacks, o.Attack)
		}
	}
	rank := func(known []string, s string) int {
		if i := slices.Index(known, s); i >= 0 {
			return i
		}
		return len(known)
	}
	var knownLevels, knownAttacks []string
	for _, l := range moat.Levels {
		knownLevels = append(knownLevels, string(l))
	}
	for _, a := range All {
		knownAttacks = append(knownAttacks, string(a))
	}
	slices.SortStableFunc(levels, func(a, b moat.Level) int {
		return rank(knownLevels, string(a)) - rank(knownLevels, string(b))
	})
	slices.SortStableFunc(attacks, func(a, b Name) int {
		return rank(knownAttacks, string(a)) - rank(knownAttacks, string(b))
	})
	return levels, attacks
}

// JSON writes outcomes as one JSON object:
//
//	{"results": [{"level": "subprocess", "attack": "loop", "verdict": "blocked",
//	              "blocked": true, "how": "timeout", "detail": "exit 137, ..."}, ...]}
//
// in the order given. "detail" is left out when empty.
func JSON(w io.Writer, outcomes []Outcome) error {
	if outcomes == nil {
		outcomes = []Outcome{}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(struct {
		Results []Outcome `json:"results"`
	}{outcomes}); err != nil {
		return fmt.Errorf("attack: json: %w", err)
	}
	return nil
}

// Claims says whether a level, as configured, claims to block an attack.
// The CLI knows the configuration and builds it; nil means every level
// claims to block every attack.
type Claims func(level moat.Level, attack Name) bool

// Breaches returns the outcomes that contradict a claim: attacks a level
// claims to block that got through, or whose outcome is inconclusive (a
// claim nobody could check is not kept). An empty result means every claim
// held; a caller exits non-zero otherwise.
func Breaches(outcomes []Outcome, claims Claims) []Outcome {
	var out []Outcome
	for _, o := range outcomes {
		if claims != nil && !claims(o.Level, o.Attack) {
			continue
		}
		if o.Verdict != Blocked {
			out = append(out, o)
		}
	}
	return out
}
