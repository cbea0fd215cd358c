//go:build !amd64 && !arm64

package gvisor

// No guest filter here: sessions are unavailable.
const (
	guestArch = 0
	guestX32  = 0
	sysClone  = 0
	sysClone3 = 0
)

var guestSyscalls = map[string]uint32{}
