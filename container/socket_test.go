package container

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/moatsandbox/moat"
)

// A Docker socket the user may not open gets a remedy that names the
// docker group and says it is root-equivalent; an engine that is not
// there gets the set-up's.
func TestEngineUnreachableNamesTheDockerGroup(t *testing.T) {
	// As the Docker client wraps a connect that failed with EACCES.
	denied := fmt.Errorf("permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock: %w",
		&url.Error{Op: "Get", URL: "http://%2Fvar%2Frun%2Fdocker.sock/_ping", Err: &net.OpError{Op: "dial", Net: "unix", Err: os.NewSyscallError("connect", syscall.EACCES)}})
	refused := &url.Error{Op: "Get", URL: "http://x/_ping", Err: &net.OpError{Op: "dial", Net: "unix", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}}
	for _, tt := range []struct {
		err         error
		reason      string
		remedyHas   []string
		remedyLacks string
	}{
		{denied, "permission denied opening the Docker socket", []string{"docker group", "root-equivalent"}, "setup-docker.sh"},
		{refused, "no Docker engine answers", []string{"setup-docker.sh"}, "docker group"},
	} {
		err := engineUnreachable("unix:///var/run/docker.sock", tt.err)
		ue, ok := errors.AsType[*moat.UnavailableError](err)
		if !ok || !errors.Is(err, moat.ErrUnavailable) {
			t.Fatalf("%v: not an UnavailableError", err)
		}
		if !strings.HasPrefix(ue.Reason, tt.reason) {
			t.Errorf("reason %q, want %q", ue.Reason, tt.reason)
		}
		for _, w := range tt.remedyHas {
			if !strings.Contains(ue.Remedy, w) {
				t.Errorf("remedy %q does not say %q", ue.Remedy, w)
			}
		}
		if strings.Contains(ue.Remedy, tt.remedyLacks) {
			t.Errorf("remedy %q says %q", ue.Remedy, tt.remedyLacks)
		}
	}
}
