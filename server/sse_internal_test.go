package server

import (
	"bufio"
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestSSEUTF8Cut(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int
	}{
		{"", 0},
		{"abc", 3},
		{"a\xc3", 1},         // the first byte of é
		{"aé", 3},            //
		{"a\xe2\x82", 1},     // two bytes of €
		{"€\xf0\x9d\x84", 3}, // three bytes of 𝄞
		{"𝄞", 4},             //
		{"a\xff", 2},         // never a character
		{"a\xe2a", 3},        // cut short already: not held
		{"\x82\xac", 2},      // continuation bytes only
		{"a\xed\xa0", 3},     // the start of a surrogate, never valid
	} {
		if got := utf8Cut([]byte(c.in)); got != c.want {
			t.Errorf("utf8Cut(%q) = %d, want %d", c.in, got, c.want)
		}
	}
}

// FuzzSSEUTF8 writes text to a stream in the pieces the fuzzer chooses:
// the events' data, put together, is the text, and no event is empty or
// holds U+FFFD that the text does not.
func FuzzSSEUTF8(f *testing.F) {
	f.Add("aß€𝄞aß€𝄞", []byte{1, 2, 3, 5})
	f.Add(strings.Repeat("€", 30000), []byte{200, 1, 7})
	f.Fuzz(func(t *testing.T, text string, cuts []byte) {
		if !utf8.ValidString(text) {
			t.Skip("the property is for text")
		}
		rec := httptest.NewRecorder()
		e := newSSE(rec, 1<<30, func() { t.Error("overflow") })
		w := e.stream("stdout")
		b := []byte(text)
		for i := 0; len(b) > 0; i++ {
			n := len(b)
			if len(cuts) > 0 {
				n = min(n, int(cuts[i%len(cuts)])*int(cuts[i%len(cuts)])+1)
			}
			w.Write(b[:n])
			b = b[n:]
		}
		e.finish("result", map[string]string{})
		e.wait()
		var got strings.Builder
		sc := bufio.NewScanner(rec.Body)
		sc.Buffer(nil, 1<<20)
		name := ""
		for sc.Scan() {
			line := sc.Text()
			if v, ok := strings.CutPrefix(line, "event: "); ok {
				name = v
			}
			v, ok := strings.CutPrefix(line, "data: ")
			if !ok || name != "stdout" {
				continue
			}
			var d struct{ Data string }
			if err := json.Unmarshal([]byte(v), &d); err != nil {
				t.Fatal(err)
			}
			if d.Data == "" || strings.ContainsRune(d.Data, utf8.RuneError) && !strings.ContainsRune(text, utf8.RuneError) {
				t.Fatalf("event data %q", d.Data)
			}
			got.WriteString(d.Data)
		}
		if got.String() != text {
			t.Errorf("the events' data is %d bytes, not the %d written", got.Len(), len(text))
		}
	})
}
