//go:build linux && !amd64 && !arm64

package seccomp

// Docker has no policy for this architecture.
func Docker() (*DockerProfile, error) {
	return nil, ErrUnsupportedArch
}
