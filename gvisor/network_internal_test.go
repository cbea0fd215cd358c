package gvisor

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
)

// TestWithEgress checks the spec of a sandbox with an egress proxy: no
// network namespace of the spec's (with --network=host runsc would make a
// new, empty one instead of staying in moat's), and the CA bundle as a
// read-only bind mount at caMountDir of a file readable by the code.
func TestWithEgress(t *testing.T) {
	p, err := egress.New(egress.Config{Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}}}, CADir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	spec := newSpec("/images/x/rootfs", "/usr/bin/python3", moat.Limits{}.WithDefaults())
	before := slices.Clone(spec.Linux.Namespaces)
	bundle := t.TempDir()
	if err := withEgress(spec, bundle, p); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(before, ociNamespace{Type: "network"}) {
		t.Fatalf("a run's spec declares no network namespace: %v", before)
	}
	if slices.Contains(spec.Linux.Namespaces, ociNamespace{Type: "network"}) || len(spec.Linux.Namespaces) != len(before)-1 {
		t.Errorf("namespaces %v: want %v without network", spec.Linux.Namespaces, before)
	}
	m := spec.Mounts[len(spec.Mounts)-1]
	if m.Destination != caMountDir || m.Type != "bind" || m.Source != filepath.Join(bundle, "egress") ||
		!slices.Contains(m.Options, "ro") || slices.Contains(m.Options, "rw") {
		t.Errorf("the CA mount is %+v, want a read-only bind of the bundle's egress directory at %s", m, caMountDir)
	}
	st, err := os.Stat(filepath.Join(m.Source, caFileName))
	if err != nil || st.Mode().Perm() != 0o644 {
		t.Errorf("the CA file: %v, %v; want mode 0644", st, err)
	}
	if b, _ := os.ReadFile(filepath.Join(m.Source, caFileName)); string(b) != string(p.CABundle()) {
		t.Errorf("the CA file holds %q, want the proxy's bundle", b)
	}
	if caFile != "/mnt/moat-ca.pem" || proxyURL != "http://127.0.0.1:3128" {
		t.Errorf("caFile %q, proxyURL %q: the code and the docs name /mnt/moat-ca.pem and http://127.0.0.1:3128", caFile, proxyURL)
	}
}

// TestListenEgressRefusesOwnNamespace checks that the proxy's listener is
// never placed in moat's own network namespace, where it and the sandbox's
// sockets would be the host's.
func TestListenEgressRefusesOwnNamespace(t *testing.T) {
	p, err := egress.New(egress.Config{Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}}}, CADir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := p.NewRun()
	defer r.Close()
	if l, err := listenEgress(os.Getpid(), r); err == nil || !errors.Is(err, moat.ErrUnavailable) {
		if l != nil {
			l.Close()
		}
		t.Errorf("listenEgress in moat's own namespace: %v, want an error wrapping ErrUnavailable", err)
	}
}
