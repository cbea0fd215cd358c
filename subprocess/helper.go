package subprocess

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"syscall"

	"github.com/moatsandbox/moat/subprocess/internal/helper"
)

// The helper stage lives in package helper (subprocess/internal/helper),
// which this package imports for it: a re-executed moat becomes the helper
// in that package's init, which the Go runtime runs before the inits of
// the packages it does not depend on (see its doc). What the host side uses
// of it, under the names this package has always used:
type (
	spec     = helper.Spec
	rlimit   = helper.Rlimit
	lockSpec = helper.LockSpec
	rootSpec = helper.RootSpec
)

const (
	helperArg0 = helper.Arg0
	statusFD   = helper.StatusFD
	reaperArg0 = helper.ReaperArg0
	prlimit    = helper.Prlimit
)

var (
	encodeReport = helper.EncodeReport
	decodeReport = helper.DecodeReport
	reportLen    = helper.ReportLen
	reaperELF    = helper.ReaperELF
)

// helperStatus is the helper's report, parsed.
type helperStatus struct {
	err      string // set-up failure, before python3 ran
	exited   bool
	code     int
	signaled bool
	signal   syscall.Signal
	cpuMS    int64
}

// parseStatus reads what the helper wrote on its status pipe: "started\n"
// (for a pre-started run), then a line "error STEP: REASON" or the report
// of python3's end (internal/helper/reaper.go). ok is false when there is neither.
func parseStatus(b []byte) (st helperStatus, ok bool) {
	b = bytes.TrimPrefix(b, []byte("started\n"))
	if len(b) == 0 {
		return helperStatus{}, false
	}
	if rest, ok := bytes.CutPrefix(b, []byte("error ")); ok {
		return helperStatus{err: strings.TrimSpace(string(rest))}, true
	}
	ws, ru, ok := decodeReport(b)
	if !ok {
		return helperStatus{err: "unreadable helper status " + strconv.Quote(tail(b, 64))}, true
	}
	st.cpuMS = (ru.Utime.Nano() + ru.Stime.Nano()) / 1e6
	switch {
	case ws.Exited():
		st.exited, st.code = true, ws.ExitStatus()
	case ws.Signaled():
		st.signaled, st.signal = true, ws.Signal()
	default:
		return helperStatus{err: fmt.Sprintf("helper reported wait status %#x, neither an exit nor a signal", uint32(ws))}, true
	}
	return st, true
}
