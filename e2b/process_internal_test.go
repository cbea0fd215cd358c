package e2b

import (
	"testing"

	"github.com/moatsandbox/moat/e2b/internal/envd/process"
)

// A Connect that finds a command just as it ends (its subscribers closed,
// the command not yet out of the table) gets a closed channel: it used to
// get one that nothing would ever close, and held its connection and
// goroutine for as long as the client kept it open.
func TestSubscribeAfterEnd(t *testing.T) {
	p := &proc{}
	early := p.subscribe()
	p.closeSubs()
	late := p.subscribe()
	for name, c := range map[string]chan *process.ProcessEvent{"early": early, "late": late} {
		select {
		case _, ok := <-c:
			if ok {
				t.Errorf("%s subscriber: an event, want the channel closed", name)
			}
		default:
			t.Errorf("%s subscriber: the channel is open after the command ended", name)
		}
	}
}
