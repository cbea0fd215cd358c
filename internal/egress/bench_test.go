package egress

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"

	"github.com/moatsandbox/moat"
)

// BenchmarkFetch compares one plain http:// fetch from a loopback server,
// direct and through the proxy, small (latency) and 4 MiB (throughput).
func BenchmarkFetch(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		n, _ := strconv.Atoi(req.URL.Query().Get("n"))
		w.Header().Set("Content-Length", strconv.Itoa(n))
		buf := make([]byte, 32<<10)
		for n > 0 {
			k := min(n, len(buf))
			w.Write(buf[:k])
			n -= k
		}
	}))
	defer srv.Close()
	_, portStr, _ := splitHostPortStr(srv.Listener.Addr().String())
	for _, size := range []int{100, 4 << 20} {
		for _, via := range []string{"direct", "proxy"} {
			b.Run(fmt.Sprintf("%s/%d", via, size), func(b *testing.B) {
				client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
				target := fmt.Sprintf("http://127.0.0.1:%s/?n=%d", portStr, size)
				if via == "proxy" {
					p, err := New(Config{Egress: moat.Egress{Network: &moat.Network{
						Allow:   []string{"pypi.test:" + portStr},
						Resolve: map[string]string{"pypi.test": "127.0.0.1"},
					}}, CADir: b.TempDir()})
					if err != nil {
						b.Fatal(err)
					}
					r := p.NewRun()
					defer r.Close()
					l := listenLoopbackTest(b)
					go r.Serve(l)
					pu, _ := url.Parse("http://" + l.Addr().String())
					client.Transport.(*http.Transport).Proxy = http.ProxyURL(pu)
					target = fmt.Sprintf("http://pypi.test:%s/?n=%d", portStr, size)
				}
				b.SetBytes(int64(size))
				for b.Loop() {
					resp, err := client.Get(target)
					if err != nil {
						b.Fatal(err)
					}
					n, _ := io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if n != int64(size) {
						b.Fatalf("%d bytes", n)
					}
				}
			})
		}
	}
}

func splitHostPortStr(s string) (string, string, error) {
	h, p, err := splitHostPort(s, 0)
	return h, strconv.Itoa(p), err
}

func listenLoopbackTest(b *testing.B) net.Listener {
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	return l
}
