//go:build !amd64

package helper

// ReaperELF is empty: there is no reaper for this architecture, and the Go
// helper reaps the run itself (reaper.go).
var ReaperELF []byte
