//go:build linux

package seccomp

import (
	"fmt"
	"os"
)

// int80Main exists for the shared child dispatcher; arm64 has no way to
// make a foreign-architecture system call from a 64-bit task.
func int80Main() int {
	fmt.Fprintln(os.Stderr, "int80 is amd64 only")
	return 2
}
