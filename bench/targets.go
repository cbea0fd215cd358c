package bench

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"time"

	"github.com/moatsandbox/moat"
)

// Code is what every target runs, and Want what it must print.
const (
	Code = "print(1)"
	Want = "1\n"
)

// DefaultPython is the interpreter [PythonTarget] starts when given none: the
// one the levels use.
const DefaultPython = "/usr/bin/python3"

// BaselineName names the baseline row.
const BaselineName = "python3"

// commandPath is the whole environment of a [CommandTarget]'s process.
const commandPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// waitDelay bounds how long a [CommandTarget] waits for its output pipes to
// close after the process exited or was killed (a leftover grandchild holding
// them open).
const waitDelay = 2 * time.Second

// SandboxTarget returns a target that runs [Code] through sb and checks the
// result: no error, exit code 0, no Reason, and stdout exactly [Want]. The
// row's level is sb.Level(). The caller keeps sb and closes it after [Run].
func SandboxTarget(name string, sb moat.Sandbox) Target { return TenantTarget(name, sb, "") }

// TenantTarget is SandboxTarget with every run's moat.Request.Tenant set to
// tenant: the row of a sandbox that recycles one tenant's instances.
func TenantTarget(name string, sb moat.Sandbox, tenant string) Target {
	var pool func() moat.PoolStats
	if pr, ok := sb.(moat.PoolReporter); ok {
		pool = pr.PoolStats
	}
	return Target{
		Name:  name,
		Level: sb.Level(),
		Pool:  pool,
		Run: func(ctx context.Context) error {
			res, err := sb.Run(ctx, moat.Request{Code: []byte(Code), Tenant: tenant})
			if err != nil {
				return fmt.Errorf("bench: %s: %w", name, err)
			}
			if res.ExitCode != 0 || res.Reason != moat.ReasonNone || string(res.Stdout) != Want {
				return fmt.Errorf("bench: %s: want exit 0 and stdout %q, got exit %d, reason %q, stdout %q, stderr %q",
					name, Want, res.ExitCode, res.Reason, clip(res.Stdout), clip(res.Stderr))
			}
			return nil
		},
	}
}

// PythonTarget returns the baseline: python -c 'print(1)' started directly
// with os/exec, python being [DefaultPython] when empty. See [CommandTarget].
func PythonTarget(python string) Target {
	if python == "" {
		python = DefaultPython
	}
	t := CommandTarget(BaselineName, python, "-c", Code)
	t.Note = "direct exec of " + python
	return t
}

// CommandTarget returns a target that runs argv with os/exec and checks that
// it exits 0 and prints exactly [Want] on stdout. The process gets an
// environment holding only PATH, no stdin, and is killed when ctx ends. It
// has no level; set Target.Level when the command runs one (a `docker run`
// row, say).
func CommandTarget(name string, argv ...string) Target {
	args := append([]string(nil), argv...)
	return Target{
		Name: name,
		Run: func(ctx context.Context) error {
			if len(args) == 0 {
				return fmt.Errorf("bench: %s: no command: %w", name, moat.ErrInvalid)
			}
			var stdout, stderr bytes.Buffer
			cmd := exec.CommandContext(ctx, args[0], args[1:]...)
			cmd.Env = []string{commandPath}
			cmd.Stdout = &stdout
			cmd.Stderr = &stderr
			cmd.WaitDelay = waitDelay
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("bench: %s: %w (stderr %q)", name, err, clip(stderr.Bytes()))
			}
			if stdout.String() != Want {
				return fmt.Errorf("bench: %s: want stdout %q, got %q (stderr %q)",
					name, Want, clip(stdout.Bytes()), clip(stderr.Bytes()))
			}
			return nil
		},
	}
}

// clip returns b cut to a length that fits in an error message.
func clip(b []byte) string {
	const n = 200
	if len(b) > n {
		return string(b[:n]) + "..."
	}
	return string(b)
}

// SessionTarget returns a target that runs [Code] in sess, a session at
// level, and checks the result as [SandboxTarget] does. Every run goes to
// the same session, one after the other, as an agent's runs do. The caller
// keeps sess and closes it after [Run].
func SessionTarget(name string, level moat.Level, sess moat.Session) Target {
	return Target{
		Name:  name,
		Level: level,
		Run: func(ctx context.Context) error {
			res, err := sess.Run(ctx, moat.Request{Code: []byte(Code)})
			if err != nil {
				return fmt.Errorf("bench: %s: %w", name, err)
			}
			if res.ExitCode != 0 || res.Reason != moat.ReasonNone || string(res.Stdout) != Want {
				return fmt.Errorf("bench: %s: want exit 0 and stdout %q, got exit %d, reason %q, stdout %q, stderr %q",
					name, Want, res.ExitCode, res.Reason, clip(res.Stdout), clip(res.Stderr))
			}
			return nil
		},
	}
}
