package microvm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// agentConn is the host's end of one VM's agent port: one goroutine reads
// every frame the guest sends and hands it to whoever waits for it — the
// run in progress (Started, Stdout, Stderr, Exit, Fail), a file operation
// (FileReply, Data, by id) — and drops what nobody waits for. The guest
// runs hostile code and may be compromised: no frame it sends is larger
// than wire.MaxReport, and a frame of a kind the agent never sends ends
// the conversation.
type agentConn struct {
	conn net.Conn

	wmu sync.Mutex // serializes writes

	mu     sync.Mutex
	onIdle func()           // called for each Idle, from the reader; see setIdle
	run    *sink            // the run in progress, if any
	ops    map[uint64]*sink // file operations waiting for replies
	done   chan struct{}    // closed when the reader has ended
	err    error            // why it ended; set before done is closed
}

// frame is one frame from the guest.
type frame struct {
	kind    wire.Kind
	payload []byte
}

// sink receives the frames of one run or one file operation. The reader
// sends on ch until quit is closed.
type sink struct {
	ch   chan frame
	quit chan struct{}
	once sync.Once
}

func newSink() *sink { return &sink{ch: make(chan frame, 16), quit: make(chan struct{})} }

func (s *sink) close() { s.once.Do(func() { close(s.quit) }) }

// writeTimeout bounds one write to the guest: a guest that stops reading
// its port must not hold a host goroutine forever.
const writeTimeout = 30 * time.Second

func newAgentConn(conn net.Conn, onIdle func()) *agentConn {
	c := &agentConn{conn: conn, onIdle: onIdle, ops: map[uint64]*sink{}, done: make(chan struct{})}
	go c.read()
	return c
}

func (c *agentConn) read() {
	err := c.readLoop()
	c.mu.Lock()
	c.err = err
	c.mu.Unlock()
	close(c.done)
}

func (c *agentConn) readLoop() error {
	for {
		k, p, err := wire.Read(c.conn, wire.MaxReport)
		if err != nil {
			return err
		}
		var to *sink
		switch k {
		case wire.KindStarted, wire.KindStdout, wire.KindStderr, wire.KindExit, wire.KindFail:
			c.mu.Lock()
			to = c.run
			c.mu.Unlock()
		case wire.KindReply, wire.KindData:
			id, err := replyID(k, p)
			if err != nil {
				return err
			}
			c.mu.Lock()
			to = c.ops[id]
			c.mu.Unlock()
		case wire.KindIdle:
			c.mu.Lock()
			onIdle := c.onIdle
			c.mu.Unlock()
			if onIdle != nil {
				onIdle()
			}
			continue
		default:
			return fmt.Errorf("microvm: the agent sent a %s frame, which it never sends", k)
		}
		if to == nil {
			continue // nobody waits for it: a late frame of a run or an operation that ended
		}
		select {
		case to.ch <- frame{k, p}:
		case <-to.quit:
		}
	}
}

// setIdle makes f what is called for each later Idle: a VM restored for
// a one-shot run that becomes a session's changes hands.
func (c *agentConn) setIdle(f func()) {
	c.mu.Lock()
	c.onIdle = f
	c.mu.Unlock()
}

// replyID is the operation id a FileReply or Data frame is for.
func replyID(k wire.Kind, p []byte) (uint64, error) {
	if k == wire.KindData {
		id, _, err := wire.DataID(p)
		return id, err
	}
	var r struct {
		ID uint64 `json:"id"`
	}
	if err := json.Unmarshal(p, &r); err != nil {
		return 0, fmt.Errorf("microvm: the agent's file reply: %w", err)
	}
	return r.ID, nil
}

// ended returns why the reader ended, once it has.
func (c *agentConn) ended() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// send writes one frame to the agent.
func (c *agentConn) send(k wire.Kind, p []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.conn.SetWriteDeadline(time.Now().Add(writeTimeout))
	defer c.conn.SetWriteDeadline(time.Time{})
	if err := wire.Write(c.conn, k, p); err != nil {
		return fmt.Errorf("microvm: send %s to the agent: %w", k, err)
	}
	return nil
}

