package server

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/moatsandbox/moat"
)

// FuzzResultView: whatever the output, a result's JSON is one valid object
// with the fields of moat.Result, and stdout_b64/stderr_b64 are there
// exactly when a stream is not valid UTF-8, holding its bytes.
func FuzzResultView(f *testing.F) {
	f.Add([]byte("hi\n"), []byte(""))
	f.Add([]byte{0, 0xff, 0xfe}, []byte("é"))
	f.Add([]byte("\xe2\x82"), []byte{0x80})
	f.Fuzz(func(t *testing.T, stdout, stderr []byte) {
		res := &moat.Result{Level: moat.LevelSubprocess, Stdout: stdout, Stderr: stderr, ExitCode: 3, Notes: []string{"n"}}
		data, err := json.Marshal(resultView{res})
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		dec := json.NewDecoder(bytes.NewReader(data))
		if err := dec.Decode(&m); err != nil || dec.More() {
			t.Fatalf("not one JSON object: %s (%v)", data, err)
		}
		if m["exit_code"] != float64(3) || m["level"] != "subprocess" {
			t.Fatalf("fields lost: %s", data)
		}
		for name, raw := range map[string][]byte{"stdout": stdout, "stderr": stderr} {
			b64, ok := m[name+"_b64"].(string)
			if ok == utf8.Valid(raw) {
				t.Fatalf("%s_b64 present %v for %q", name, ok, raw)
			}
			if !ok {
				if m[name] != string(raw) {
					t.Fatalf("%s: %q, want %q", name, m[name], raw)
				}
				continue
			}
			if got, err := base64.StdEncoding.DecodeString(b64); err != nil || !bytes.Equal(got, raw) {
				t.Fatalf("%s_b64 = %q, want the bytes %q", name, b64, raw)
			}
		}
	})
}
