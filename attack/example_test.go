package attack_test

import (
	"fmt"
	"os"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/attack"
)

// Outcomes as Run returns them, for two levels.
var outcomes = []attack.Outcome{
	{Level: moat.LevelSubprocess, Attack: attack.Loop, Verdict: attack.Blocked, Blocked: true, How: "timeout"},
	{Level: moat.LevelSubprocess, Attack: attack.Network, Verdict: attack.Blocked, Blocked: true, How: "permission denied"},
	{Level: moat.LevelContainer, Attack: attack.Loop, Verdict: attack.Blocked, Blocked: true, How: "timeout"},
	{Level: moat.LevelContainer, Attack: attack.Network, Verdict: attack.GotThrough},
}

func ExampleScoreboard() {
	attack.Scoreboard(os.Stdout, outcomes)
	// Output:
	// attack    subprocess                    container
	// loop      blocked (timeout)             blocked (timeout)
	// network   blocked (permission denied)   GOT THROUGH
	// blocked   2/2                           1/2
}

func ExampleBreaches() {
	// The container level, as configured, claims to block the loop only.
	claims := func(l moat.Level, a attack.Name) bool {
		return l == moat.LevelSubprocess || a == attack.Loop
	}
	for _, o := range attack.Breaches(outcomes, claims) {
		fmt.Println(o.Level, o.Attack, o.Verdict)
	}
	fmt.Println(len(attack.Breaches(outcomes, nil)), "breach(es) if every level claimed everything")
	// Output:
	// 1 breach(es) if every level claimed everything
}
