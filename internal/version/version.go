// Package version reports which build of moat is running, read from the
// build information the Go toolchain embeds in every binary.
package version

import (
	"runtime/debug"
	"strings"
)

// String returns one line naming this build: the module version, the VCS
// revision (12 characters, "+dirty" when the tree had uncommitted changes)
// and the Go version, for example
//
//	v0.3.0 rev 1a2b3c4d5e6f+dirty go1.26.8
//
// Parts the binary does not carry are left out: a `go test` binary has no
// revision, and a build outside a module reports "(devel)". It never fails
// and is safe for concurrent use.
func String() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "(unknown)"
	}
	return format(info)
}

func format(info *debug.BuildInfo) string {
	v := info.Main.Version
	if v == "" {
		v = "(devel)"
	}
	parts := []string{v}
	var rev string
	dirty := false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if dirty {
			rev += "+dirty"
		}
		parts = append(parts, "rev "+rev)
	}
	if info.GoVersion != "" {
		parts = append(parts, info.GoVersion)
	}
	return strings.Join(parts, " ")
}
