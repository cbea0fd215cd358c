package server_test

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/version"
)

// send posts body with the given Content-Type and token A.
func send(t *testing.T, method, url, ctype, body string) response {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+tokenA)
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	buf.ReadFrom(resp.Body)
	return response{resp.StatusCode, resp.Header, buf.Bytes()}
}

// TestFormBodyRefused: a JSON body sent as a form (curl -d without
// -H 'Content-Type: application/json') is refused on every route that reads
// a body, with a status and a message that say what to send; JSON with a
// charset, or with no Content-Type at all, is read.
func TestFormBodyRefused(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(time.Minute)}, nil)
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{}), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	bodies := []struct{ name, url, body string }{
		{"run", ts.URL + "/v1/runs", `{"code": "print(1)"}`},
		{"session", ts.URL + "/v1/sessions", `{"ttl": "1m"}`},
		{"session run", base + "/runs", `{"code": "print(1)"}`},
		{"rename", base + "/rename", `{"from": "a", "to": "b"}`},
		{"snapshot", base + "/snapshots", `{"name": "s"}`},
	}
	for _, b := range bodies {
		for _, ct := range []string{"application/x-www-form-urlencoded", "text/plain", "application/jsonx", "multipart/form-data; boundary=x"} {
			r := send(t, "POST", b.url, ct, b.body)
			if r.Status != http.StatusUnsupportedMediaType || r.ErrorCode(t) != "unsupported_media_type" {
				t.Errorf("%s as %s: %d %s, want 415 unsupported_media_type", b.name, ct, r.Status, r.Body)
				continue
			}
			msg := r.JSON(t)["error"].(map[string]any)["message"].(string)
			if !strings.Contains(msg, "Content-Type: application/json") {
				t.Errorf("%s as %s: the message does not say what to send: %q", b.name, ct, msg)
			}
		}
	}
	for _, ct := range []string{"application/json; charset=utf-8", "Application/JSON", ""} {
		if r := send(t, "POST", ts.URL+"/v1/runs", ct, `{"code": "print(1)"}`); r.Status != 200 {
			t.Errorf("a run sent as %q: %d %s", ct, r.Status, r.Body)
		}
	}
}

// fileEntry is a file as the API lists it.
type fileEntry struct {
	Name  string `json:"name"`
	Type  string `json:"type"`
	Mode  string `json:"mode"`
	Size  int64  `json:"size"`
	IsDir bool   `json:"is_dir"`
}

// TestFileModesAndTypes: a listing and a stat give the mode as an octal
// string and the kind as a word; downloading a directory is a 409 that says
// it is one.
func TestFileModesAndTypes(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(time.Minute)}, nil)
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{}), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	r := must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": strings.Join([]string{
		"import os",
		"os.makedirs('bin/sub')",
		"open('bin/tool', 'w').write('#!/bin/sh\\n')",
		"os.chmod('bin/tool', 0o755)",
		"open('notes.txt', 'w').write('hi')",
		"os.chmod('notes.txt', 0o640)",
		"os.chmod('bin/sub', 0o1750)",
		"os.symlink('notes.txt', 'link')",
	}, "\n")}), 200).JSON(t)
	if r["exit_code"] != float64(0) {
		t.Fatalf("setting up the files: %v", r)
	}
	want := map[string]fileEntry{
		"bin":       {Name: "bin", Type: "dir", Mode: "0755", IsDir: true},
		"bin/sub":   {Name: "bin/sub", Type: "dir", Mode: "1750", IsDir: true},
		"bin/tool":  {Name: "bin/tool", Type: "file", Mode: "0755", Size: 10},
		"notes.txt": {Name: "notes.txt", Type: "file", Mode: "0640", Size: 2},
		"link":      {Name: "link", Type: "symlink", Mode: "0777", Size: 9},
	}
	var list struct{ Files []fileEntry }
	raw := must(t, call(t, "GET", base+"/files", tokenA, nil), 200).Body
	if err := json.Unmarshal(raw, &list); err != nil {
		t.Fatalf("listing %s: %v", raw, err)
	}
	got := map[string]fileEntry{}
	for _, f := range list.Files {
		if w, ok := want[f.Name]; ok && f.IsDir {
			f.Size = w.Size // a directory's size is the file system's
		}
		got[f.Name] = f
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("listing: %s is %+v, want %+v (all: %s)", name, got[name], w, raw)
		}
	}
	for name, w := range want {
		var st fileEntry
		raw := must(t, call(t, "GET", base+"/stat/"+name, tokenA, nil), 200).Body
		if err := json.Unmarshal(raw, &st); err != nil {
			t.Fatalf("stat %s: %s: %v", name, raw, err)
		}
		if st.IsDir {
			st.Size = w.Size
		}
		if st != w {
			t.Errorf("stat %s: %s, want %+v", name, raw, w)
		}
	}
	for _, dir := range []string{"bin", "bin/sub"} {
		r := call(t, "GET", base+"/files/"+dir, tokenA, nil)
		if r.Status != http.StatusConflict || r.ErrorCode(t) != "is_a_directory" {
			t.Errorf("download of the directory %s: %d %s, want 409 is_a_directory", dir, r.Status, r.Body)
			continue
		}
		if msg := r.JSON(t)["error"].(map[string]any)["message"].(string); !strings.Contains(msg, "is a directory") || strings.Contains(msg, "d-------") {
			t.Errorf("download of the directory %s: message %q", dir, msg)
		}
	}
	if r := call(t, "GET", base+"/files/nothing", tokenA, nil); r.Status != 404 {
		t.Errorf("download of a missing file: %d %s", r.Status, r.Body)
	}
}

