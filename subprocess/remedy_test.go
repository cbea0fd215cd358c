package subprocess

import (
	"strings"
	"testing"
)

// Without root, the remedy that offers the tutorial profile says what it
// lets through: the three of the tutorial's six attacks it does not block.
func TestNotRootRemedySaysWhatTutorialLetsThrough(t *testing.T) {
	for _, want := range []string{"--hardening=tutorial", "3 of the tutorial's 6", "fork flood", "credentials", "local services"} {
		if !strings.Contains(notRootRemedy, want) {
			t.Errorf("the remedy %q does not say %q", notRootRemedy, want)
		}
	}
}
