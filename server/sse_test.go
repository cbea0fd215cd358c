package server_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// mixedCode writes the UTF-8 bytes of mixedText to stdout and stderr in
// slices of odd sizes, flushing each, with a pause now and then so that the
// server sends some of it before the rest comes: slices end inside
// characters of two, three and four bytes.
const mixedCode = `import sys, time
s = 'aß€𝄞' * 6000 + '\n'
b = s.encode()
sizes = [1, 2, 3, 5, 7, 11, 13, 4093]
i = k = 0
while i < len(b):
    n = sizes[k % len(sizes)]
    for f in (sys.stdout.buffer, sys.stderr.buffer):
        f.write(b[i:i+n])
        f.flush()
    i += n
    k += 1
    if k % 10 == 0:
        time.sleep(0.005)
`

var mixedText = strings.Repeat("aß€𝄞", 6000) + "\n"

// TestStreamUTF8: the live output of a streamed run, cut wherever the code's
// writes and the pipes cut it, reaches the client as whole characters: the
// data of its stdout (stderr) events, put together, is exactly what the code
// wrote, no event ends inside a character (which the client would decode as
// U+FFFD), and none is empty. For one-shot runs and an interpreter's.
func TestStreamUTF8(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second), Output: 4 * moat.MiB}, nil)
	session := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"interpreter": true}), 201).JSON(t)["id"].(string)
	for _, tc := range []struct {
		name, code     string
		stdout, stderr string
		cutAtEnd       bool // the output ends inside a character
	}{
		{"euros", "print('€' * 100000)", strings.Repeat("€", 100000) + "\n", "", false},
		{"mixed", mixedCode, mixedText, mixedText, false},
		// Held back for the rest of a character that never comes, the
		// last bytes are sent as they are when the run ends, as U+FFFD,
		// as in the result.
		{"cut at the end", "import sys\nsys.stdout.buffer.write('€'.encode() * 1000 + b'\\xe2\\x82')", strings.Repeat("€", 1000) + "\uFFFD", "", true},
	} {
		for _, url := range []string{ts.URL + "/v1/runs", ts.URL + "/v1/sessions/" + session + "/runs"} {
			t.Run(tc.name+strings.TrimPrefix(url, ts.URL), func(t *testing.T) {
				req, _ := http.NewRequest("POST", url, strings.NewReader(string(runBody(tc.code, true))))
				req.Header.Set("Authorization", "Bearer "+tokenA)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Fatalf("status %d", resp.StatusCode)
				}
				events := make(chan event, 64)
				go readEvents(resp.Body, events)
				var got [2]strings.Builder
				n, results := [2]int{}, 0
				var cut [2]bool // an event of the stream ended with the cut character
				for ev := range events {
					var d map[string]any
					if err := json.Unmarshal([]byte(ev.Data), &d); err != nil {
						t.Fatalf("event %s: data is not JSON: %q", ev.Name, ev.Data)
					}
					switch ev.Name {
					case "stdout", "stderr":
						i := 0
						if ev.Name == "stderr" {
							i = 1
						}
						s, ok := d["data"].(string)
						if !ok || s == "" {
							t.Errorf("%s event %d: data %q, want output", ev.Name, n[i], ev.Data)
						}
						// With the run's end cutting a character, its bytes come
						// as one U+FFFD at the very end of the last event (alone,
						// or after text the same write delivered).
						atEnd := tc.cutAtEnd && strings.IndexRune(s, '\uFFFD') == len(s)-len("\uFFFD")
						if cut[i] {
							t.Errorf("%s event %d came after the event that ended with the cut character", ev.Name, n[i])
						}
						cut[i] = atEnd
						if strings.ContainsRune(s, '\uFFFD') && !atEnd {
							t.Errorf("%s event %d has U+FFFD: it ended or began inside a character (%d bytes: ...%q)", ev.Name, n[i], len(s), s[max(0, len(s)-8):])
						}
						got[i].WriteString(s)
						n[i]++
					case "result":
						results++
						if d["stdout"] != tc.stdout || d["stderr"] != tc.stderr || d["exit_code"] != 0.0 {
							t.Errorf("result: exit %v, %d and %d bytes of stdout and stderr, want 0, %d and %d", d["exit_code"], len(d["stdout"].(string)), len(d["stderr"].(string)), len(tc.stdout), len(tc.stderr))
						}
					default:
						t.Errorf("event %s %s", ev.Name, ev.Data)
					}
				}
				if results != 1 {
					t.Errorf("%d result events, want 1", results)
				}
				for i, want := range []string{tc.stdout, tc.stderr} {
					if got[i].String() != want {
						t.Errorf("stream %d: the events' data, %d bytes in %d events, is not the %d bytes written", i+1, got[i].Len(), n[i], len(want))
					}
				}
				// Several events, or the test proves nothing about the
				// boundaries between them.
				if n[0] < 2 && !tc.cutAtEnd {
					t.Errorf("%d stdout events: the output was not cut", n[0])
				}
				t.Logf("%d stdout and %d stderr events", n[0], n[1])
			})
		}
	}
}
