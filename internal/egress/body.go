package egress

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"html"
	"io"
	"net/http"
	"net/url"
	"strings"
)

// needle is one form a secret's real value may take in a response's body,
// and what replaces it there: the placeholder in the same form.
type needle struct {
	find, repl []byte
}

// bodyNeedles is every form of every secret's real value that hideBody
// turns back into the placeholder: the value as it is; URL-escaped as a
// query and as a path; JSON-string-escaped (with and without the HTML
// escapes of encoding/json); HTML-escaped; and base64 of it in the standard
// and the URL-safe alphabet, whole (with and without padding) and as the
// run of characters that stands for the value alone when it starts 0, 1 or
// 2 bytes into a 3-byte group (base64 of "user:" + value, value + more).
// Forms equal to another are listed once; the longest first.
func (r *runSecrets) bodyNeedles() []needle {
	seen := map[string]bool{}
	var ns []needle
	add := func(find, repl string) {
		if find == "" || seen[find] {
			return
		}
		seen[find] = true
		ns = append(ns, needle{[]byte(find), []byte(repl)})
	}
	for i := range r.set.secrets {
		v, ph := r.set.secrets[i].value, r.placeholders[i]
		add(v, ph)
		add(url.QueryEscape(v), ph)
		add(url.PathEscape(v), ph)
		add(jsonEscape(v, true), ph)
		add(jsonEscape(v, false), ph)
		add(html.EscapeString(v), ph)
		for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding} {
			add(enc.EncodeToString([]byte(v)), enc.EncodeToString([]byte(ph)))
			raw := enc.WithPadding(base64.NoPadding)
			add(raw.EncodeToString([]byte(v)), raw.EncodeToString([]byte(ph)))
			for off := range 3 {
				add(base64Core(raw, v, off), base64Core(raw, ph, off))
			}
		}
	}
	// Longest first: at one position the longest form wins (the padded
	// base64 over the unpadded one).
	for i := 1; i < len(ns); i++ {
		for j := i; j > 0 && len(ns[j].find) > len(ns[j-1].find); j-- {
			ns[j], ns[j-1] = ns[j-1], ns[j]
		}
	}
	return ns
}

// jsonEscape is s as the inside of a JSON string, with or without the
// HTML escapes (\u003c, \u003e, \u0026) encoding/json adds by default.
func jsonEscape(s string, escapeHTML bool) string {
	var b bytes.Buffer
	e := json.NewEncoder(&b)
	e.SetEscapeHTML(escapeHTML)
	e.Encode(s) // a string always encodes
	return strings.TrimSuffix(strings.TrimPrefix(strings.TrimSuffix(b.String(), "\n"), `"`), `"`)
}

// base64Core is the part of the unpadded base64 of s that depends on s
// alone when s starts off bytes (0, 1 or 2) into a 3-byte group and more
// bytes may follow it: the characters whose 6 bits all come from s.
func base64Core(enc *base64.Encoding, s string, off int) string {
	e := enc.EncodeToString(append(make([]byte, off), s...))
	start := (8*off + 5) / 6
	end := 8 * (off + len(s)) / 6
	if end <= start {
		return ""
	}
	return e[start:end]
}