// allBytes writes every byte value, 0x00 to 0xff, to stdout and, reversed,
// to stderr.
const allBytes = "import sys\nsys.stdout.buffer.write(bytes(range(256)))\nsys.stderr.buffer.write(bytes(reversed(range(256))))"

func every(reverse bool) []byte {
	b := make([]byte, 256)
	for i := range b {
		b[i] = byte(i)
		if reverse {
			b[i] = byte(255 - i)
		}
	}
	return b
}

// TestBinaryOutputBase64: output that is not valid UTF-8 comes back exactly
// in stdout_b64/stderr_b64 (the text fields keep their U+FFFD), in a result
// and in a stream's events; valid UTF-8 has no _b64 field.
func TestBinaryOutputBase64(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(time.Minute)}, nil)
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{}), 201).JSON(t)["id"].(string)
	for _, url := range []string{ts.URL + "/v1/runs", ts.URL + "/v1/sessions/" + id + "/runs"} {
		res := must(t, call(t, "POST", url, tokenA, map[string]any{"code": allBytes}), 200).JSON(t)
		for field, want := range map[string][]byte{"stdout_b64": every(false), "stderr_b64": every(true)} {
			s, _ := res[field].(string)
			got, err := base64.StdEncoding.DecodeString(s)
			if err != nil || !bytes.Equal(got, want) {
				t.Errorf("%s: %s = %q (%v), want the 256 bytes", url, field, s, err)
			}
		}
		if !strings.Contains(res["stdout"].(string), "\uFFFD") {
			t.Errorf("%s: stdout as text: %q", url, res["stdout"])
		}
		text := must(t, call(t, "POST", url, tokenA, map[string]any{"code": "print('héllo ✓')"}), 200).JSON(t)
		if _, ok := text["stdout_b64"]; ok || text["stdout"] != "héllo ✓\n" {
			t.Errorf("%s: a UTF-8 run: %v", url, text)
		}
		if _, ok := text["stderr_b64"]; ok {
			t.Errorf("%s: an empty stderr has stderr_b64: %v", url, text)
		}
	}

	// Streamed: the events' bytes, data_b64 where there is one, add up
	// to the output.
	data, _ := json.Marshal(map[string]any{"code": allBytes, "stream": true})
	req, _ := http.NewRequest("POST", ts.URL+"/v1/runs", bytes.NewReader(data))
	req.Header.Set("Authorization", "Bearer "+tokenA)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	events := make(chan event)
	go readEvents(resp.Body, events)
	streams := map[string][]byte{}
	var result map[string]any
	for ev := range events {
		var m map[string]any
		if err := json.Unmarshal([]byte(ev.Data), &m); err != nil {
			t.Fatalf("event %s: %q: %v", ev.Name, ev.Data, err)
		}
		switch ev.Name {
		case "stdout", "stderr":
			if b, ok := m["data_b64"].(string); ok {
				raw, err := base64.StdEncoding.DecodeString(b)
				if err != nil {
					t.Fatalf("event data_b64 %q: %v", b, err)
				}
				streams[ev.Name] = append(streams[ev.Name], raw...)
			} else {
				streams[ev.Name] = append(streams[ev.Name], m["data"].(string)...)
			}
		case "result":
			result = m
		}
	}
	if !bytes.Equal(streams["stdout"], every(false)) || !bytes.Equal(streams["stderr"], every(true)) {
		t.Errorf("streamed bytes: stdout %q, stderr %q", streams["stdout"], streams["stderr"])
	}
	if result == nil || result["stdout_b64"] != base64.StdEncoding.EncodeToString(every(false)) {
		t.Errorf("the stream's result: %v", result)
	}
}

// TestHealthVersion: /healthz says which build is serving.
func TestHealthVersion(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	m := must(t, call(t, "GET", ts.URL+"/healthz", "", nil), 200).JSON(t)
	if m["status"] != "ok" || m["version"] != version.String() || version.String() == "" {
		t.Errorf("healthz: %v, want version %q", m, version.String())
	}
}
