package version

import (
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

func TestFormat(t *testing.T) {
	for _, tc := range []struct {
		name string
		info debug.BuildInfo
		want string
	}{
		{"release", debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.3.0"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "1a2b3c4d5e6f7a8b9c0d"}, {Key: "vcs.modified", Value: "false"}}},
			"v0.3.0 rev 1a2b3c4d5e6f go1.26.8"},
		{"dirty", debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "1a2b3c4d5e6f7a8b9c0d"}, {Key: "vcs.modified", Value: "true"}}},
			"(devel) rev 1a2b3c4d5e6f+dirty go1.26.8"},
		{"no vcs", debug.BuildInfo{GoVersion: "go1.26.8"}, "(devel) go1.26.8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := format(&tc.info); got != tc.want {
				t.Errorf("format = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestStringNamesGoVersion(t *testing.T) {
	if s := String(); !strings.Contains(s, runtime.Version()) {
		t.Errorf("String() = %q, want it to contain %q", s, runtime.Version())
	}
}
