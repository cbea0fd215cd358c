package container

import (
	"errors"
	"io/fs"
)

// dockerGroupRemedy is the remedy for a Docker socket the user may not
// open. It names the docker group and says what joining it means.
const dockerGroupRemedy = "run moat as root, or add your user to the docker group (usermod -aG docker USER, then log in again); " +
	"know that the docker group is root-equivalent: any member can start a container that mounts the host's / and owns the machine"

// engineUnreachable is the error for an engine at host whose Ping failed
// with err: a socket the user may not open (EACCES) gets its own reason
// and remedy, anything else means no engine answers there.
func engineUnreachable(host string, err error) error {
	if errors.Is(err, fs.ErrPermission) {
		return unavailable("permission denied opening the Docker socket at "+host, dockerGroupRemedy, err)
	}
	return unavailable("no Docker engine answers at "+host, "run scripts/setup-docker.sh (as root) to install and start dockerd", err)
}
