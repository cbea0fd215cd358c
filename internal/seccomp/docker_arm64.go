//go:build linux

package seccomp

// dockerArch is the architecture the container profile is for.
const dockerArch = "SCMP_ARCH_AARCH64"

// archAllowed is empty: Moby's arm-only entries are 32-bit ARM syscalls.
var archAllowed = []string{}

// archNames is empty, as deniedArch is.
var archNames = map[uint32]string{}
