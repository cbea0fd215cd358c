package microvm

import (
	"context"
	"errors"
	"io/fs"
	"path/filepath"
	"time"
)

// restore starts a VM from the template and lets it run: its agent waits
// for the code.
func (s *Sandbox) restore(ctx context.Context) (VM, error) {
	spec := s.spec
	spec.Restore = filepath.Join(s.tmpl, "state")
	vm, err := s.vmm.Start(ctx, spec)
	if errors.Is(err, fs.ErrNotExist) {
		// A newer template of another sandbox superseded this one and
		// removed it (see pruneTemplates): make it again.
		if _, _, err := ensureTemplate(ctx, s.cfg.StateDir, s.vmm, s.spec, time.Duration(s.cfg.BootTimeout)); err != nil {
			return nil, err
		}
		vm, err = s.vmm.Start(ctx, spec)
	}
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, time.Duration(s.cfg.BootTimeout))
	defer cancel()
	if err := vm.Resume(rctx); err != nil {
		vm.Kill()
		return nil, err
	}
	return vm, nil
}

// readyVM is a VM restored ahead of its run.
type readyVM struct {
	vm VM
	ms int64 // how long its restore took
}

// fill keeps s.ready full until ctx ends, restoring a VM whenever one is
// taken (s.refill).
func (s *Sandbox) fill(ctx context.Context) {
	defer close(s.fillDone)
	for {
		for len(s.ready) < cap(s.ready) {
			start := time.Now()
			vm, err := s.restore(ctx)
			if err != nil {
				if ctx.Err() == nil {
					s.log.Warn("microvm: restore a VM ahead of its run", "err", err)
				}
				break
			}
			select {
			case s.ready <- readyVM{vm, time.Since(start).Milliseconds()}:
			case <-ctx.Done():
				vm.Kill()
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-s.refill:
		}
	}
}

// askRefill asks the filler for another VM. Runs ask when they end, not
// when they start, so that the restore does not compete with the run for
// the CPU.
func (s *Sandbox) askRefill() {
	if s.refill == nil {
		return
	}
	select {
	case s.refill <- struct{}{}:
	default:
	}
}

// takeReady returns a VM restored ahead, if one is there and alive.
func (s *Sandbox) takeReady() (readyVM, bool) {
	if s.ready == nil {
		return readyVM{}, false
	}
	for {
		select {
		case r := <-s.ready:
			select {
			case <-r.vm.Exited():
				r.vm.Kill()
				continue
			default:
				return r, true
			}
		default:
			return readyVM{}, false
		}
	}
}
