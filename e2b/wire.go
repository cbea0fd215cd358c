// Bounds on the wire: Connect messages (compressed or not) stop at the
// message cap, and no answer echoes more than maxErrorMessage bytes of a
// request back in an error.

package e2b

import (
	"compress/gzip"
	"context"
	"errors"
	"io"
	"strings"

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
// more than one within it. Errors are cut to maxErrorMessage bytes.
func connectOptions() []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithInterceptors(errorCap{}),
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

// maxErrorMessage caps an error's message in an answer. Messages quote
// what the request named (a path, a sandbox id, a template), which can be
// as long as a header or a body may be, and JSON's escapes make a byte of
// it up to six: uncut, a 1MB E2b-Sandbox-Id header, sent without any key
// or token, was a 6MB answer, built whole in memory.
const maxErrorMessage = 1 << 10

// cutMessage returns msg cut to maxErrorMessage bytes, at a character's
// boundary, with a mark where it was cut.
func cutMessage(msg string) string {
	if len(msg) <= maxErrorMessage {
		return msg
	}
	return strings.ToValidUTF8(msg[:maxErrorMessage], "") + "... (cut)"
}

// errorCap is a Connect interceptor that cuts the message of the error a
// handler returns, keeping its code.
type errorCap struct{}

func capError(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if ce, ok := errors.AsType[*connect.Error](err); ok {
		msg = ce.Message()
	}
	if len(msg) <= maxErrorMessage {
		return err
	}
	return connect.NewError(connect.CodeOf(err), errors.New(cutMessage(msg)))
}

func (errorCap) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, capError(err)
	}
}

func (errorCap) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (errorCap) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return capError(next(ctx, conn))
	}
}
