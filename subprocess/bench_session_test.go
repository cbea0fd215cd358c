package subprocess_test

import (
	"context"
	"os"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// BenchmarkSessionRun times one run of a session, without and with a live
// interpreter.
func BenchmarkSessionRun(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("strict hardening needs root")
	}
	for _, interp := range []bool{false, true} {
		name := "plain"
		if interp {
			name = "interpreter"
		}
		b.Run(name, func(b *testing.B) {
			sb, err := subprocess.New(subprocess.Config{})
			if err != nil {
				b.Fatal(err)
			}
			defer sb.Close()
			s, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: interp})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			req := moat.Request{Code: []byte("print(1)")}
			for b.Loop() {
				res, err := s.Run(context.Background(), req)
				if err != nil || string(res.Stdout) != "1\n" {
					b.Fatalf("%v %+v", err, res)
				}
			}
		})
	}
}
