package gvisor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"time"
)

// runscCandidates are tried in order when Config.Runsc is empty. moat's own
// PATH is never searched.
var runscCandidates = []string{"/usr/local/bin/runsc", "/usr/bin/runsc", "/usr/sbin/runsc"}

// findRunsc returns the runsc binary to use.
func findRunsc(p string) (string, error) {
	cands := runscCandidates
	if p != "" {
		cands = []string{p}
	}
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return c, nil
		}
	}
	return "", fmt.Errorf("runsc not found (tried %s)", strings.Join(cands, ", "))
}

// probeTimeout bounds each of runsc's answers about itself.
const probeTimeout = 10 * time.Second

// runscInfo is what a runsc binary says about itself.
type runscInfo struct {
	Version   string   // e.g. "0.0~20240729.0" or "release-20240729.0"
	Platforms []string // e.g. systrap, ptrace, kvm
}

// probeRunsc asks runsc for its version and the platforms it was built
// with (the help of its -platform flag lists them).
func probeRunsc(ctx context.Context, runsc string) (runscInfo, error) {
	var info runscInfo
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	out, err := runQuiet(ctx, runsc, "--version")
	if err != nil {
		return info, fmt.Errorf("%s --version: %w", runsc, err)
	}
	info.Version = parseVersion(out)
	if info.Version == "" {
		return info, fmt.Errorf("%s --version printed no version: %q", runsc, clip(out, 200))
	}
	out, err = runQuiet(ctx, runsc, "flags")
	if err != nil {
		return info, fmt.Errorf("%s flags: %w", runsc, err)
	}
	info.Platforms = parsePlatforms(out)
	if len(info.Platforms) == 0 {
		return info, fmt.Errorf("%s flags lists no platforms", runsc)
	}
	return info, nil
}

func runQuiet(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = []string{}
	cmd.WaitDelay = time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.Bytes(), fmt.Errorf("%w: %s", err, clip(out.Bytes(), 300))
	}
	return out.Bytes(), nil
}

// parseVersion reads "runsc version X" from the first line.
func parseVersion(out []byte) string {
	line, _, _ := bytes.Cut(out, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) == 3 && f[0] == "runsc" && f[1] == "version" {
		return f[2]
	}
	return ""
}

// platformHelp matches the help of runsc's -platform flag, e.g.
// "specifies which platform to use: systrap (default), ptrace, kvm.".
var platformHelp = regexp.MustCompile(`specifies which platform to use: ([^.]*)\.`)

func parsePlatforms(flags []byte) []string {
	m := platformHelp.FindSubmatch(flags)
	if m == nil {
		return nil
	}
	var out []string
	for _, p := range strings.Split(string(m[1]), ",") {
		p = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(p), "(default)"))
		if p != "" {
			out = append(out, p)
		}
	}
	return out
}

// clip returns b as printable text of at most n bytes.
func clip(b []byte, n int) string {
	b = bytes.TrimSpace(b)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.ToValidUTF8(string(b), "?")
}
