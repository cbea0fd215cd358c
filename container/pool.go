package container

import (
	"context"
	"fmt"
	"strconv"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// A prepared container is created, waited for and attached to, but not
// started: nothing has run in it. Preparing one takes the engine tens of
// milliseconds (more when it is busy); a Sandbox keeps Config.Warm of them
// ready so that a run only starts one. Each is used by one run at most.
// Each holds the lease of its own uid from before its creation until it is
// removed, whether it waits in the pool or runs.
type prepared struct {
	lease    *uidpool.Lease
	id       string
	hj       types.HijackedResponse
	waitC    <-chan container.WaitResponse
	waitErrC <-chan error
	cancel   context.CancelFunc // ends the wait and the attach
	waited   bool               // a run received from waitC or waitErrC
	filters  int                // the seccomp filters its init ran under, once started
}

// createTimeout bounds the preparation of a container.
const createTimeout = time.Minute

// prepare creates a container and registers the wait and the attach that a
// run needs before it starts. The engine is asked under a context of its
// own, never the caller's: a create cancelled in flight may still make a
// container whose id moat would never learn. The caller owns the result and
// must pass it to discard once done.
func (s *Sandbox) prepare() (*prepared, error) {
	ctx, cancel := context.WithTimeout(context.Background(), createTimeout)
	defer cancel()
	lease, err := s.freeUID(ctx)
	if err != nil {
		return nil, err
	}
	created, err := s.cli.ContainerCreate(ctx, s.spec.config(lease.UID), s.spec.hostConfig(lease.UID), nil, nil, "")
	if err != nil {
		// A create that failed in flight may still have made a container
		// with this uid, but one that nobody starts: no process ever runs
		// as the uid in it, so the uid is free again.
		lease.Release()
		if cerrdefs.IsNotFound(err) {
			return nil, unavailable(fmt.Sprintf("image %s is not in the Docker engine", s.spec.image), "run 'moat image build'", err)
		}
		return nil, fmt.Errorf("container: create: %w", err)
	}
	// The wait and the attach live as long as the container: their context
	// is ended by discard.
	lctx, lcancel := context.WithCancel(context.Background())
	p := &prepared{lease: lease, id: created.ID, cancel: lcancel}
	// Wait first, then attach: the wait is acknowledged before the container
	// can exit, and the attach before it can write.
	p.waitC, p.waitErrC = s.cli.ContainerWait(lctx, p.id, container.WaitConditionNextExit)
	select {
	case err := <-p.waitErrC:
		s.discard(p)
		return nil, fmt.Errorf("container: wait: %w", err)
	default:
	}
	p.hj, err = s.cli.ContainerAttach(lctx, p.id, container.AttachOptions{Stream: true, Stdin: true, Stdout: true, Stderr: true})
	if err != nil {
		s.discard(p)
		return nil, fmt.Errorf("container: attach: %w", err)
	}
	return p, nil
}

// freeUID leases a uid that no container runs as. A lease ends with the
// moat process that held it, but its container may outlive it until a later
// New reaps it: a container still labelled with the uid just leased belongs
// to a moat that is gone, so it is removed before the uid is used. A uid
// whose orphan cannot be removed stays leased, unused, and another is tried.
func (s *Sandbox) freeUID(ctx context.Context) (*uidpool.Lease, error) {
	for try := 0; try < 3; try++ {
		lease, err := s.uids.Acquire()
		if err != nil {
			return nil, fmt.Errorf("container: a uid for the container: %w", err)
		}
		list, err := s.cli.ContainerList(ctx, container.ListOptions{
			All:     true,
			Filters: filters.NewArgs(filters.Arg("label", LabelUID+"="+strconv.Itoa(lease.UID))),
		})
		if err != nil {
			lease.Release()
			return nil, fmt.Errorf("container: list the containers of uid %d: %w", lease.UID, err)
		}
		clean := true
		for _, c := range list {
			err := s.cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true, RemoveVolumes: true})
			if err != nil && !cerrdefs.IsNotFound(err) {
				s.log.Warn("container: remove an orphan holding a uid", "id", shortID(c.ID), "uid", lease.UID, "err", err)
				clean = false
				continue
			}
			s.log.Info("container: removed an orphan of a moat that is gone", "id", shortID(c.ID), "uid", lease.UID)
		}
		if clean {
			return lease, nil
		}
		// Held, never released: the orphan still runs as this uid.
	}
	return nil, fmt.Errorf("container: every uid tried is held by a container that cannot be removed: %w", moat.ErrUnavailable)
}

// discard releases p and removes its container, killing it first if it
// runs; then its uid is free for another container. A container the engine
// could not remove keeps its uid leased for the life of the Sandbox's
// process.
func (s *Sandbox) discard(p *prepared) {
	if p.hj.Conn != nil {
		p.hj.Close()
	}
	p.cancel()
	if !p.waited {
		// The client's wait goroutine ends once it handed over its answer:
		// the cancellation's error, or an exit it had already read.
		select {
		case <-p.waitC:
		case <-p.waitErrC:
		case <-time.After(5 * time.Second):
		}
	}
	if s.remove(p.id) {
		p.lease.Release()
	}
}

// take returns a prepared container: one from the pool when there is one
// (and asks the filler for another), else a new one.
func (s *Sandbox) take() (*prepared, error) {
	select {
	case p := <-s.pool:
		select {
		case s.refill <- struct{}{}:
		default:
		}
		return p, nil
	default:
	}
	return s.prepare()
}

// fill keeps the pool full until quit closes: one container per token in
// refill. It retries a failed preparation with a growing pause, so a broken
// engine is not hammered; runs then prepare their own and report the error.
func (s *Sandbox) fill() {
	defer close(s.fillDone)
	pause := 100 * time.Millisecond
	for {
		select {
		case <-s.quit:
			return
		case <-s.refill:
		}
		for {
			p, err := s.prepare()
			if err == nil {
				pause = 100 * time.Millisecond
				select {
				case s.pool <- p:
				default: // cannot happen: tokens never outnumber free slots
					s.discard(p)
				}
				break
			}
			s.log.Debug("container: preparing a container ahead of runs", "err", err, "retry_in", pause)
			select {
			case <-s.quit:
				return
			case <-time.After(pause):
			}
			pause = min(2*pause, 30*time.Second)
		}
	}
}

// drain removes the prepared containers of the pool. The filler must have
// stopped.
func (s *Sandbox) drain() {
	for {
		select {
		case p := <-s.pool:
			s.discard(p)
		default:
			return
		}
	}
}
