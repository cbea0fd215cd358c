package server_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// TestFrontRecordLastsAsTheSession: a front end's record (SessionSpec.Front,
// SetFront) is kept with its session through a suspend and a graceful
// restart, listed by FrontSessions whatever the owner, refused over
// MaxFrontBytes, and gone with the session.
func TestFrontRecordLastsAsTheSession(t *testing.T) {
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	state := t.TempDir()
	open := func() *server.Server {
		srv, err := server.New(server.Config{
			Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelSubprocess: sb},
			Tokens:    []server.Token{{Name: "a", Token: tokenA}},
			StateDir:  state, OnIdle: server.OnIdleSuspend,
		})
		if err != nil {
			t.Fatal(err)
		}
		return srv
	}
	shut := func(srv *server.Server) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Error(err)
		}
	}
	ctx := context.Background()
	srv := open()
	if _, err := srv.CreateSession(ctx, "a", server.SessionSpec{Front: make([]byte, server.MaxFrontBytes+1)}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("a front record over the cap: %v", err)
	}
	with, err := srv.CreateSession(ctx, "a", server.SessionSpec{Front: []byte("first")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := srv.CreateSession(ctx, "a", server.SessionSpec{}); err != nil {
		t.Fatal(err)
	}
	if err := srv.SetFront("a", with.ID, []byte("second")); err != nil {
		t.Fatal(err)
	}
	if err := srv.SetFront("b", with.ID, []byte("not b's")); err == nil {
		t.Error("SetFront of another owner's session succeeded")
	}
	shut(srv)

	srv = open()
	fronts := srv.FrontSessions()
	if len(fronts) != 1 || fronts[0].ID != with.ID || string(fronts[0].Front) != "second" || fronts[0].State != "suspended" {
		t.Errorf("after the restart: %+v, want %s suspended with its second record", fronts, with.ID)
	}
	if err := srv.EndSession("a", with.ID); err != nil {
		t.Fatal(err)
	}
	shut(srv)
	srv = open()
	defer shut(srv)
	if fronts := srv.FrontSessions(); len(fronts) != 0 {
		t.Errorf("after the session ended: %+v", fronts)
	}
}
