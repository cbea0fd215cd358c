package egress

// TEMPORARY: minimal stand-ins for the seam that secrets.go, ca.go and
// mitm.go (written by another helper) provide, so that the proxy core
// compiles and its tests run. They know no secrets and intercept nothing.
// Delete this file when the real ones land.

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"

	"github.com/moatsandbox/moat"
)

type secretSet struct{ n int }

func newSecretSet(e moat.Egress, getenv func(string) string) (*secretSet, error) {
	for name, s := range e.Secrets {
		if getenv(s.FromEnv) == "" {
			return nil, fmt.Errorf("egress: secret %s: %s is not set: %w", name, s.FromEnv, moat.ErrInvalid)
		}
	}
	return &secretSet{n: len(e.Secrets)}, nil
}

func (s *secretSet) forRun() *runSecrets { return &runSecrets{} }

type runSecrets struct{}

func (r *runSecrets) env() []string                                           { return nil }
func (r *runSecrets) intercepts(host string, port int) bool                   { return false }
func (r *runSecrets) rewrite(req *http.Request, host string, port int) string { return "" }

type authority struct{}

func loadCA(dir string) (*authority, error) { return &authority{}, nil }

func (a *authority) bundle() ([]byte, error) { return []byte{}, nil }

func (r *runSecrets) serveMITM(client net.Conn, host string, port int, dial func() (net.Conn, error), a *authority, roots *x509.CertPool, decide func(req *http.Request) (refusal string)) error {
	client.Close()
	return errors.New("egress: no interception in the temporary seam")
}
