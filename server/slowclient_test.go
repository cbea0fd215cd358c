package server_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// dialSmall connects to the server with a receive buffer of 4KiB, set before
// the connection is made so that the window is small from the start: a
// client that then reads nothing takes little off the server, whose writes
// block once its own send buffer (a few MiB on loopback) is full.
func dialSmall(t testing.TB, ts *testServer) net.Conn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		return errors.Join(err, serr)
	}}
	c, err := d.Dial("tcp", strings.TrimPrefix(ts.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// sendRaw writes one request on c, and reads nothing.
func sendRaw(t testing.TB, c net.Conn, method, path, token string, body []byte) {
	t.Helper()
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: moat\r\n", method, path)
	if token != "" {
		fmt.Fprintf(&b, "Authorization: Bearer %s\r\n", token)
	}
	if body != nil {
		fmt.Fprintf(&b, "Content-Type: application/json\r\nContent-Length: %d\r\n", len(body))
	}
	b.WriteString("\r\n")
	b.Write(body)
	if _, err := c.Write(b.Bytes()); err != nil {
		t.Fatal(err)
	}
}

// runBody is the JSON body of a run.
func runBody(code string, stream bool) []byte {
	b, _ := json.Marshal(map[string]any{"code": code, "stream": stream})
	return b
}

// runLeftovers lists the working directories and cgroups of runs left on
// the host (leftovers without the sandbox's own helper processes).
func runLeftovers() []string {
	var out []string
	for _, l := range leftovers() {
		if !strings.HasPrefix(l, "process ") {
			out = append(out, l)
		}
	}
	return out
}

// sseEvents splits a stream of server-sent events.
func sseEvents(body []byte) []event {
	var out []event
	for _, block := range strings.Split(string(body), "\n\n") {
		var ev event
		for _, line := range strings.Split(block, "\n") {
			if name, ok := strings.CutPrefix(line, "event: "); ok {
				ev.Name = name
			} else if data, ok := strings.CutPrefix(line, "data: "); ok {
				ev.Data += data
			}
		}
		if ev.Name != "" {
			out = append(out, ev)
		}
	}
	return out
}

// TestSlowClientsHoldNoSlot: as many clients of one token as there are
// slots ask for runs with 8MiB of output (more than loopback's socket
// buffers take) and read nothing. Their runs end, their resources are
// removed, and another token's run goes through while their answers are
// still unread; the answers then arrive whole.
func TestSlowClientsHoldNoSlot(t *testing.T) {
	const n = 2
	const out = 8 << 20
	lim := moat.Limits{Output: out, WallTime: moat.Duration(60 * time.Second)}
	ts := startServer(t, lim, func(c *server.Config) {
		// No pool: a prepared instance has its directory and cgroup
		// before any run, and the test counts what runs leave.
		c.Sandboxes[moat.LevelSubprocess].Close()
		sb, err := subprocess.New(subprocess.Config{Limits: lim, Warm: -1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Close() })
		c.Sandboxes = map[moat.Level]moat.Sandbox{moat.LevelSubprocess: sb}
		c.MaxConcurrentRuns = n
		c.MaxRunsPerToken = n // the per-token cap would let b through on its own: this is about the slots
		c.QueueWait = moat.Duration(20 * time.Second)
		// Long enough that a's answers wait, unread, until the test reads them.
		c.WriteTimeout = moat.Duration(2 * time.Minute)
	})
	code := fmt.Sprintf("import sys\nsys.stdout.write('x' * %d)", out)
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			ended := func() float64 { return max(metric(t, ts, `moat_runs_total{level="subprocess",reason="none"}`), 0) }
			before := ended()
			conns := make([]net.Conn, n)
			for i := range conns {
				conns[i] = dialSmall(t, ts)
				sendRaw(t, conns[i], "POST", "/v1/runs", tokenA, runBody(code, stream))
			}
			eventually(t, 60*time.Second, "a's runs end while their clients read nothing", func() bool { return ended() == before+n })
			// A run's directory and cgroup are removed just after its
			// result (subprocess's teardown), whether or not anyone reads
			// it.
			eventually(t, 10*time.Second, "a's runs' directories and cgroups removed while their results wait for the clients", func() bool { return len(runLeftovers()) == 0 })
			if v := metric(t, ts, "moat_runs_in_progress"); v != 0 {
				t.Errorf("%v slots held by runs that have ended", v)
			}
			r := call(t, "POST", ts.URL+"/v1/runs", tokenB, map[string]any{"code": "print('b')"})
			if r.Status != 200 || r.JSON(t)["stdout"] != "b\n" {
				t.Fatalf("b's run while a's answers are unread: %d %s", r.Status, r.Body)
			}
			// a's answers were kept for them, whole.
			for i, c := range conns {
				c.SetReadDeadline(time.Now().Add(60 * time.Second))
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					t.Fatalf("a's client %d: %v", i, err)
				}
				body, err := io.ReadAll(resp.Body)
				if err != nil || resp.StatusCode != 200 {
					t.Fatalf("a's client %d: %d, %d bytes, %v", i, resp.StatusCode, len(body), err)
				}
				var res map[string]any
				if !stream {
					json.Unmarshal(body, &res)
				} else {
					// Live output stopped once the client was the stream
					// buffer behind; the result came after the overflow
					// event.
					evs := sseEvents(body)
					var names []string
					live := 0
					for _, ev := range evs {
						names = append(names, ev.Name)
						if ev.Name == "stdout" {
							var d map[string]string
							json.Unmarshal([]byte(ev.Data), &d)
							live += len(d["data"])
						}
					}
					if len(evs) < 2 || evs[len(evs)-2].Name != "overflow" || evs[len(evs)-1].Name != "result" || live >= out {
						t.Errorf("a's stream %d: events %v, %d bytes of live output", i, names[max(0, len(names)-5):], live)
					}
					if len(evs) > 0 {
						json.Unmarshal([]byte(evs[len(evs)-1].Data), &res)
					}
				}
				if s, _ := res["stdout"].(string); len(s) != out || res["exit_code"] != 0.0 {
					t.Errorf("a's result %d: %d bytes of stdout, exit %v", i, len(s), res["exit_code"])
				}
			}
			if stream {
				if v := metric(t, ts, "moat_stream_overflows_total"); v != n {
					t.Errorf("overflows counted: %v", v)
				}
			}
		})
	}
}

