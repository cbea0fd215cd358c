package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
)

// Exit statuses shared by every command. docs/exit-status.md is the table
// for users; TestExitStatusTable checks each of its rows. `moat run`
// exits with the code's own status when the code ran, whatever it is:
// with --json the object says which it was.
const (
	exitOK      = 0
	exitFailure = 1 // the work failed: an attack got through, a bench row failed, the agent gave up
	exitUsage   = 2 // bad input: flags, arguments, files, the config file
	// exitEnvironment: the input is fine and moat works, but the machine is
	// not ready for this command now: an address in use, a state dir
	// another moat holds, a server that does not answer. Fix the
	// machine, or wait, and run the same command again.
	exitEnvironment = 3
	// exitInternal: a level, or a protection it promises, is unavailable
	// here (moat never runs the code with less), or moat itself failed.
	exitInternal = 125
	// exitInterrupted: moat was told to stop (SIGINT, SIGTERM) before the
	// work was done; 128 + SIGINT, as a shell reports it.
	exitInterrupted = 130
)

// exitTable maps error classes to exit statuses, first match wins. It is
// the only place where a status is chosen for an error; an error matching
// no row is exitInternal.
var exitTable = []struct {
	target error
	status int
}{
	// The environment's rows come first: an address in use is not bad
	// usage even where a caller classed the listen error as input.
	{syscall.EADDRINUSE, exitEnvironment},
	{syscall.EADDRNOTAVAIL, exitEnvironment},
	{server.ErrStateLocked, exitEnvironment},
	{syscall.ECONNREFUSED, exitEnvironment},
	// Told to stop: whatever failed on the way out did so because of it.
	{context.Canceled, exitInterrupted},
	{moat.ErrInvalid, exitUsage},
	{moat.ErrUnavailable, exitInternal},
}

// exitStatus is the exit status for err (nil is exitOK).
func exitStatus(err error) int {
	if err == nil {
		return exitOK
	}
	for _, row := range exitTable {
		if errors.Is(err, row.target) {
			return row.status
		}
	}
	return exitInternal
}

// exitFor prints err as one line on stderr, starting "moat: ", and returns
// its exit status (see exitTable).
func exitFor(stdio Stdio, err error) int {
	msg := oneLine(err.Error())
	if !strings.HasPrefix(msg, "moat: ") {
		msg = "moat: " + msg
	}
	fmt.Fprintln(stdio.Err, msg)
	return exitStatus(err)
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// listenError classes an error of net.Listen: an address that does not
// parse or resolve is bad input (moat.ErrInvalid); one the system refuses
// (in use, not an address of this host's, a privileged port) keeps its
// errno, for exitTable, and is not called bad input.
func listenError(err error) error {
	if _, ok := errors.AsType[syscall.Errno](err); ok {
		return err
	}
	return moat.Invalid(err)
}
