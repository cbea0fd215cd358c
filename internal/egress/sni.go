package egress

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"time"
)

// helloTimeout bounds the wait for a tunnel's TLS ClientHello after the
// proxy answered its CONNECT.
const helloTimeout = 10 * time.Second

// errHelloRead stops crypto/tls once it has parsed the ClientHello.
var errHelloRead = errors.New("egress: client hello read")

// readClientHello reads a TLS ClientHello from r with crypto/tls's own
// parser and returns the server name it asks for ("" if none) and every
// byte it read from r, which the caller forwards (or replays) so that the
// upstream sees the handshake exactly as the client sent it. The error is
// non-nil when the bytes are not a TLS ClientHello.
func readClientHello(r io.Reader) (sni string, hello []byte, err error) {
	rec := &recordingConn{r: r}
	var got bool
	srv := tls.Server(rec, &tls.Config{
		GetConfigForClient: func(hi *tls.ClientHelloInfo) (*tls.Config, error) {
			sni, got = hi.ServerName, true
			return nil, errHelloRead
		},
	})
	err = srv.Handshake()
	if got {
		return sni, rec.buf.Bytes(), nil
	}
	if err == nil {
		err = errors.New("no client hello")
	}
	return "", rec.buf.Bytes(), err
}

// recordingConn is the net.Conn crypto/tls reads a ClientHello through:
// it keeps what it reads and discards what crypto/tls writes (the alert
// that ends the handshake), so nothing reaches the client.
type recordingConn struct {
	r   io.Reader
	buf bytes.Buffer
}

func (c *recordingConn) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.buf.Write(p[:n])
	return n, err
}

func (c *recordingConn) Write(p []byte) (int, error)        { return len(p), nil }
func (c *recordingConn) Close() error                       { return nil }
func (c *recordingConn) LocalAddr() net.Addr                { return &net.TCPAddr{} }
func (c *recordingConn) RemoteAddr() net.Addr               { return &net.TCPAddr{} }
func (c *recordingConn) SetDeadline(t time.Time) error      { return nil }
func (c *recordingConn) SetReadDeadline(t time.Time) error  { return nil }
func (c *recordingConn) SetWriteDeadline(t time.Time) error { return nil }
