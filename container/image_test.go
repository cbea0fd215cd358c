package container

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteTar(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755)
	os.MkdirAll(filepath.Join(root, "dev/pts"), 0o755)
	os.WriteFile(filepath.Join(root, "dev/null-ish"), []byte("no"), 0o644)
	os.WriteFile(filepath.Join(root, "usr/bin/a"), []byte("hello"), 0o755)
	os.Link(filepath.Join(root, "usr/bin/a"), filepath.Join(root, "usr/bin/b"))
	os.Symlink("a", filepath.Join(root, "usr/bin/c"))
	var buf bytes.Buffer
	if err := writeTar(&buf, root); err != nil {
		t.Fatal(err)
	}
	got := map[string]*tar.Header{}
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
		if h.Name == "usr/bin/a" {
			if b, _ := io.ReadAll(tr); string(b) != "hello" {
				t.Errorf("usr/bin/a holds %q", b)
			}
		}
	}
	if h := got["usr/bin/a"]; h == nil || h.Mode&0o777 != 0o755 || h.Uname != "" {
		t.Errorf("usr/bin/a: %+v", h)
	}
	if h := got["usr/bin/b"]; h == nil || h.Typeflag != tar.TypeLink || h.Linkname != "usr/bin/a" {
		t.Errorf("usr/bin/b is not a hard link to usr/bin/a: %+v", h)
	}
	if h := got["usr/bin/c"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "a" {
		t.Errorf("usr/bin/c is not a symlink to a: %+v", h)
	}
	if got["dev/"] == nil || got["dev/null-ish"] != nil || got["dev/pts/"] != nil {
		t.Errorf("/dev should be in the tar, empty: %v", got)
	}
}

func TestReadJSONMessages(t *testing.T) {
	for in, want := range map[string]string{
		`{"status":"a"}{"status":"b"}`:                                     "",
		`{"status":"a"}{"errorDetail":{"message":"no space"},"error":"x"}`: "no space",
		`{"error":"bad tar"}`:                                              "bad tar",
		`{"status":`:                                                       "unexpected EOF",
	} {
		err := readJSONMessages(strings.NewReader(in))
		if got := errText(err); got != want {
			t.Errorf("readJSONMessages(%s) = %q, want %q", in, got, want)
		}
	}
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
