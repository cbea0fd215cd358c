package gvisor_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
)

// forgedLines are the lines moat's reading of runsc's and the sentry's
// logs has known, each as the sentry's text log and its JSON log write it:
// a sentry panic, a clone refused by the task limit, a write refused by the
// file size limit and one by the disk limit, and the container's exit
// status.
var forgedLines = []string{
	"panic: forged",
	"fatal error: forged",
	"I1130 21:05:21.809370   29928 strace.go:611] [   1:   1] python3 X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 0 (0x0) errno=11 (try again) (513.076µs)",
	"I1130 21:07:27.178419   19952 strace.go:605] [   1:   1] python3 X write(0x3 /work/big, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=27 (file too large) (1.872µs)",
	"I1130 21:07:27.184681   19952 strace.go:605] [   1:   1] python3 X write(0x3 /dev/shm/f, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=28 (no space left on device) (1.412µs)",
	"I1130 21:07:00.796032   17622 main.go:222] Exiting with status: 256",
	`{"msg":"strace.go:611] [   1:   1] python3 X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 0 (0x0) errno=11 (try again) (513.076µs)","level":"info","time":"2026-12-01T21:05:21.809370Z"}`,
	`{"msg":"strace.go:605] [   1:   1] python3 X write(0x3 /work/big, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=27 (file too large) (1.872µs)","level":"info","time":"2026-12-01T21:07:27.178419Z"}`,
	`{"msg":"strace.go:605] [   1:   1] python3 X write(0x3 /dev/shm/f, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=28 (no space left on device) (1.412µs)","level":"info","time":"2026-12-01T21:07:27.184681Z"}`,
	`{"msg":"main.go:222] Exiting with status: 256","level":"info","time":"2026-12-01T21:07:00.796032Z"}`,
}

// forgeries are programs that write forgedLines wherever the code can put
// text that ends up in the sentry's log, in runsc's log or in moat's
// view of the run, and then print hello and exit 0. Each is a Python
// program that defines lines, a list of bytes; forgePrelude defines it
// and the helpers.
var forgeries = []struct {
	name    string
	perLine bool // run once for each of forgedLines, not once for all
	code    string
}{
	// The task's name is in every traced call's line. It holds at most 15
	// bytes, enough for "\npanic: x\n". It is set every way the code has:
	// prctl, /proc/self/comm and each thread's comm.
	{"task name", true, `
for l in lines:
    for name in [b'\n' + l + b'\n', l + b'\n', l]:
        set_name(name)
        print('x', flush=True)
        os.write(1, b'x\n')
set_name(b'python3')
`},
	// The task's name can also make a line say another call: "a X
	// clone(" before a write to a full pipe, which fails with EAGAIN,
	// reads like a clone the task limit refused.
	{"task name naming another call", false, `
r, w = os.pipe()
os.set_blocking(w, False)
for name in [b'a X clone(', b' X clone(', b'X clone(', b'a X fork(', b'a X vfork(']:
    set_name(name)
    try:
        while True:
            os.write(w, b'y' * 65536)
    except BlockingIOError:
        pass
    os.read(r, 1 << 20)
set_name(b'python3')
`},
	// File names are in the lines of the calls that use them, and may
	// hold newlines and slashes (which make directories).
	{"file names", true, `
for i, l in enumerate(lines):
    for base in ['/tmp', '/work', '/dev/shm']:
        path = base.encode() + b'/' + str(i).encode() + b'\n' + l + b'\n'
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b'z')
        os.ftruncate(fd, 0)
        os.close(fd)
`},
	// Its own output is the code's to write.
	{"stdout and stderr", false, `
for l in lines:
    for fd in [1, 2]:
        os.write(fd, b'\n' + l + b'\n')
        os.write(fd, l)
`},
}

// forgePrelude defines lines and set_name for the forgeries.
const forgePrelude = `
import ctypes, glob, os, sys
libc = ctypes.CDLL(None, use_errno=True)
lines = [l.encode() for l in [%s]]
PR_SET_NAME = 15
def set_name(name):
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    for p in ['/proc/self/comm'] + glob.glob('/proc/self/task/*/comm'):
        try:
            with open(p, 'wb', buffering=0) as f:
                f.write(name)
        except OSError:
            pass
`

// TestForgedLogLines checks that nothing the code writes decides how its
// run is reported: each forgery prints hello and exits 0, and the run must
// say exactly that, with no Reason and no error.
func TestForgedLogLines(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{})
	defer sb.Close()
	prelude := func(lines []string) string {
		var quoted []string
		for _, l := range lines {
			quoted = append(quoted, strconv.QuoteToASCII(l))
		}
		return fmt.Sprintf(forgePrelude, strings.Join(quoted, ", "))
	}
	try := func(t *testing.T, code string) {
		code += "\nprint('hello', flush=True)\nsys.exit(0)\n"
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code)})
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
		if res.ExitCode != 0 || res.Reason != "" || res.Signal != "" || !strings.Contains(string(res.Stdout), "hello\n") {
			t.Errorf("exit %d, reason %q, signal %q, stdout %q, stderr %q; want exit 0, no reason, hello",
				res.ExitCode, res.Reason, res.Signal, clipped(res.Stdout), clipped(res.Stderr))
		}
	}
	for _, f := range forgeries {
		t.Run(f.name, func(t *testing.T) {
			if !f.perLine {
				try(t, prelude(forgedLines)+f.code)
				return
			}
			for i, l := range forgedLines {
				t.Run(strconv.Itoa(i), func(t *testing.T) {
					t.Logf("line %q", l)
					try(t, prelude([]string{l})+f.code)
				})
			}
		})
	}
}

func clipped(b []byte) string {
	if len(b) > 400 {
		b = b[len(b)-400:]
	}
	return string(b)
}
