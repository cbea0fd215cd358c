package server

import (
	"encoding/json"
	"io/fs"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

// TestOpenAPIDocumentsEveryRoute keeps openapi.json in step with the
// routes: every route is documented, and every documented operation is a
// route.
func TestOpenAPIDocumentsEveryRoute(t *testing.T) {
	var doc struct {
		OpenAPI string                                `json:"openapi"`
		Paths   map[string]map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(openAPI, &doc); err != nil {
		t.Fatalf("openapi.json: %v", err)
	}
	if !strings.HasPrefix(doc.OpenAPI, "3.") {
		t.Errorf("openapi version %q", doc.OpenAPI)
	}
	routes := map[string]bool{}
	for _, rt := range (&Server{}).routeTable() {
		path := strings.ReplaceAll(rt.pattern, "...}", "}")
		method := strings.ToLower(rt.method)
		routes[method+" "+path] = true
		if _, ok := doc.Paths[path][method]; !ok {
			t.Errorf("route %s %s is not in openapi.json", rt.method, rt.pattern)
		}
	}
	for path, ops := range doc.Paths {
		for method := range ops {
			if method == "parameters" {
				continue
			}
			if !routes[method+" "+path] {
				t.Errorf("openapi.json documents %s %s, which is no route", strings.ToUpper(method), path)
			}
		}
	}
}

// TestErrorTableCodes checks that every code in the error table is
// documented in openapi.json's error response.
func TestErrorTableCodes(t *testing.T) {
	for _, e := range errorTable {
		if !strings.Contains(string(openAPI), e.code) {
			t.Errorf("error code %q is not documented", e.code)
		}
	}
}

// TestOpenAPISchemas keeps the documented shapes of a file and a result in
// step with what the server writes.
func TestOpenAPISchemas(t *testing.T) {
	var doc struct {
		Components struct {
			Schemas map[string]struct {
				Properties map[string]json.RawMessage `json:"properties"`
			} `json:"schemas"`
		} `json:"components"`
	}
	if err := json.Unmarshal(openAPI, &doc); err != nil {
		t.Fatal(err)
	}
	fields := func(v any) []string {
		var m map[string]any
		data, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		json.Unmarshal(data, &m)
		return slices.Sorted(maps.Keys(m))
	}
	documented := func(name string) []string {
		return slices.Sorted(maps.Keys(doc.Components.Schemas[name].Properties))
	}
	if got, want := documented("FileInfo"), fields(newFileView(moat.FileInfo{})); !slices.Equal(got, want) {
		t.Errorf("FileInfo documents %v, the server writes %v", got, want)
	}
	// A result with every field: notes, a signal and output that is
	// not UTF-8.
	res := &moat.Result{Stdout: []byte{0xff}, Stderr: []byte{0xfe}, Signal: "SIGKILL", Notes: []string{"n"}}
	for _, f := range fields(resultView{res}) {
		if _, ok := doc.Components.Schemas["Result"].Properties[f]; !ok {
			t.Errorf("the result's field %q is not in the Result schema", f)
		}
	}
	for _, c := range []struct {
		mode fs.FileMode
		typ  string
		oct  string
	}{
		{0o644, "file", "0644"},
		{fs.ModeDir | 0o755, "dir", "0755"},
		{fs.ModeSymlink | 0o777, "symlink", "0777"},
		{fs.ModeNamedPipe | 0o600, "other", "0600"},
		{fs.ModeDir | fs.ModeSticky | 0o777, "dir", "1777"},
		{fs.ModeSetuid | fs.ModeSetgid | 0o755, "file", "6755"},
	} {
		if typ, oct := fileType(c.mode), octalMode(c.mode); typ != c.typ || oct != c.oct {
			t.Errorf("mode %v: %s %s, want %s %s", c.mode, typ, oct, c.typ, c.oct)
		}
	}
}
