//go:build linux && !amd64 && !arm64

package seccomp

import "golang.org/x/net/bpf"

// program has no policy for this architecture.
func program(tcp bool) ([]bpf.Instruction, error) {
	return nil, ErrUnsupportedArch
}
