// Command buildimage builds moat's shared root filesystem (package image)
// when the moat binary at hand has no "image build" command yet. It is what
// scripts/setup-microvm.sh falls back to; building it twice does nothing the
// second time.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/moatsandbox/moat/image"
)

func main() {
	cfg := image.Config{Progress: os.Stdout, StateDir: os.Getenv("STATE")}
	rec, cached, err := image.BuildRootFS(context.Background(), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "buildimage:", err)
		os.Exit(1)
	}
	if cached {
		fmt.Printf("image %s already built (python %s)\n", rec.Key[:12], rec.PythonVersion)
		return
	}
	fmt.Printf("image %s built (python %s, %d bytes)\n", rec.Key[:12], rec.PythonVersion, rec.Size)
}