// doCtx sends a run with ctx, as call does, for runs the test cancels.
func doCtx(ctx context.Context, url, token, code string) (int, string, error) {
	req, _ := http.NewRequestWithContext(ctx, "POST", url, strings.NewReader(string(runBody(code, false))))
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// TestTokenCap: one token gets at most its share of the slots; its next run
// waits although slots are free, the one after is refused with 429
// token_busy, and another token's run goes through meanwhile.
func TestTokenCap(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, func(c *server.Config) {
		c.MaxConcurrentRuns = 4 // a's share: half, 2
		c.QueuePerToken = 1
		c.QueueWait = moat.Duration(60 * time.Second)
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	start := func() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			doCtx(ctx, ts.URL+"/v1/runs", tokenA, "import time; time.sleep(60)")
		}()
	}
	start()
	start()
	eventually(t, 20*time.Second, "a's two runs hold their slots", func() bool { return metric(t, ts, "moat_runs_in_progress") == 2 })
	start()
	eventually(t, 20*time.Second, "a's third run waits", func() bool { return metric(t, ts, "moat_run_queue_depth") == 1 })
	if v := metric(t, ts, "moat_runs_in_progress"); v != 2 {
		t.Errorf("a's third run took a slot past a's share: %v running", v)
	}
	r := call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print(1)"})
	if r.Status != 429 || r.ErrorCode(t) != "token_busy" || r.Header.Get("Retry-After") == "" {
		t.Errorf("a's fourth run: %d %s %v", r.Status, r.Body, r.Header)
	}
	r = call(t, "POST", ts.URL+"/v1/runs", tokenB, map[string]any{"code": "print('b')"})
	if r.Status != 200 || r.JSON(t)["stdout"] != "b\n" {
		t.Errorf("b's run while a holds its share: %d %s", r.Status, r.Body)
	}
	if v := metric(t, ts, "moat_run_queue_depth"); v != 1 {
		t.Errorf("a's waiting run: queue depth %v", v)
	}
	if v := metric(t, ts, `moat_runs_rejected_total{why="token_busy"}`); v != 1 {
		t.Errorf("token_busy counted %v times", v)
	}
	cancel()
	wg.Wait()
	eventually(t, 20*time.Second, "a's runs end once cancelled", func() bool {
		return metric(t, ts, "moat_runs_in_progress") == 0 && metric(t, ts, "moat_run_queue_depth") == 0
	})
	must(t, call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print(1)"}), 200)
}

// closedWithin reports whether the server closes c (a read returns EOF or
// a reset) before bound, reading and dropping what comes before.
func closedWithin(c net.Conn, bound time.Duration) error {
	c.SetReadDeadline(time.Now().Add(bound))
	_, err := io.Copy(io.Discard, c)
	if err == nil || errors.Is(err, syscall.ECONNRESET) {
		return nil // EOF or reset: closed by the server
	}
	return err
}

// TestConnectionTimeouts: connections that send nothing, send part of a
// request, or idle between requests are closed by the server; a client that
// reads nothing is dropped after the write timeout; none of this cuts a run
// longer than the timeouts.
func TestConnectionTimeouts(t *testing.T) {
	const timeout = 300 * time.Millisecond
	bound := 20 * timeout // the server closes after one timeout; a missing timeout never closes
	ts := startServer(t, moat.Limits{Output: 8 << 20, WallTime: moat.Duration(60 * time.Second)}, func(c *server.Config) {
		c.ReadHeaderTimeout = moat.Duration(timeout)
		c.ReadTimeout = moat.Duration(2 * timeout)
		c.ConnIdleTimeout = moat.Duration(timeout)
		c.WriteTimeout = moat.Duration(timeout)
		// Past the kernel's buffers, the output waits in the stream
		// buffer: the writer is blocked on the client, not idle after an
		// overflow.
		c.StreamBuffer = 32 << 20
	})
	addr := strings.TrimPrefix(ts.URL, "http://")
	dial := func(t *testing.T) net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	t.Run("no headers", func(t *testing.T) {
		if err := closedWithin(dial(t), bound); err != nil {
			t.Errorf("a connection that sends nothing: %v", err)
		}
	})
	t.Run("part of the headers", func(t *testing.T) {
		c := dial(t)
		io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: moat\r\n")
		if err := closedWithin(c, bound); err != nil {
			t.Errorf("a connection that stops in its headers: %v", err)
		}
	})
	t.Run("idle keep-alive", func(t *testing.T) {
		c := dial(t)
		sendRaw(t, c, "GET", "/healthz", "", nil)
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != 200 || resp.Close {
			t.Fatalf("healthz: %d, close %v", resp.StatusCode, resp.Close)
		}
		c.SetReadDeadline(time.Now().Add(bound))
		if _, err := br.ReadByte(); err != io.EOF {
			t.Errorf("an idle keep-alive connection: %v, want the server to close it", err)
		}
	})
	t.Run("part of the body", func(t *testing.T) {
		c := dial(t)
		io.WriteString(c, "POST /v1/runs HTTP/1.1\r\nHost: moat\r\nAuthorization: Bearer "+tokenA+"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"code\": ")
		if err := closedWithin(c, bound); err != nil {
			t.Errorf("a connection that stops in its body: %v", err)
		}
	})
	noKeepAlive := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	t.Run("a run outlives the timeouts", func(t *testing.T) {
		for _, stream := range []bool{false, true} {
			code := fmt.Sprintf("import time\nprint('start', flush=True)\ntime.sleep(%v)\nprint('done')", (8 * timeout).Seconds())
			req, _ := http.NewRequest("POST", ts.URL+"/v1/runs", bytes.NewReader(runBody(code, stream)))
			req.Header.Set("Authorization", "Bearer "+tokenA)
			resp, err := noKeepAlive.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || !strings.Contains(string(body), `start\ndone\n`) {
				t.Errorf("stream=%v: a run longer than the read and write timeouts: %d %v %s", stream, resp.StatusCode, err, body)
			}
		}
	})
	t.Run("a client that reads nothing is dropped", func(t *testing.T) {
		ended := func() float64 { return max(metric(t, ts, `moat_runs_total{level="subprocess",reason="none"}`), 0) }
		before := ended()
		c := dialSmall(t, ts)
		sendRaw(t, c, "POST", "/v1/runs", tokenA, runBody("import sys\nsys.stdout.write('x' * (8 << 20))", false))
		eventually(t, 60*time.Second, "the run ends", func() bool { return ended() == before+1 })
		// Well past the write timeout, the client starts reading: what the
		// socket buffers held comes, then the end, not the whole answer.
		time.Sleep(bound)
		c.SetReadDeadline(time.Now().Add(60 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err == nil {
			var n int64
			n, err = io.Copy(io.Discard, resp.Body)
			t.Logf("read %d bytes of the answer before: %v", n, err)
		}
		if err == nil {
			t.Errorf("a client that read nothing for %v got the whole answer: the server waited for it", bound)
		}
	})
	t.Run("a streaming client that reads nothing is dropped, and its run cancelled", func(t *testing.T) {
		before := max(metric(t, ts, `moat_runs_total{level="subprocess",reason="canceled"}`), 0)
		c := dialSmall(t, ts)
		sendRaw(t, c, "POST", "/v1/runs", tokenA, runBody("import sys, time\nsys.stdout.write('x' * (8 << 20)); sys.stdout.flush()\ntime.sleep(60)", true))
		eventually(t, 60*time.Second, "the run is cancelled", func() bool {
			return metric(t, ts, `moat_runs_total{level="subprocess",reason="canceled"}`) == before+1
		})
	})
}

// TestMaxConnections: past MaxConnections, a new connection is not served
// until one closes.
func TestMaxConnections(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(c *server.Config) {
		c.MaxConnections = 2
		c.ConnIdleTimeout = moat.Duration(time.Minute)
	})
	addr := strings.TrimPrefix(ts.URL, "http://")
	healthz := func(c net.Conn) error {
		sendRaw(t, c, "GET", "/healthz", "", nil)
		c.SetReadDeadline(time.Now().Add(60 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := healthz(c); err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	third, err := net.Dial("tcp", addr) // the kernel's backlog takes it
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	answered := make(chan error, 1)
	go func() { answered <- healthz(third) }()
	select {
	case err := <-answered:
		t.Fatalf("a third connection was served while two were open (%v)", err)
	case <-time.After(time.Second):
	}
	held[0].Close()
	if err := <-answered; err != nil {
		t.Errorf("the third connection, once one closed: %v", err)
	}
}
