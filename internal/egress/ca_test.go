package egress

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestCAPersisted(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "egress")
	a, err := loadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	if a.cert.Subject.CommonName != "moat egress CA" || !a.cert.IsCA {
		t.Errorf("CA %q, IsCA %v", a.cert.Subject.CommonName, a.cert.IsCA)
	}
	for name, want := range map[string]os.FileMode{"": 0o700, caCertFile: 0o644, caKeyFile: 0o600} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s: mode %04o, want %04o", filepath.Join(dir, name), got, want)
		}
	}
	b, err := loadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !b.cert.Equal(a.cert) || !b.key.Equal(a.key) {
		t.Error("a second loadCA made another CA")
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if n := e.Name(); n != caCertFile && n != caKeyFile && n != caLockFile {
			t.Errorf("left in the CA's directory: %s", n)
		}
	}
}

func TestCAConcurrentFirstUse(t *testing.T) {
	dir := t.TempDir()
	var wg sync.WaitGroup
	cas := make([]*authority, 8)
	errs := make([]error, len(cas))
	for i := range cas {
		wg.Go(func() { cas[i], errs[i] = loadCA(dir) })
	}
	wg.Wait()
	final, err := loadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i, a := range cas {
		if errs[i] != nil {
			t.Fatalf("loadCA %d: %v", i, errs[i])
		}
		if !a.cert.Equal(final.cert) {
			t.Errorf("loadCA %d got a CA that is not the one kept", i)
		}
	}
}

func TestCABroken(t *testing.T) {
	otherDir := t.TempDir()
	if _, err := loadCA(otherDir); err != nil {
		t.Fatal(err)
	}
	otherKey, err := os.ReadFile(filepath.Join(otherDir, caKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, dir string)
		want  string
	}{
		{"corrupt cert", func(t *testing.T, dir string) { write(t, dir, caCertFile, []byte("not a pem\n"), 0o644) }, "not one PEM CERTIFICATE"},
		{"corrupt key", func(t *testing.T, dir string) {
			write(t, dir, caKeyFile, []byte("-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n"), 0o600)
		}, "key does not parse"},
		{"another CA's key", func(t *testing.T, dir string) { write(t, dir, caKeyFile, otherKey, 0o600) }, "not the certificate's"},
		{"key missing", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, caKeyFile)) }, "is not; sandboxes may trust"},
		{"key readable by others", func(t *testing.T, dir string) { os.Chmod(filepath.Join(dir, caKeyFile), 0o644) }, "others could read"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if _, err := loadCA(dir); err != nil {
				t.Fatal(err)
			}
			tc.spoil(t, dir)
			before := snapshot(t, dir)
			a, err := loadCA(dir)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("loadCA = %v, %v; want an error with %q", a, err, tc.want)
			}
			if !strings.HasPrefix(err.Error(), "egress: ca: ") {
				t.Errorf("error %q does not start with the package", err)
			}
			if after := snapshot(t, dir); after != before {
				t.Errorf("loadCA changed the broken CA's files:\n%s\nthen\n%s", before, after)
			}
		})
	}
}

func TestCAInterruptedCreation(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, caKeyFile, []byte("left by a creation cut short\n"), 0o600)
	a, err := loadCA(dir)
	if err != nil {
		t.Fatalf("a key without its certificate: %v; want a new CA", err)
	}
	b, err := loadCA(dir)
	if err != nil || !b.cert.Equal(a.cert) {
		t.Fatalf("the new CA was not kept: %v", err)
	}
}

func TestCALeaf(t *testing.T) {
	a, err := loadCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	c, err := a.leaf("API.Example.com.")
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(a.cert)
	now := time.Now()
	if _, err := c.Leaf.Verify(x509.VerifyOptions{DNSName: "api.example.com", Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Errorf("leaf does not verify for its host: %v", err)
	}
	if _, err := c.Leaf.Verify(x509.VerifyOptions{DNSName: "other.example.com", Roots: pool}); err == nil {
		t.Error("leaf verifies for another host")
	}
	if got := c.Leaf.DNSNames; len(got) != 1 || got[0] != "api.example.com" {
		t.Errorf("SANs %q", got)
	}
	if !c.Leaf.NotBefore.Before(now.Add(-30*time.Minute)) || c.Leaf.NotAfter.After(now.Add(25*time.Hour)) || c.Leaf.IsCA {
		t.Errorf("leaf valid %s to %s (IsCA %v): want from the past, a day at most", c.Leaf.NotBefore, c.Leaf.NotAfter, c.Leaf.IsCA)
	}
	if again, _ := a.leaf("api.example.com"); again != c {
		t.Error("leaf not cached per host")
	}
	if _, err := a.leaf("127.0.0.1"); err == nil {
		t.Error("a leaf for an IP address")
	}
}

func TestCABundle(t *testing.T) {
	dir := t.TempDir()
	a, err := loadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	system := filepath.Join(dir, "system.pem")
	other, _ := loadCA(t.TempDir())
	write(t, dir, "system.pem", bytes.TrimSuffix(other.certPEM, []byte("\n")), 0o644)
	saved := systemRootFiles
	systemRootFiles = []string{filepath.Join(dir, "absent.pem"), system}
	defer func() { systemRootFiles = saved }()

	b, err := a.bundle()
	if err != nil {
		t.Fatal(err)
	}
	var got []*x509.Certificate
	for rest := b; ; {
		var blk *pem.Block
		if blk, rest = pem.Decode(rest); blk == nil {
			break
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, c)
	}
	if len(got) != 2 || !got[0].Equal(other.cert) || !got[1].Equal(a.cert) {
		t.Errorf("bundle has %d certificates; want the system's then moat's", len(got))
	}
}

func write(t *testing.T, dir, name string, data []byte, perm os.FileMode) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, perm); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, perm); err != nil {
		t.Fatal(err)
	}
}

// snapshot is the names, modes and contents of dir's CA files.
func snapshot(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	for _, n := range []string{caCertFile, caKeyFile} {
		fi, err := os.Stat(filepath.Join(dir, n))
		if err != nil {
			b.WriteString(n + ": absent\n")
			continue
		}
		data, _ := os.ReadFile(filepath.Join(dir, n))
		b.WriteString(n + " " + fi.Mode().String() + "\n" + string(data))
	}
	return b.String()
}
