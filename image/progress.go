package image

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// Progress reports the steps of a build or an import as lines that start
// "image: [ELAPSED] ", the time since the Progress was made. Step lines
// ([Progress.Say]) stay; the lines within a step ([Progress.Status],
// [Progress.Bar]) are plain lines as well unless the writer is a terminal,
// where they rewrite one status line ("\r", erase to the end) that the next
// step line replaces. A nil *Progress, or one with a nil writer, discards
// everything. It is safe for concurrent use.
type Progress struct {
	w     io.Writer
	tty   bool
	start time.Time

	mu      sync.Mutex
	shown   bool   // a status line is on the terminal
	barStep string // the label of the bar being drawn, in plain mode
	barLast int    // the last quarter printed of it, in plain mode
}

// NewProgress returns a Progress writing to w; terminal says that w is a
// terminal.
func NewProgress(w io.Writer, terminal bool) *Progress {
	return &Progress{w: w, tty: terminal, start: time.Now()}
}

func (p *Progress) prefix() string {
	return fmt.Sprintf("image: [%6.1fs] ", time.Since(p.start).Seconds())
}

// Say writes a step line.
func (p *Progress) Say(format string, args ...any) {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	line := p.prefix() + fmt.Sprintf(format, args...)
	if p.tty {
		line = "\r\x1b[K" + line
		p.shown = false
	}
	io.WriteString(p.w, line+"\n")
}

// Status writes a line within a step: on a terminal it replaces the status
// line, cut to 100 characters; otherwise it is a plain line.
func (p *Progress) Status(format string, args ...any) {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.status(fmt.Sprintf(format, args...))
}

// status writes msg as the status line; p.mu is held.
func (p *Progress) status(msg string) {
	line := p.prefix() + msg
	if !p.tty {
		io.WriteString(p.w, line+"\n")
		return
	}
	if r := []rune(line); len(r) > 100 {
		line = string(r[:99]) + "…"
	}
	io.WriteString(p.w, "\r\x1b[K"+line)
	p.shown = true
}

// Bar shows how far a step of known size is: done of total bytes. On a
// terminal it redraws a bar on the status line; otherwise it writes a
// plain line when the step passes a quarter (and at its end), so that a
// log gets at most five lines of it.
func (p *Progress) Bar(label string, done, total int64) {
	if p == nil || p.w == nil || total <= 0 {
		return
	}
	done = min(max(done, 0), total)
	pct := int(done * 100 / total)
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.tty {
		if p.barStep != label {
			p.barStep, p.barLast = label, -1
		}
		q := pct / 25
		if q == p.barLast {
			return
		}
		p.barLast = q
		io.WriteString(p.w, fmt.Sprintf("%s%s: %3d%% (%s of %s)\n", p.prefix(), label, pct, HumanSize(done), HumanSize(total)))
		return
	}
	const width = 30
	n := int(done * width / total)
	p.status(fmt.Sprintf("%s: [%s%s] %3d%% %s of %s", label, strings.Repeat("#", n), strings.Repeat(".", width-n), pct, HumanSize(done), HumanSize(total)))
}

// Clear removes the status line from a terminal; elsewhere it does
// nothing.
func (p *Progress) Clear() {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty && p.shown {
		io.WriteString(p.w, "\r\x1b[K")
		p.shown = false
	}
}

// CountingWriter counts the bytes written through it and reports them to
// a Progress's Bar.
type CountingWriter struct {
	W     io.Writer
	P     *Progress
	Label string
	Total int64

	n    int64
	last time.Time
}

func (c *CountingWriter) Write(b []byte) (int, error) {
	n, err := c.W.Write(b)
	c.n += int64(n)
	// Redraw at most ten times a second; the plain mode prints quarters
	// only anyway.
	if now := time.Now(); now.Sub(c.last) >= 100*time.Millisecond || c.n >= c.Total {
		c.last = now
		c.P.Bar(c.Label, c.n, c.Total)
	}
	return n, err
}

// Done reports the last count, however recently the bar was drawn.
func (c *CountingWriter) Done() { c.P.Bar(c.Label, c.n, c.Total) }
