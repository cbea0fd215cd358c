package server

import (
	"encoding/json"
	"strings"
	"testing"
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
