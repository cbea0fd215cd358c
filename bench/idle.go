package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
)

// IdleCost is what n idle sessions of one kind held of the host's memory.
type IdleCost struct {
	Level       moat.Level `json:"level"`
	Interpreter bool       `json:"interpreter"`
	Sessions    int        `json:"sessions"`
	// PerSession is the growth of the host's used memory (MemTotal minus
	// MemAvailable in /proc/meminfo) divided by Sessions, in bytes.
	PerSession int64 `json:"per_session_bytes"`
	// PerGiB is how many such sessions fit in 1 GiB of host memory.
	PerGiB int `json:"per_gib"`
}

// MeasureIdle opens n sessions of sb (each after one run, so that an
// interpreter is alive and the instance has done its work once), lets them
// sit idle, and reports how much host memory they hold, from the host's own
// accounting: what the sessions' processes, containers, sandboxes or VMs
// use, page cache they pinned and the kernel's own structures for them
// together. It closes the sessions before it returns. The figure is noisy
// (other processes allocate meanwhile): compare levels measured in one run.
func MeasureIdle(ctx context.Context, sb moat.Sandbox, n int, interpreter bool) (IdleCost, error) {
	c := IdleCost{Level: sb.Level(), Interpreter: interpreter, Sessions: n}
	ser, ok := sb.(moat.Sessioner)
	if !ok || n <= 0 {
		return c, fmt.Errorf("bench: %s keeps no sessions, or n=%d: %w", sb.Level(), n, moat.ErrInvalid)
	}
	before, err := usedMemory()
	if err != nil {
		return c, err
	}
	var open []moat.Session
	defer func() {
		for _, s := range open {
			s.Close()
		}
	}()
	for i := 0; i < n; i++ {
		s, err := ser.NewSession(ctx, moat.SessionOptions{Interpreter: interpreter})
		if err != nil {
			return c, fmt.Errorf("bench: %s: session %d of %d: %w", sb.Level(), i+1, n, err)
		}
		open = append(open, s)
		if res, err := s.Run(ctx, moat.Request{Code: []byte(Code)}); err != nil || string(res.Stdout) != Want {
			return c, fmt.Errorf("bench: %s: a run in session %d: %v %w", sb.Level(), i+1, res, errors.Join(err, errors.New("wrong result")))
		}
	}
	select {
	case <-time.After(2 * time.Second): // the runs' transient memory goes back
	case <-ctx.Done():
		return c, ctx.Err()
	}
	after, err := usedMemory()
	if err != nil {
		return c, err
	}
	c.PerSession = max(after-before, 0) / int64(n)
	if c.PerSession > 0 {
		c.PerGiB = int(int64(moat.GiB) / c.PerSession)
	}
	return c, nil
}

// usedMemory is MemTotal minus MemAvailable, in bytes.
func usedMemory() (int64, error) {
	total, avail, err := memInfo()
	return total - avail, err
}

// memInfo reads MemTotal and MemAvailable from /proc/meminfo, in bytes.
func memInfo() (total, avail int64, err error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, 0, fmt.Errorf("bench: %w", err)
	}
	defer f.Close()
	total, avail = -1, -1
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		v, err := strconv.ParseInt(fields[1], 10, 64)
		if err != nil {
			continue
		}
		switch fields[0] {
		case "MemTotal:":
			total = v * 1024
		case "MemAvailable:":
			avail = v * 1024
		}
	}
	if total < 0 || avail < 0 {
		return 0, 0, errors.New("bench: /proc/meminfo has no MemTotal or MemAvailable")
	}
	return total, avail, nil
}
