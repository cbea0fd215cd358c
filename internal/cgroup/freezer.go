package cgroup

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// FreezeTimeout bounds how long Freeze and Thaw wait for the kernel to
// report the new state.
const FreezeTimeout = 2 * time.Second

// Freeze freezes every process of the group, those forked meanwhile
// included, and returns once the kernel reports the whole group frozen. From
// then until Thaw none of them runs, whatever it arranged beforehand: a
// signal, SIGCONT included, does not wake a frozen process (on v2 a fatal
// signal still kills it; on v1 it dies once thawed). Freezing a frozen group
// does nothing.
//
// The group must have been made Freezable. Freeze fails when the group is
// not frozen within FreezeTimeout (a process stuck in the kernel); the group
// is then left freezing, and the caller should Kill it.
func (g *Group) Freeze() error {
	return g.setFrozen(true)
}

// Thaw lets the group's processes run again and returns once the kernel
// reports the group thawed. Thawing a thawed group does nothing.
func (g *Group) Thaw() error {
	return g.setFrozen(false)
}

// Frozen reports whether the kernel reports the whole group frozen. A group
// on its way to frozen (v1 "FREEZING") is not.
func (g *Group) Frozen() (bool, error) {
	if !g.freezable {
		return false, fmt.Errorf("cgroup: %s was not made freezable", g.name)
	}
	if g.m.v2 {
		p := filepath.Join(g.dirs[0], "cgroup.events")
		data, err := os.ReadFile(p)
		if err != nil {
			return false, fmt.Errorf("cgroup: %w", err)
		}
		n, ok := findKey(data, "frozen")
		if !ok {
			return false, fmt.Errorf("cgroup: no frozen key in %s", p)
		}
		return n == 1, nil
	}
	state, err := g.freezerState()
	return state == "FROZEN", err
}

// freezerState reads the v1 freezer.state: THAWED, FREEZING or FROZEN.
func (g *Group) freezerState() (string, error) {
	data, err := os.ReadFile(filepath.Join(g.freezer, "freezer.state"))
	if err != nil {
		return "", fmt.Errorf("cgroup: %w", err)
	}
	return strings.TrimSpace(string(data)), nil
}

func (g *Group) setFrozen(frozen bool) error {
	if !g.freezable {
		return fmt.Errorf("cgroup: %s was not made freezable", g.name)
	}
	var err error
	switch {
	case g.m.v2 && frozen:
		err = g.write("cgroup.freeze", "1")
	case g.m.v2:
		err = g.write("cgroup.freeze", "0")
	case frozen:
		err = g.write("freezer.state", "FROZEN")
	default:
		err = g.write("freezer.state", "THAWED")
	}
	if err != nil {
		return err
	}
	// A group of a few processes freezes in microseconds; back off from
	// there.
	deadline := time.Now().Add(FreezeTimeout)
	pause := 20 * time.Microsecond
	for {
		done, err := g.reached(frozen)
		if err != nil {
			return err
		}
		if done {
			return nil
		}
		if time.Now().After(deadline) {
			if frozen {
				return fmt.Errorf("cgroup: %s not frozen after %v", g.name, FreezeTimeout)
			}
			return fmt.Errorf("cgroup: %s not thawed after %v", g.name, FreezeTimeout)
		}
		time.Sleep(pause)
		pause = min(2*pause, 5*time.Millisecond)
	}
}

// reached reports whether the group is wholly frozen (frozen) or wholly
// thawed (!frozen): on v1 a freezing group is neither.
func (g *Group) reached(frozen bool) (bool, error) {
	if g.m.v2 {
		is, err := g.Frozen()
		return is == frozen, err
	}
	state, err := g.freezerState()
	if frozen {
		return state == "FROZEN", err
	}
	return state == "THAWED", err
}
