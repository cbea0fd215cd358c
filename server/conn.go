package server

import (
	"net"
	"net/http"
	"sync"
	"time"
)

// limitListener accepts at most cap(sem) connections open at once: Accept
// waits until one closes, leaving further connections in the kernel's listen
// backlog. Close ends a waiting Accept.
type limitListener struct {
	net.Listener
	sem     chan struct{}
	done    chan struct{}
	once    sync.Once
	changed func(delta int)
}

func newLimitListener(l net.Listener, n int, changed func(delta int)) *limitListener {
	return &limitListener{Listener: l, sem: make(chan struct{}, n), done: make(chan struct{}), changed: changed}
}

func (l *limitListener) Accept() (net.Conn, error) {
	select {
	case l.sem <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.sem
		return nil, err
	}
	l.changed(1)
	return &limitConn{Conn: c, l: l}, nil
}

func (l *limitListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// limitConn gives its place back when closed, once.
type limitConn struct {
	net.Conn
	l    *limitListener
	once sync.Once
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.l.changed(-1)
		<-c.l.sem
	})
	return err
}

// deadlineWriter is the ResponseWriter every handler gets: it sets the
// connection's write deadline to timeout from now before each write and
// flush, so that a client that stops reading fails the write after timeout
// instead of holding the handler for ever, while a long stream that keeps
// moving is not cut. A write that fails makes net/http cancel the request's
// context.
type deadlineWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
}

func newDeadlineWriter(w http.ResponseWriter, timeout time.Duration) *deadlineWriter {
	return &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), timeout: timeout}
}

// extend moves the write deadline to timeout from now.
func (w *deadlineWriter) extend() {
	w.rc.SetWriteDeadline(time.Now().Add(w.timeout))
}

func (w *deadlineWriter) Write(p []byte) (int, error) {
	w.extend()
	return w.ResponseWriter.Write(p)
}

// FlushError is what http.ResponseController.Flush calls.
func (w *deadlineWriter) FlushError() error {
	w.extend()
	return w.rc.Flush()
}

func (w *deadlineWriter) Flush() { w.FlushError() }

// Unwrap lets http.ResponseController reach the connection's writer.
func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
