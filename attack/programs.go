package attack

import (
	"bytes"
	"embed"
	"encoding/hex"
	"encoding/json"
	"fmt"
)

// The programs are Python sources. Each is run as one piece of code: a
// first line written here, programs/common.py, then the attack's own file.
//
//go:embed programs/*.py
var programs embed.FS

// params are the values a program needs from the harness. They reach the
// program as hex-encoded JSON on its first line, so that no value, whatever
// bytes it holds, is ever spliced into Python source.
type params struct {
	Nonce string `json:"nonce"` // per-run random, part of every marker
	Tag   string `json:"tag"`   // process name, for the host-side check
	// Path is, for credentials, the planted file; for unix_path_*, the
	// harness's socket.
	Path string `json:"path,omitempty"`
	Port int    `json:"port,omitempty"` // network: the service's port
	// Name is an abstract unix name, without the leading NUL: the
	// harness's for abstract_unix, the one to bind for abstract_bind.
	Name   string `json:"name,omitempty"`
	Hold   int    `json:"hold,omitempty"`   // abstract_bind: seconds to hold the name
	MiB    int    `json:"mib,omitempty"`    // memory, disk: how much
	Procs  int    `json:"procs,omitempty"`  // fork_flood: how many processes
	Linger int    `json:"linger,omitempty"` // loop, fork_flood, uid_shared_limit: seconds a stray process lives
	Role   string `json:"role,omitempty"`   // uid_shared_limit: "hog" or "probe"
	Max    int    `json:"max,omitempty"`    // uid_shared_limit: the most instances the hog opens
	// Ports and Hosts are, for the egress probes, the harness's servers:
	// "allowed", "echo", "secret" (names the policy allows, pinned to
	// 127.0.0.1), "ip" (a listener no policy allows) and "dns" (a UDP DNS
	// server, also the proxy's resolver).
	Ports map[string]int    `json:"ports,omitempty"`
	Hosts map[string]string `json:"hosts,omitempty"`
}

// The sizes of the attacks.
const (
	memoryMiB  = 512
	diskMiB    = 50
	floodProcs = 200
	// lingerSeconds bounds how long a child the sandbox failed to kill
	// stays alive by itself, should the harness not be there to kill it.
	lingerSeconds = 120
)

// The markers a program prints, each followed by the run's nonce. They are
// spelled out here only; the programs assemble them at run time.
const (
	kindStarted = "STARTED" // the first line ran
	kindOK      = "OK"      // the attack succeeded
	kindErr     = "ERR"     // the attack failed; a class and a detail follow
	kindDone    = "DONE"    // the program ran to its end
	kindReady   = "READY"   // uid_shared_limit's hog holds what it could get
)

func marker(kind, nonce string) string { return "MOAT-" + kind + ":" + nonce }

// source returns the Python program for the attack n with parameters p.
func source(n Name, p params) ([]byte, error) {
	body, err := programs.ReadFile("programs/" + string(n) + ".py")
	if err != nil {
		return nil, fmt.Errorf("attack: no program for %q: %w", n, err)
	}
	common, err := programs.ReadFile("programs/common.py")
	if err != nil {
		return nil, fmt.Errorf("attack: %w", err)
	}
	js, err := json.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("attack: encode parameters: %w", err)
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, `import json, sys; P = json.loads(bytes.fromhex("%s")); `+
		`sys.stdout.write("MOAT" + "-" + "STARTED:" + P["nonce"] + "\n"); sys.stdout.flush()`+"\n",
		hex.EncodeToString(js))
	b.Write(common)
	b.WriteString("\n")
	b.Write(body)
	return b.Bytes(), nil
}