// bodyAllowed reports whether a response of status to a request of method
// has a body (RFC 9110: none for HEAD, 1xx, 204 and 304).
func bodyAllowed(method string, status int) bool {
	return method != http.MethodHead && status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// hideBody prepares resp, a final response from a secret's host to req, for
// the sandbox. A response that has a body gets it through a bodyHider (the
// secrets' values in every form of bodyNeedles become their placeholders)
// and goes out chunked (close-delimited to an HTTP/1.0 request), its
// Content-Length dropped since the length changes. A response without a
// body (HEAD, 204, 304) is left as it is.
//
// A body under a Content-Encoding other than identity could hold a value
// the needles cannot see: hideBody then returns a non-empty refusal (no
// value in it) and leaves resp alone; the caller answers 502 instead.
// Requests to a secret's host ask for identity (askIdentity), so a
// well-behaved host never sends one.
func (r *runSecrets) hideBody(resp *http.Response, req *http.Request) (refusal string) {
	if !bodyAllowed(req.Method, resp.StatusCode) {
		return ""
	}
	for _, v := range resp.Header.Values("Content-Encoding") {
		for _, coding := range strings.Split(v, ",") {
			if c := strings.TrimSpace(coding); c != "" && !strings.EqualFold(c, "identity") {
				return "the response is encoded (Content-Encoding " + clean(c) + "), which would hide a secret's value from moat"
			}
		}
	}
	resp.Body = &bodyHider{ReadCloser: resp.Body, needles: r.bodyNeedles()}
	resp.ContentLength = -1
	resp.Header.Del("Content-Length")
	if req.ProtoAtLeast(1, 1) {
		resp.ProtoMajor, resp.ProtoMinor, resp.Proto = 1, 1, "HTTP/1.1"
		resp.TransferEncoding = []string{"chunked"}
	} else {
		resp.TransferEncoding = nil
		resp.Close = true
	}
	return ""
}

// askIdentity makes h, a request's header bound for a secret's host, ask
// for an unencoded response (a compressed body would hide a value from
// hideBody).
func askIdentity(h http.Header) {
	h.Set("Accept-Encoding", "identity")
}

// bodyHider is a response's body with every needle replaced. Between two
// reads of the body it wraps it holds back only the end of what it read
// that a needle could start with (at most the longest needle's length less
// one byte), and gives out all the rest after each of them, so a stream
// still streams.
type bodyHider struct {
	io.ReadCloser
	needles []needle // longest first
	pending []byte   // read, not yet decided: a needle may start in it
	out     []byte   // decided, not yet returned
	err     error    // the wrapped body's error, returned once out is empty
	chunk   []byte
	next    []int // next[j]: where needles[j] next occurs in pending at or after the scan (-1: nowhere)
}

// bodyHiderChunk is how much bodyHider reads from the body it wraps at once.
const bodyHiderChunk = 32 << 10

func (b *bodyHider) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for len(b.out) == 0 {
		if b.err != nil {
			return 0, b.err
		}
		if b.chunk == nil {
			b.chunk = make([]byte, bodyHiderChunk)
		}
		n, err := b.ReadCloser.Read(b.chunk)
		b.pending = append(b.pending, b.chunk[:n]...)
		b.err = err
		b.scan(err != nil)
	}
	n := copy(p, b.out)
	b.out = b.out[n:]
	return n, nil
}

// scan moves what of pending is decided to out, replacing each needle:
// leftmost first, the longest at one position. Unless final, the end of
// pending that is the start of a needle stays in pending.
func (b *bodyHider) scan(final bool) {
	buf := b.pending
	limit := len(buf) // a needle starting before limit ends inside buf, or not at all
	if !final {
		limit -= b.cutShort(buf)
	}
	if cap(b.next) < len(b.needles) {
		b.next = make([]int, len(b.needles))
	}
	b.next = b.next[:len(b.needles)]
	for j, nd := range b.needles {
		b.next[j] = bytes.Index(buf, nd.find)
	}
	out := b.out[:0]
	pos := 0
	for {
		at, k := -1, -1
		for j, nd := range b.needles {
			if b.next[j] >= 0 && b.next[j] < pos {
				if i := bytes.Index(buf[pos:], nd.find); i >= 0 {
					b.next[j] = pos + i
				} else {
					b.next[j] = -1
				}
			}
			if i := b.next[j]; i >= 0 && (at < 0 || i < at) { // longest first: ties keep the first
				at, k = i, j
			}
		}
		if at < 0 || at >= limit {
			break
		}
		out = append(out, buf[pos:at]...)
		out = append(out, b.needles[k].repl...)
		pos = at + len(b.needles[k].find)
	}
	cut := max(pos, limit)
	out = append(out, buf[pos:cut]...)
	b.out = out
	b.pending = append(buf[:0], buf[cut:]...)
}

// cutShort is the length of the longest end of buf that is a needle's
// start but not the whole needle: what a later read may complete.
func (b *bodyHider) cutShort(buf []byte) int {
	longest := 0
	if len(b.needles) > 0 {
		longest = len(b.needles[0].find)
	}
	for k := min(longest-1, len(buf)); k > 0; k-- {
		tail := buf[len(buf)-k:]
		for _, nd := range b.needles {
			if len(nd.find) > k && bytes.HasPrefix(nd.find, tail) {
				return k
			}
		}
	}
	return 0
}
