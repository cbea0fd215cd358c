package egress

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultCADir is where moat's CA lives when Config.CADir is empty.
const DefaultCADir = "/var/lib/moat/egress"

// The CA's files in its directory.
const (
	caCertFile = "ca.pem"
	caKeyFile  = "ca-key.pem"
	caLockFile = ".lock"
)

// Validity of moat's CA and of the leaf certificates it signs. A leaf is
// short-lived: it exists only for the sandboxes of this process, and a
// leaf copied out of one is soon worthless.
const (
	caValidity   = 10 * 365 * 24 * time.Hour
	leafValidity = 24 * time.Hour
	// leafBackdate is how far in the past a certificate's NotBefore lies,
	// for a sandbox whose clock runs a little behind the host's.
	leafBackdate = time.Hour
	// leafRenew is how long before its end a cached leaf is replaced.
	leafRenew = time.Hour
	// maxLeaves bounds the leaf cache; a wildcard host lets the code
	// choose any number of names.
	maxLeaves = 1024
)

// systemRootFiles are where Linux distributions keep the system's trust
// bundle (crypto/x509's list); bundle takes the first that exists.
var systemRootFiles = []string{
	"/etc/ssl/certs/ca-certificates.crt",                // Debian, Ubuntu, Gentoo, Arch
	"/etc/pki/tls/certs/ca-bundle.crt",                  // Fedora, RHEL 6
	"/etc/ssl/ca-bundle.pem",                            // openSUSE
	"/etc/pki/tls/cacert.pem",                           // OpenELEC
	"/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", // CentOS, RHEL 7
	"/etc/ssl/cert.pem",                                 // Alpine
}

// authority is moat's CA: one per install, made on first use and kept. It
// signs the short-lived certificates with which the proxy terminates TLS
// for a secret's host. Safe for concurrent use.
type authority struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	certPEM []byte

	mu     sync.Mutex
	leaves map[string]*tls.Certificate // guarded by mu; by lower-case host
}

// loadCA returns the CA kept in dir (DefaultCADir when empty), making it
// on first use: an ECDSA P-256 CA named "moat egress CA", its certificate
// in ca.pem (mode 0644) and its key in ca-key.pem (mode 0600) in dir (mode
// 0700 when loadCA makes it), each written to a temporary file and renamed.
// Processes making it at once agree on one (a lock file in dir).
//
// A CA that is there is used as it is, never replaced: a file that does
// not parse, a key that is not the certificate's, a certificate that is not
// a CA or has expired, a key file others can read, or a certificate whose
// key is missing is an error that says what to do. Only a key without its
// certificate (a creation cut short: nothing trusted it yet) is made anew.
func loadCA(dir string) (*authority, error) {
	if dir == "" {
		dir = DefaultCADir
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, caLockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("egress: ca: lock %s: %w", lock.Name(), err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)

	certPath, keyPath := filepath.Join(dir, caCertFile), filepath.Join(dir, caKeyFile)
	certPEM, err := os.ReadFile(certPath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return makeCA(dir)
	case err != nil:
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	keyInfo, err := os.Stat(keyPath)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("egress: ca: %s is there but its key %s is not; sandboxes may trust that CA, so moat does not replace it: remove %s to make a new CA", certPath, keyPath, certPath)
	}
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	if perm := keyInfo.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("egress: ca: %s has mode %04o: others could read the CA's key; chmod 600 it (or remove both files to make a new CA)", keyPath, perm)
	}
	keyPEM, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	a, err := parseCA(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %s, %s: %w; moat does not replace a CA: fix or remove both files", certPath, keyPath, err)
	}
	if now := time.Now(); now.After(a.cert.NotAfter) {
		return nil, fmt.Errorf("egress: ca: %s expired on %s: remove %s and %s to make a new CA", certPath, a.cert.NotAfter.Format(time.DateOnly), certPath, keyPath)
	}
	return a, nil
}

