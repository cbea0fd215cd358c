package moat_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/moatsandbox/moat"
)

func ExampleParseBytes() {
	for _, s := range []string{"256MiB", "64 MiB", "1G", "4096", "1.5KiB", "2GB"} {
		b, err := moat.ParseBytes(s)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Printf("%-9q is %10d bytes, printed %v\n", s, int64(b), b)
	}
	for _, s := range []string{"-1MiB", "1TiB", "lots"} {
		_, err := moat.ParseBytes(s)
		fmt.Println(errors.Is(err, moat.ErrInvalid), err)
	}
	// Output:
	// "256MiB"  is  268435456 bytes, printed 256MiB
	// "64 MiB"  is   67108864 bytes, printed 64MiB
	// "1G"      is 1073741824 bytes, printed 1GiB
	// "4096"    is       4096 bytes, printed 4KiB
	// "1.5KiB"  is       1536 bytes, printed 1536B
	// "2GB"     is 2000000000 bytes, printed 1953125KiB
	// true moat: size "-1MiB" does not parse (want e.g. 256MiB): invalid input
	// true moat: size "1TiB" does not parse (want e.g. 256MiB): invalid input
	// true moat: size "lots" does not parse (want e.g. 256MiB): invalid input
}

// An operator's limits, read from a config file: what is not set takes its
// default.
func ExampleLimits() {
	var l moat.Limits
	config := `{"wall_time": "30s", "memory": "512MiB", "pids": 32}`
	if err := json.Unmarshal([]byte(config), &l); err != nil {
		fmt.Println(err)
		return
	}
	if err := l.Validate(); err != nil {
		fmt.Println(err)
		return
	}
	l = l.WithDefaults()
	fmt.Println("wall time:", l.WallTime, "cpu time:", l.CPUTime)
	fmt.Println("memory:", l.Memory, "pids:", l.Pids, "output:", l.Output)
	out, _ := json.Marshal(l)
	fmt.Println(string(out))
	// Output:
	// wall time: 30s cpu time: 10s
	// memory: 512MiB pids: 32 output: 1MiB
	// {"wall_time":"30s","cpu_time":"10s","memory":"512MiB","pids":32,"file_size":"16MiB","disk":"64MiB","output":"1MiB","open_files":256}
}

func ExampleLimits_Validate() {
	l := moat.Limits{CPUTime: moat.Duration(500 * time.Millisecond), Memory: 8 * moat.MiB}
	err := l.Validate()
	fmt.Println(errors.Is(err, moat.ErrInvalid))
	fmt.Println(err)
	// Output:
	// true
	// moat: limits: cpu time 500ms is under the 1s granularity of the CPU limit
	// memory 8MiB is below the 16MiB Python needs to start: invalid input
}
