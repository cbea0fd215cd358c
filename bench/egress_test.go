package bench

import (
	"context"
	"errors"
	"testing"

	"github.com/moatsandbox/moat"
)

func TestMeasureEgress(t *testing.T) {
	c, err := MeasureEgress(context.Background(), 5, 3<<20)
	if err != nil {
		t.Fatal(err)
	}
	if c.Requests != 5 || c.Bytes != 3<<20 || c.Direct <= 0 || c.Proxied <= 0 || c.DirectMBps <= 0 || c.ProxiedMBps <= 0 ||
		c.Added != c.Proxied-c.Direct {
		t.Fatalf("MeasureEgress = %+v", c)
	}
	if _, err := MeasureEgress(context.Background(), 0, 1); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("no requests: %v, want ErrInvalid", err)
	}
}
