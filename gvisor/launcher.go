package gvisor

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/egress"
)

// The command lines of moat's launcher (launcher.py) in a session's
// sandbox: a run's, started with runsc exec, and the container init of a
// session with a live interpreter (interpinit.go).

// writeLaunchSpec writes the process.json of the runs' launcher into the
// bundle (ss.launchSpec), for code with the environment ss.env.
func (ss *session) writeLaunchSpec() error {
	raw, err := guestFilterBytes()
	if err != nil {
		return err
	}
	proc := ociProcess{
		User: ociUser{UID: 0, GID: 0, AdditionalGids: []uint32{}},
		// -s: the user site directory the code could write to is not
		// read, so nothing planted runs as the next run's python3 starts.
		Args:            ss.b.launcherArgs(raw, ss.env, "run", "-s", "-"),
		Env:             []string{"PATH=/usr/bin:/bin"},
		Cwd:             "/",
		Capabilities:    rootCaps(launcherCaps),
		NoNewPrivileges: true,
	}
	pj, err := json.Marshal(proc)
	if err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	ss.launchSpec = filepath.Join(ss.bt.bundle, "launch.json")
	if err := os.WriteFile(ss.launchSpec, pj, 0o600); err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	return nil
}

// guestFilterBytes is the guest seccomp filter as launcher.py takes it:
// struct sock_filter[], native-endian.
func guestFilterBytes() ([]byte, error) {
	filter, err := guestFilter()
	if err != nil {
		return nil, unavailable("sessions need the guest seccomp filter", "", err)
	}
	var raw []byte
	for _, ins := range filter {
		raw = append(raw, byte(ins.Op), byte(ins.Op>>8), ins.Jt, ins.Jf, byte(ins.K), byte(ins.K>>8), byte(ins.K>>16), byte(ins.K>>24))
	}
	return raw, nil
}

// codeEnv is the code's environment: a run's, and the egress proxy's
// run's, if any.
func (b *backend) codeEnv(netRun *egress.Run) []string {
	env := newSpec(b.rootfs, image.Python, b.limits).Process.Env
	if netRun != nil {
		env = append(env, egressEnv(netRun)...)
	}
	return env
}

// launcherArgs is the command line of launcher.py in mode (see its
// comment), for code with the environment env and python3 with pyargs.
func (b *backend) launcherArgs(raw []byte, env []string, mode string, pyargs ...string) []string {
	args := []string{image.Python, "-I", "-S", "-c", launcherPy, hex.EncodeToString(raw),
		strconv.Itoa(sandboxUID), strconv.Itoa(sandboxGID), image.WorkDir, image.Python, mode, strconv.Itoa(len(pyargs))}
	return append(append(args, pyargs...), env...)
}

// rootCaps are the capability sets of a root process of moat's with caps.
func rootCaps(caps []string) ociCapabilities {
	none := []string{}
	return ociCapabilities{Bounding: caps, Effective: caps, Permitted: caps, Inheritable: none, Ambient: none}
}
