package gvisor_test

import (
	"context"
	"fmt"
	"log"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
)

// A sandbox with the default limits, on the systrap platform, over the image
// that `moat image build` made. It needs root, runsc and the image
// (scripts/setup-gvisor.sh installs both).
func ExampleNew() {
	sb, err := gvisor.New(gvisor.Config{Limits: moat.Limits{Memory: 128 * moat.MiB}})
	if err != nil {
		log.Fatal(err) // errors.Is(err, moat.ErrUnavailable) says what to do
	}
	defer sb.Close()
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(6 * 7)")})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s(exit %d, platform %s)\n", res.Stdout, res.ExitCode, sb.Platform())
}

// Check is what `moat doctor` prints for the level.
func ExampleCheck() {
	a := gvisor.Check(context.Background(), gvisor.Config{})
	if !a.Available {
		fmt.Println("gvisor unavailable:", a.Reason, "-", a.Remedy)
		return
	}
	for _, d := range a.Details {
		fmt.Println(d) // runsc's version, the platform, the image, the cgroups
	}
}
