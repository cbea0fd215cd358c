package engine

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/moatsandbox/moat"
)

// The digest is of the file's bytes, not of its holes: a sparse file and a
// copy with its holes filled with zeros have one digest; a changed byte, in
// data or in a hole, changes it; the bytes on disk are those allocated.
func TestDigestSparse(t *testing.T) {
	dir := t.TempDir()
	sparse := filepath.Join(dir, "sparse")
	f, err := os.Create(sparse)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64<<20 + 12345 // a last chunk of its own size
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	data := []byte("the data between the holes")
	for _, off := range []int64{0, 5 << 20, 5<<20 + digestChunk - 3, size - int64(len(data))} {
		if _, err := f.WriteAt(data, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	full, err := os.ReadFile(sparse)
	if err != nil {
		t.Fatal(err)
	}
	filled := filepath.Join(dir, "filled")
	if err := os.WriteFile(filled, full, 0o600); err != nil {
		t.Fatal(err)
	}
	s1, d1, disk1, err := digest(sparse)
	if err != nil {
		t.Fatal(err)
	}
	s2, d2, disk2, err := digest(filled)
	if err != nil {
		t.Fatal(err)
	}
	if s1 != size || s2 != size || d1 != d2 {
		t.Fatalf("sparse %d %s, filled %d %s: want one size and one digest", s1, d1, s2, d2)
	}
	if disk1 >= disk2 || disk2 < size-4096 {
		t.Errorf("on disk: sparse %d, filled %d bytes: want the sparse one smaller", disk1, disk2)
	}
	for _, off := range []int64{5<<20 + 1, 30 << 20, size - 1} {
		b := append([]byte(nil), full...)
		b[off] ^= 1
		p := filepath.Join(dir, "changed")
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if _, d, _, err := digest(p); err != nil || d == d1 {
			t.Errorf("a byte changed at %d: digest %s (err %v), the same as before", off, d, err)
		}
	}
}

// A state sealed before chunked digests (a manifest without "digest", its
// digests of whole files) is still checked, and still refused when
// changed; a manifest naming a digest of another kind is refused.
func TestCheckOldManifest(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "file"), []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := seal(dir, moat.SessionOptions{}, &moat.SuspendInfo{}); err != nil {
		t.Fatal(err)
	}
	if _, err := check(dir); err != nil {
		t.Fatalf("a state just sealed: %v", err)
	}
	mp := filepath.Join(dir, manifestName)
	b, err := os.ReadFile(mp)
	if err != nil {
		t.Fatal(err)
	}
	var m manifest
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	write := func(m manifest) {
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(mp, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old := m
	old.Digest = ""
	old.Files = nil
	for _, f := range m.Files {
		_, sum, err := digestWhole(filepath.Join(dir, f.Path))
		if err != nil {
			t.Fatal(err)
		}
		f.SHA256 = sum
		old.Files = append(old.Files, f)
	}
	write(old)
	if _, err := check(dir); err != nil {
		t.Fatalf("an old manifest: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "file"), []byte("kepT"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := check(dir); err == nil {
		t.Error("an old manifest's state with a byte changed was not refused")
	}
	other := m
	other.Digest = "md5"
	write(other)
	if _, err := check(dir); err == nil {
		t.Error("a manifest of an unknown digest kind was not refused")
	}
}