// parseCA parses a CA's certificate and key and checks they belong
// together.
func parseCA(certPEM, keyPEM []byte) (*authority, error) {
	cb, rest := pem.Decode(certPEM)
	if cb == nil || cb.Type != "CERTIFICATE" || len(bytes.TrimSpace(rest)) != 0 {
		return nil, errors.New("the certificate file is not one PEM CERTIFICATE")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("the certificate does not parse: %w", err)
	}
	if !cert.IsCA || !cert.BasicConstraintsValid || cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, errors.New("the certificate is not a CA's")
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil || kb.Type != "EC PRIVATE KEY" {
		return nil, errors.New("the key file is not a PEM EC PRIVATE KEY")
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("the key does not parse: %w", err)
	}
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(&key.PublicKey) {
		return nil, errors.New("the key is not the certificate's")
	}
	return &authority{cert: cert, key: key, certPEM: pem.EncodeToMemory(cb), leaves: map[string]*tls.Certificate{}}, nil
}

// makeCA makes a new CA in dir; the caller holds dir's lock. The key is
// written first and the certificate last: a certificate on disk always
// has its key beside it.
func makeCA(dir string) (*authority, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          randomSerial(),
		Subject:               pkix.Name{CommonName: "moat egress CA", Organization: []string{"moat"}},
		NotBefore:             now.Add(-leafBackdate),
		NotAfter:              now.Add(caValidity),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := writeAtomic(dir, caKeyFile, keyPEM, 0o600); err != nil {
		return nil, err
	}
	if err := writeAtomic(dir, caCertFile, certPEM, 0o644); err != nil {
		return nil, err
	}
	return parseCA(certPEM, keyPEM)
}

// writeAtomic writes data to dir/name with mode perm through a temporary
// file in dir, synced and renamed, then syncs dir.
func writeAtomic(dir, name string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(dir, "."+name+".*")
	if err != nil {
		return fmt.Errorf("egress: ca: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // fails harmlessly once renamed
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(perm)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(dir, name))
	}
	if err != nil {
		return fmt.Errorf("egress: ca: write %s: %w", filepath.Join(dir, name), err)
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// randomSerial is a random positive 127-bit serial number.
func randomSerial() *big.Int {
	var b [16]byte
	rand.Read(b[:])
	b[0] &= 0x7f
	return new(big.Int).SetBytes(b[:])
}

// bundle is the trust bundle a sandbox gets (PEM): the host's system roots,
// from the first of systemRootFiles that exists (none when no file does),
// and then moat's CA.
func (a *authority) bundle() ([]byte, error) {
	var buf bytes.Buffer
	for _, f := range systemRootFiles {
		b, err := os.ReadFile(f)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("egress: ca: system roots: %w", err)
		}
		buf.Write(b)
		if len(b) > 0 && b[len(b)-1] != '\n' {
			buf.WriteByte('\n')
		}
		break
	}
	buf.WriteString("# moat egress CA\n")
	buf.Write(a.certPEM)
	return buf.Bytes(), nil
}

// leaf returns a certificate for host signed by the CA, with host as its
// only name (SAN), valid from an hour ago for 24 hours. It is cached per
// host and renewed an hour before it ends.
func (a *authority) leaf(host string) (*tls.Certificate, error) {
	h := strings.ToLower(strings.TrimSuffix(host, "."))
	if h == "" {
		return nil, errors.New("egress: ca: a certificate needs a host name")
	}
	if _, err := netip.ParseAddr(h); err == nil {
		return nil, fmt.Errorf("egress: ca: %q is an IP address, not a host name", host)
	}
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if c, ok := a.leaves[h]; ok && now.Before(c.Leaf.NotAfter.Add(-leafRenew)) {
		return c, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: randomSerial(),
		Subject:      pkix.Name{CommonName: h},
		DNSNames:     []string{h},
		NotBefore:    now.Add(-leafBackdate),
		NotAfter:     now.Add(leafValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, a.cert, &key.PublicKey, a.key)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: certificate for %s: %w", h, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("egress: ca: certificate for %s: %w", h, err)
	}
	c := &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
	if len(a.leaves) >= maxLeaves {
		clear(a.leaves)
	}
	a.leaves[h] = c
	return c, nil
}
