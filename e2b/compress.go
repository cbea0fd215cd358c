// Compressed Connect messages: gzip, as connect-go serves it, but with a
// decompressor that stops at the message cap.

package e2b

import (
	"compress/gzip"
	"errors"
	"io"

	"connectrpc.com/connect"
)

// maxMessageBytes caps one Connect message, once decompressed.
const maxMessageBytes = 1 << 20

// errMessageTooLarge is what a capped decompressor gives past the cap.
var errMessageTooLarge = errors.New("e2b: a compressed message over the message cap")

// connectOptions are the options of the sandbox side's Connect handlers.
// connect-go checks a decompressed message against the read cap, but
// decompresses the rest of an oversized one to learn its size: a megabyte
// of compressed zeros then costs a gigabyte of inflating on the host. The
// gzip here gives an error after the cap, so that such a message costs no
// more than one within it.
func connectOptions() []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithReadMaxBytes(maxMessageBytes),
		connect.WithCompressMinBytes(maxMessageBytes),
		connect.WithCompression("gzip",
			func() connect.Decompressor { return &cappedGzip{} },
			func() connect.Compressor { return gzip.NewWriter(nil) }),
	}
}

// cappedGzip is a gzip decompressor that gives at most maxMessageBytes+1
// bytes (what connect-go reads to tell an oversized message) and then
// fails.
type cappedGzip struct {
	zr   *gzip.Reader
	left int64
}

func (c *cappedGzip) Read(p []byte) (int, error) {
	if c.zr == nil {
		return 0, io.ErrUnexpectedEOF
	}
	if c.left <= 0 {
		return 0, errMessageTooLarge
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.zr.Read(p)
	c.left -= int64(n)
	return n, err
}

func (c *cappedGzip) Reset(r io.Reader) error {
	c.left = maxMessageBytes + 1
	if c.zr == nil {
		zr, err := gzip.NewReader(r)
		if err != nil {
			return err
		}
		c.zr = zr
		return nil
	}
	return c.zr.Reset(r)
}

func (c *cappedGzip) Close() error {
	if c.zr == nil {
		return nil
	}
	return c.zr.Close()
}
