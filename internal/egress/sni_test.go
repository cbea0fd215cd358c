package egress

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"testing"
	"time"
)

// TestReadClientHello: the server name comes out, and the bytes returned
// are exactly the bytes the client sent, so the upstream sees its hello.
func TestReadClientHello(t *testing.T) {
	for _, name := range []string{"pypi.test", ""} {
		a, b := net.Pipe()
		sent := &bytes.Buffer{}
		done := make(chan struct{})
		go func() {
			defer close(done)
			tc := tls.Client(&teeConn{Conn: a, w: sent}, &tls.Config{ServerName: name, InsecureSkipVerify: true})
			tc.Handshake()
			a.Close()
		}()
		b.SetDeadline(time.Now().Add(10 * time.Second))
		sni, hello, err := readClientHello(b)
		b.Close()
		if err != nil || sni != name {
			t.Fatalf("%q: sni %q, %v", name, sni, err)
		}
		<-done
		if !bytes.HasPrefix(sent.Bytes(), hello) || len(hello) < 50 {
			t.Errorf("%q: %d bytes returned are not what the client sent", name, len(hello))
		}
	}
	if _, _, err := readClientHello(bytes.NewReader([]byte("GET / HTTP/1.1\r\n\r\n"))); err == nil {
		t.Error("an HTTP request read as a ClientHello")
	}
	if _, _, err := readClientHello(bytes.NewReader(nil)); err == nil {
		t.Error("nothing read as a ClientHello")
	}
}

type teeConn struct {
	net.Conn
	w io.Writer
}

func (c *teeConn) Write(p []byte) (int, error) {
	c.w.Write(p)
	return c.Conn.Write(p)
}
