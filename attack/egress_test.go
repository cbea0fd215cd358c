package attack

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// openProxy is a proxy with no policy at all, the worst an egress proxy
// could be: it tunnels and forwards to any host (each name the harness
// pins goes to 127.0.0.1), and puts the secret's real value in place of
// its placeholder for every host. Through it every egress probe must get
// through, or the probes could not tell a hole from a wall.
func openProxy(t *testing.T, placeholder, value string) string {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	addr := func(hostport string) string {
		h, p, _ := net.SplitHostPort(hostport)
		if strings.HasSuffix(h, ".attack.test") {
			h = "127.0.0.1"
		}
		return net.JoinHostPort(h, p)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				if req.Method == http.MethodConnect {
					up, err := net.DialTimeout("tcp", addr(req.Host), 2*time.Second)
					if err != nil {
						io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
						return
					}
					defer up.Close()
					io.WriteString(c, "HTTP/1.1 200 OK\r\n\r\n")
					go io.Copy(up, br)
					io.Copy(c, up)
					return
				}
				hostport := req.URL.Host
				if req.URL.Port() == "" {
					hostport += ":80"
				}
				up, err := net.DialTimeout("tcp", addr(hostport), 2*time.Second)
				if err != nil {
					io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
					return
				}
				defer up.Close()
				for k, vs := range req.Header {
					for i := range vs {
						vs[i] = strings.ReplaceAll(vs[i], placeholder, value)
					}
					req.Header[k] = vs
				}
				req.URL.RawQuery = strings.ReplaceAll(req.URL.RawQuery, placeholder, value)
				req.Write(up)
				io.Copy(c, up)
			}()
		}
	}()
	return "http://" + l.Addr().String()
}

// TestEgressProbesSeeHoles runs the egress probes on the host, with no
// sandbox and a proxy that enforces nothing: each must get through, by
// the host-side proof its judge looks for.
func TestEgressProbesSeeHoles(t *testing.T) {
	env := plant(t)
	placeholder := "moat-secret-0123456789abcdef0123456789abcdef"
	proxy := openProxy(t, placeholder, env.egress.value)
	sb := hostSandbox{wall: 20 * time.Second, env: []string{
		"HTTP_PROXY=" + proxy, "HTTPS_PROXY=" + proxy, secretVar + "=" + placeholder}}
	for _, name := range EgressAttacks {
		t.Run(string(name), func(t *testing.T) {
			o := Run(context.Background(), sb, env, name)
			if o.Verdict != GotThrough {
				t.Fatalf("%s through a proxy that enforces nothing: %s (%s): %s", name, o.Verdict, o.How, o.Detail)
			}
			t.Logf("%s: %s (%s): %s", name, o.Verdict, o.How, o.Detail)
		})
	}
}

// With no proxy in the environment, the probes whose every way goes
// through one are blocked: each ran to its end, and the host saw nothing.
func TestEgressProbesBlockedWithoutProxy(t *testing.T) {
	env := plant(t)
	sb := hostSandbox{wall: 20 * time.Second}
	for _, name := range []Name{SNIFronting, SecretRead} {
		o := Run(context.Background(), sb, env, name)
		if o.Verdict != Blocked {
			t.Errorf("%s with no proxy: %s (%s): %s", name, o.Verdict, o.How, o.Detail)
		}
	}
}
