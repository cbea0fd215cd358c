package e2b_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem"
)

// TestWatchDirWire: a watch refuses what is not a directory of the
// sandbox's; it does not wake a paused sandbox (it waits, and sees the
// changes once the sandbox is resumed); a sandbox has at most 4 watches;
// a watch ends when its sandbox is killed.
func TestWatchDirWire(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := run(t, cl, bash("echo x > f.txt; mkdir d")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/etc", "/home/user/f.txt", "/home/user/nope"} {
		stream, err := cl.fs.WatchDir(ctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: p}))
		if err == nil {
			for stream.Receive() {
			}
			err = stream.Err()
		}
		if code := connect.CodeOf(err); code != connect.CodeInvalidArgument && code != connect.CodeNotFound {
			t.Errorf("watch %s: %v, want invalid_argument or not_found", p, err)
		}
	}

	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	stream, err := cl.fs.WatchDir(wctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: "/home/user/d", Recursive: true}))
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan string, 100)
	go func() {
		defer close(events)
		for stream.Receive() {
			if ev := stream.Msg().GetFilesystem(); ev != nil {
				events <- ev.GetType().String() + " " + ev.GetName()
			}
		}
	}()
	if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/pause", nil, nil); resp.StatusCode != http.StatusNoContent {
		t.Fatalf("pause while watched: %d", resp.StatusCode)
	}
	time.Sleep(2 * time.Second) // four polls
	if info, err := ts.srv.Session("a", c.SandboxID); err != nil || info.State != "suspended" {
		t.Errorf("a watched sandbox after its pause: %+v %v, want it suspended still", info, err)
	}
	// Resumed by a write (as any use resumes), the watch sees it.
	resp, err := cl.http.Post(ts.URL+"/files?path=/home/user/d/new.txt", "application/octet-stream", strings.NewReader("new"))
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	select {
	case ev := <-events:
		if ev != "EVENT_TYPE_CREATE new.txt" {
			t.Errorf("the first event: %q, want the create of new.txt", ev)
		}
	case <-time.After(10 * time.Second):
		t.Error("no event after the resume")
	}

	var more []*connect.ServerStreamForClient[filesystem.WatchDirResponse]
	for range 3 {
		s, err := cl.fs.WatchDir(ctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: "/home/user"}))
		if err != nil || !s.Receive() {
			t.Fatalf("a watch under the cap: %v %v", err, s.Err())
		}
		more = append(more, s)
	}
	over, err := cl.fs.WatchDir(ctx, connect.NewRequest(&filesystem.WatchDirRequest{Path: "/home/user"}))
	if err == nil {
		for over.Receive() {
		}
		err = over.Err()
	}
	if connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a fifth watch: %v, want resource_exhausted", err)
	}
	// Killing the sandbox ends its watches.
	ts.do(t, keyA, "DELETE", "/sandboxes/"+c.SandboxID, nil, nil)
	done := make(chan struct{})
	go func() {
		for _, s := range more {
			for s.Receive() {
			}
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Error("the watches of a killed sandbox go on")
	}
}

// TestWatchersWire: the watches that a client polls (CreateWatcher,
// GetWatcherEvents, RemoveWatcher) see what a stream sees, share the
// sandbox's cap of 4 watches, and are gone once removed.
func TestWatchersWire(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	ctx := context.Background()
	w, err := cl.fs.CreateWatcher(ctx, connect.NewRequest(&filesystem.CreateWatcherRequest{Path: "/home/user", Recursive: true}))
	if err != nil {
		t.Fatal(err)
	}
	id := w.Msg.GetWatcherId()
	if _, err := run(t, cl, bash("mkdir -p a && echo x > a/b.txt")); err != nil {
		t.Fatal(err)
	}
	var seen []string
	for i := 0; i < 40 && len(seen) < 2; i++ {
		time.Sleep(watchPause)
		evs, err := cl.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystem.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range evs.Msg.GetEvents() {
			seen = append(seen, ev.GetType().String()+" "+ev.GetName())
		}
	}
	if strings.Join(seen, ",") != "EVENT_TYPE_CREATE a,EVENT_TYPE_CREATE a/b.txt" {
		t.Errorf("a watcher's events: %v", seen)
	}
	for range 3 {
		if _, err := cl.fs.CreateWatcher(ctx, connect.NewRequest(&filesystem.CreateWatcherRequest{Path: "/home/user"})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cl.fs.CreateWatcher(ctx, connect.NewRequest(&filesystem.CreateWatcherRequest{Path: "/home/user"})); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a fifth watcher: %v, want resource_exhausted", err)
	}
	if _, err := cl.fs.RemoveWatcher(ctx, connect.NewRequest(&filesystem.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystem.GetWatcherEventsRequest{WatcherId: id})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a removed watcher: %v, want not_found", err)
	}
	if _, err := cl.fs.CreateWatcher(ctx, connect.NewRequest(&filesystem.CreateWatcherRequest{Path: "/home/user"})); err != nil {
		t.Errorf("a watcher after one was removed: %v", err)
	}
}

// watchPause is longer than the watches' polling interval.
const watchPause = 600 * time.Millisecond