func (c *agentConn) sendJSON(k wire.Kind, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("microvm: %w", err)
	}
	return c.send(k, b)
}

// runSink makes the sink of a new run; its frames go to it until the
// sink is closed.
func (c *agentConn) runSink() *sink {
	s := newSink()
	c.mu.Lock()
	if c.run != nil {
		c.run.close()
	}
	c.run = s
	c.mu.Unlock()
	return s
}

// endRun stops the frames of run s.
func (c *agentConn) endRun(s *sink) {
	s.close()
	c.mu.Lock()
	if c.run == s {
		c.run = nil
	}
	c.mu.Unlock()
}

// opSink registers file operation id; done unregisters it.
func (c *agentConn) opSink(id uint64) (*sink, func()) {
	s := newSink()
	c.mu.Lock()
	c.ops[id] = s
	c.mu.Unlock()
	return s, func() {
		s.close()
		c.mu.Lock()
		delete(c.ops, id)
		c.mu.Unlock()
	}
}

// next returns s's next frame, or false once the reader has ended and
// every frame it delivered has been taken.
func (c *agentConn) next(s *sink, timeout <-chan time.Time) (frame, bool, bool) {
	select {
	case f := <-s.ch:
		return f, true, false
	case <-timeout:
		return frame{}, false, true
	case <-c.done:
		// What the reader delivered before it ended comes first.
		select {
		case f := <-s.ch:
			return f, true, false
		default:
			return frame{}, false, false
		}
	}
}

// parseExit decodes the agent's exit report. The guest runs hostile code
// and may be compromised, so a report the agent could not have made (a
// field it does not send, a status out of range, both an exit code and a
// signal) is an error, not evidence.
func parseExit(p []byte) (*wire.Exit, error) {
	var e wire.Exit
	dec := json.NewDecoder(bytes.NewReader(p))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return nil, fmt.Errorf("microvm: the agent's exit report is not one it makes: %w: %s", err, clip(p, 512))
	}
	if dec.More() || e.ExitCode < 0 || e.ExitCode > 255 || e.Signal < 0 || e.Signal > 64 ||
		(e.Signal != 0 && e.ExitCode != 0) || e.CPUMS < 0 || e.WallMS < 0 {
		return nil, fmt.Errorf("microvm: the agent's exit report is not one it makes: %s", clip(p, 512))
	}
	return &e, nil
}

// evidence is what an agent's (checked) exit report of a run under the
// CPU time limit cpu shows, for the engine to judge. A death by SIGXCPU
// counts as the CPU limit only when the run's CPU time, as the guest's
// cgroup counted it, reached the limit: the agent sets RLIMIT_CPU to
// python3's start plus the limit, rounded up, so the kernel's SIGXCPU
// comes no earlier, and the code can send itself the signal.
func evidence(e *wire.Exit, cpu time.Duration) engine.Evidence {
	ev := engine.Evidence{
		Exited: true, CPUTime: e.CPU, Memory: e.OOM, Pids: e.Pids, FileSize: e.FileSize, Disk: e.Disk,
		Status: engine.Exit(e.ExitCode),
	}
	if e.Signal != 0 {
		ev.Status = engine.Signaled(syscall.Signal(e.Signal))
	}
	ev.CPUTime = ev.CPUTime || engine.XCPUAtLimit(ev.Status, time.Duration(e.CPUMS)*time.Millisecond, cpu, engine.XCPUSlack)
	return ev
}

// clip returns b as valid UTF-8, cut to at most n bytes, for an error
// message.
func clip(b []byte, n int) string {
	if len(b) > n {
		b = b[:n]
	}
	return strings.ToValidUTF8(string(b), "?")
}
