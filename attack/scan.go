package attack

import (
	"bytes"
	"strings"
	"sync"
)

// A scanner watches one output stream as the sandbox writes it. It looks for
// needles anywhere in the stream, however long, across write boundaries, and
// keeps the first few error reports of the program. Its memory is bounded
// whatever the stream holds.
type scanner struct {
	mu      sync.Mutex // guards everything below
	needles [][]byte
	found   []bool
	tail    []byte         // the last bytes seen, to find a needle cut by a write
	notify  map[int]func() // called when needles[i] is first found

	errPrefix []byte
	okPrefix  []byte
	line      []byte // the start of the current line, at most maxLine bytes
	errs      []errReport
	okText    string // what follows the first success marker on its line
}

// An errReport is one "MOAT-ERR" line of a program.
type errReport struct {
	Class  string // e.g. "permission_denied"
	Detail string // where and what, as the program saw it
}

const (
	maxLine = 512 // bytes of a line kept to parse an error report
	maxErrs = 16  // error reports kept
)

func newScanner(nonce string, needles ...string) *scanner {
	s := &scanner{
		errPrefix: []byte(marker(kindErr, nonce) + " "),
		okPrefix:  []byte(marker(kindOK, nonce) + " "),
	}
	for _, n := range needles {
		s.needles = append(s.needles, []byte(n))
	}
	s.found = make([]bool, len(s.needles))
	return s
}

// onFound has f called, from Write, when needles[i] is first found. f must
// not block.
func (s *scanner) onFound(i int, f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.notify == nil {
		s.notify = make(map[int]func())
	}
	s.notify[i] = f
}

// Write never fails: a sandbox must be free to write all it has.
func (s *scanner) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(p)
	maxNeedle := 0
	for i, nd := range s.needles {
		maxNeedle = max(maxNeedle, len(nd))
		if s.found[i] || len(nd) == 0 {
			continue
		}
		edge := append(s.tail[:len(s.tail):len(s.tail)], p[:min(len(p), len(nd)-1)]...)
		s.found[i] = bytes.Contains(edge, nd) || bytes.Contains(p, nd)
		if f := s.notify[i]; s.found[i] && f != nil {
			f()
		}
	}
	if keep := maxNeedle - 1; keep > 0 {
		if len(p) >= keep {
			s.tail = append(s.tail[:0], p[len(p)-keep:]...)
		} else {
			s.tail = append(s.tail, p...)
			s.tail = s.tail[max(0, len(s.tail)-keep):]
		}
	}
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		seg := p
		if i >= 0 {
			seg = p[:i]
		}
		if room := maxLine - len(s.line); room > 0 {
			s.line = append(s.line, seg[:min(len(seg), room)]...)
		}
		if i < 0 {
			break
		}
		s.endLine()
		p = p[i+1:]
	}
	return n, nil
}

// endLine parses the current line and starts the next.
func (s *scanner) endLine() {
	if s.okText == "" && bytes.HasPrefix(s.line, s.okPrefix) {
		s.okText = strings.ToValidUTF8(string(s.line[len(s.okPrefix):]), "\uFFFD")
	}
	if len(s.errs) < maxErrs && bytes.HasPrefix(s.line, s.errPrefix) {
		rest := strings.ToValidUTF8(string(s.line[len(s.errPrefix):]), "\uFFFD")
		class, detail, _ := strings.Cut(rest, " ")
		if validClass(class) {
			s.errs = append(s.errs, errReport{Class: class, Detail: strings.TrimSpace(detail)})
		}
	}
	s.line = s.line[:0]
}

// finish parses a last line that had no newline.
func (s *scanner) finish() {
	if len(s.line) > 0 {
		s.endLine()
	}
}

func validClass(c string) bool {
	if c == "" || len(c) > 64 {
		return false
	}
	for _, r := range c {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '_' {
			return false
		}
	}
	return true
}
