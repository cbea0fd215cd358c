package bench

import (
	"context"
	"testing"
)

// BenchmarkPython3Direct times the baseline: python3 -c 'print(1)' started
// directly, output checked.
func BenchmarkPython3Direct(b *testing.B) {
	target := PythonTarget("")
	ctx := context.Background()
	for b.Loop() {
		if err := target.Run(ctx); err != nil {
			b.Fatal(err)
		}
	}
}
