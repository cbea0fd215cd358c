package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
)

// qmp is a minimal client of the QEMU Machine Protocol: one command at a
// time, events skipped.
type qmp struct {
	mu   sync.Mutex
	conn net.Conn
	r    *bufio.Reader
}

// dialQMP reads the greeting on conn and negotiates capabilities.
func dialQMP(ctx context.Context, conn net.Conn) (*qmp, error) {
	q := &qmp{conn: conn, r: bufio.NewReaderSize(conn, 64<<10)}
	q.setDeadline(ctx)
	defer conn.SetDeadline(time.Time{})
	var greeting struct {
		QMP json.RawMessage `json:"QMP"`
	}
	line, err := q.r.ReadBytes('\n')
	if err != nil {
		return nil, fmt.Errorf("microvm: qmp greeting: %w", err)
	}
	if err := json.Unmarshal(line, &greeting); err != nil || greeting.QMP == nil {
		return nil, fmt.Errorf("microvm: qmp greeting %q", line)
	}
	if err := q.execute(ctx, "qmp_capabilities", nil, nil); err != nil {
		return nil, err
	}
	return q, nil
}

func (q *qmp) setDeadline(ctx context.Context) {
	if d, ok := ctx.Deadline(); ok {
		q.conn.SetDeadline(d)
	} else {
		q.conn.SetDeadline(time.Now().Add(time.Minute))
	}
}

// execute runs one command and decodes its return value into out (when
// not nil).
func (q *qmp) execute(ctx context.Context, cmd string, args any, out any) error {
	return q.executeFD(ctx, cmd, args, out, nil)
}

// executeFD is execute that passes f along with the command (SCM_RIGHTS),
// as getfd wants.
func (q *qmp) executeFD(ctx context.Context, cmd string, args any, out any, f *os.File) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.setDeadline(ctx)
	defer q.conn.SetDeadline(time.Time{})
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, _ := json.Marshal(req)
	if f != nil {
		uc, ok := q.conn.(*net.UnixConn)
		if !ok {
			return fmt.Errorf("microvm: qmp %s: cannot pass a file over %T", cmd, q.conn)
		}
		if _, _, err := uc.WriteMsgUnix(append(b, '\n'), syscall.UnixRights(int(f.Fd())), nil); err != nil {
			return fmt.Errorf("microvm: qmp %s: %w", cmd, err)
		}
	} else if _, err := q.conn.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("microvm: qmp %s: %w", cmd, err)
	}
	for {
		line, err := q.r.ReadBytes('\n')
		if err != nil {
			return fmt.Errorf("microvm: qmp %s: %w", cmd, err)
		}
		var resp struct {
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
			Event string `json:"event"`
		}
		if err := json.Unmarshal(line, &resp); err != nil {
			return fmt.Errorf("microvm: qmp %s: reply %q: %w", cmd, line, err)
		}
		switch {
		case resp.Event != "":
			continue
		case resp.Error != nil:
			return fmt.Errorf("microvm: qmp %s: %s: %s", cmd, resp.Error.Class, resp.Error.Desc)
		}
		if out != nil && resp.Return != nil {
			if err := json.Unmarshal(resp.Return, out); err != nil {
				return fmt.Errorf("microvm: qmp %s: %w", cmd, err)
			}
		}
		return nil
	}
}

// status is query-status's answer, e.g. "running", "paused", "inmigrate".
func (q *qmp) status(ctx context.Context) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	err := q.execute(ctx, "query-status", nil, &st)
	return st.Status, err
}

// migration is query-migrate's status: "active", "completed", "failed", ...
func (q *qmp) migration(ctx context.Context) (string, string, error) {
	var st struct {
		Status    string `json:"status"`
		ErrorDesc string `json:"error-desc"`
	}
	err := q.execute(ctx, "query-migrate", nil, &st)
	return st.Status, st.ErrorDesc, err
}

func (q *qmp) close() error { return q.conn.Close() }
