package egress

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"
)

// dialTimeout bounds one connection to an upstream address; resolveTimeout
// bounds the lookup of a name.
const (
	dialTimeout    = 10 * time.Second
	resolveTimeout = 10 * time.Second
)

// lookup resolves an allowed name that Resolve does not pin, with the
// configured resolver, as an absolute name (no search domains). The
// addresses come back unmapped (an IPv4-mapped IPv6 address as IPv4).
func (p *Proxy) lookup(ctx context.Context, host string) ([]netip.Addr, error) {
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	addrs, err := p.resolver.LookupNetIP(ctx, "ip", host+".")
	if err != nil {
		return nil, err
	}
	if len(addrs) == 0 {
		return nil, errors.New("no addresses")
	}
	out := make([]netip.Addr, len(addrs))
	for i, a := range addrs {
		out[i] = a.Unmap().WithZone("")
	}
	return out, nil
}

// lookupReason says in a few words why a lookup failed, for a note.
func lookupReason(err error) string {
	var de *net.DNSError
	switch {
	case errors.As(err, &de) && de.IsNotFound:
		return "the name does not exist"
	case errors.As(err, &de) && de.IsTimeout, errors.Is(err, context.DeadlineExceeded):
		return "the lookup timed out"
	default:
		return "the lookup failed"
	}
}

// dial connects to the addresses d checked, in order, and to nothing else:
// never to the name again. The connection is the run's: Close ends it.
func (r *Run) dial(d decision) (net.Conn, error) {
	if !d.allowed || len(d.addrs) == 0 {
		return nil, fmt.Errorf("egress: %s: no checked address to connect to", d)
	}
	ctx, cancel := r.context(dialTimeout)
	defer cancel()
	var dialer net.Dialer
	var errs []error
	for _, a := range d.addrs {
		c, err := dialer.DialContext(ctx, "tcp", netip.AddrPortFrom(a, uint16(d.port)).String())
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !r.track(c) {
			c.Close()
			return nil, fmt.Errorf("egress: %s: the run is closed", d)
		}
		return &trackedConn{Conn: c, r: r}, nil
	}
	return nil, fmt.Errorf("egress: connect to %s: %w", d, errors.Join(errs...))
}

// trackedConn is an upstream connection the run ends at its Close; its own
// Close forgets it.
type trackedConn struct {
	net.Conn
	r *Run
}

func (c *trackedConn) Close() error {
	c.r.untrack(c.Conn)
	return c.Conn.Close()
}

// CloseWrite half-closes the connection when the transport can.
func (c *trackedConn) CloseWrite() error { return closeWrite(c.Conn) }
