//go:build !amd64

package subprocess

// reaperELF is empty: there is no reaper for this architecture, and the Go
// helper reaps the run itself (reaper.go).
var reaperELF []byte
