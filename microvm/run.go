package microvm

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// backstop is how long past the wall time the host waits for the agent's
// report before it kills the VM itself.
const backstop = 15 * time.Second

// Run runs req.Code under python3 in a VM of its own; see moat.Sandbox for
// the contract.
func (s *Sandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	if len(req.Code) == 0 {
		return nil, fmt.Errorf("microvm: empty code: %w", moat.ErrInvalid)
	}
	if len(req.Code) > int(s.limits.Disk) || len(req.Code) > wire.MaxCode {
		return nil, fmt.Errorf("microvm: code of %d bytes is larger than the disk limit %v or the level's cap of %d bytes: %w",
			len(req.Code), s.limits.Disk, wire.MaxCode, moat.ErrInvalid)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("microvm: %w", moat.ErrClosed)
	}
	s.runs.Add(1)
	s.mu.Unlock()
	defer s.runs.Done()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	start := time.Now()
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer s.askRefill()
	vm, how, err := s.startVM(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	defer vm.Kill()
	res, err := s.talk(ctx, vm, req)
	if err != nil {
		return nil, err
	}
	vm.Kill()
	res.Notes = append([]string{s.note, how}, res.Notes...)
	res.Duration = time.Since(start)
	s.log.Debug("microvm: run", "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason, "start", how)
	return res, nil
}

// startVM restores the template, or boots a fresh VM when the sandbox is
// cold, and returns it running with its agent waiting for the code.
func (s *Sandbox) startVM(ctx context.Context) (VM, string, error) {
	start := time.Now()
	if s.cfg.Cold {
		vm, _, err := bootToHello(ctx, s.vmm, s.spec, time.Duration(s.cfg.BootTimeout))
		if err != nil {
			return nil, "", err
		}
		return vm, fmt.Sprintf("vm: cold boot to a ready agent in %d ms", time.Since(start).Milliseconds()), nil
	}
	if r, ok := s.takeReady(); ok {
		return r.vm, fmt.Sprintf("vm: restored from template %s in %d ms, ahead of the run", filepath.Base(s.tmpl)[:12], r.ms), nil
	}
	vm, err := s.restore(ctx)
	if err != nil {
		return nil, "", err
	}
	return vm, fmt.Sprintf("vm: restored from template %s in %d ms", filepath.Base(s.tmpl)[:12], time.Since(start).Milliseconds()), nil
}

// guestReasons are the reasons the agent may report; the host adds output
// and canceled itself.
var guestReasons = []moat.Reason{moat.ReasonNone, moat.ReasonTimeout, moat.ReasonMemory, moat.ReasonPids,
	moat.ReasonFileSize, moat.ReasonDisk, moat.ReasonSignal}

// parseExit decodes the agent's exit report. The guest runs hostile code
// and may be compromised, so a report that the agent could not have made is
// an error, not a result.
func parseExit(p []byte) (*wire.Exit, error) {
	var e wire.Exit
	if err := json.Unmarshal(p, &e); err != nil {
		return nil, fmt.Errorf("microvm: the agent's exit report: %w", err)
	}
	if e.ExitCode < 0 || e.ExitCode > 255 || e.Signal < 0 || e.Signal > 64 || !slices.Contains(guestReasons, moat.Reason(e.Reason)) {
		return nil, fmt.Errorf("microvm: the agent's exit report is not one it makes: %s", clip(p, 512))
	}
	return &e, nil
}

// clip returns b as valid UTF-8, cut to at most n bytes, for an error
// message.
func clip(b []byte, n int) string {
	if len(b) > n {
		b = b[:n]
	}
	return strings.ToValidUTF8(string(b), "?")
}

type frame struct {
	kind    wire.Kind
	payload []byte
}

// talk sends the run to the agent and collects what it reports.
func (s *Sandbox) talk(ctx context.Context, vm VM, req moat.Request) (*moat.Result, error) {
	lim := s.limits
	seed := make([]byte, 64)
	rand.Read(seed)
	run := wire.Run{
		Code: req.Code, UnixNano: time.Now().UnixNano(), Seed: seed,
		WallMS: time.Duration(lim.WallTime).Milliseconds(), CPUMS: time.Duration(lim.CPUTime).Milliseconds(),
		Memory: int64(lim.Memory), Pids: int64(lim.Pids), FileSize: int64(lim.FileSize),
		Disk: int64(lim.Disk), OpenFiles: int64(lim.OpenFiles),
	}
	conn := vm.Agent()
	frames := make(chan frame, 16)
	readerDone := make(chan error, 1)
	go func() {
		defer close(frames)
		for {
			k, p, err := wire.Read(conn, wire.MaxReport)
			if err != nil {
				readerDone <- err
				return
			}
			frames <- frame{k, p}
		}
	}()
	// Whatever happens below, the reader ends before talk returns: killing
	// the VM closes the connection.
	defer func() {
		vm.Kill()
		for range frames {
		}
	}()
	sendErr := make(chan error, 1)
	go func() { sendErr <- wire.WriteJSON(conn, wire.KindRun, run) }()

	// The first byte past the output cap ends the run: the loop stops at
	// once and the VM is killed, as at the host's wall-time backstop.
	var outOver bool
	over := func() { outOver = true }
	stdout := capture.New(int64(lim.Output), req.Stdout, over)
	stderr := capture.New(int64(lim.Output), req.Stderr, over)
	timer := time.NewTimer(time.Duration(lim.WallTime) + backstop)
	defer timer.Stop()
	var (
		started  bool
		exit     *wire.Exit
		canceled bool
		hostKill bool
	)
loop:
	for {
		select {
		case f, ok := <-frames:
			if !ok {
				break loop
			}
			switch f.kind {
			case wire.KindStarted:
				started = true
			case wire.KindStdout:
				stdout.Write(f.payload)
				if outOver {
					break loop
				}
			case wire.KindStderr:
				stderr.Write(f.payload)
				if outOver {
					break loop
				}
			case wire.KindExit:
				e, err := parseExit(f.payload)
				if err != nil {
					return nil, err
				}
				exit = e
				break loop
			case wire.KindFail:
				return nil, unavailable("the guest agent failed", "", errors.New(clip(f.payload, 512)))
			}
		case err := <-sendErr:
			if err != nil {
				return nil, fmt.Errorf("microvm: send the code: %w", err)
			}
			sendErr = nil
		case <-ctx.Done():
			canceled = true
			break loop
		case <-timer.C:
			hostKill = true
			break loop
		}
	}
	vm.Kill()
	for range frames { // the output that was on its way
	}
	res := &moat.Result{
		Level:     moat.LevelMicroVM,
		Stdout:    stdout.Bytes(),
		Stderr:    stderr.Bytes(),
		Truncated: stdout.Truncated() || stderr.Truncated(),
	}
	switch {
	case outOver:
		res.ExitCode = 128 + int(syscall.SIGKILL)
		res.Signal = "SIGKILL"
		res.Reason = moat.ReasonOutput
	case exit != nil:
		res.ExitCode = exit.ExitCode
		if exit.Signal > 0 {
			res.Signal = unix.SignalName(syscall.Signal(exit.Signal))
		}
		res.Reason = moat.Reason(exit.Reason)
	case canceled && !started:
		return nil, ctx.Err()
	case canceled, hostKill:
		res.ExitCode = 128 + int(syscall.SIGKILL)
		res.Signal = "SIGKILL"
		res.Reason = moat.ReasonCanceled
		if hostKill {
			res.Reason = moat.ReasonTimeout
			res.Notes = append(res.Notes, "the agent did not report within the wall time; the host killed the VM")
		}
	default:
		err := <-readerDone
		return nil, fmt.Errorf("microvm: the VM ended without a report (%v)", err)
	}
	return res, nil
}
