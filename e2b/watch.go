// filesystem.Filesystem's WatchDir (files.watchDir), by polling the
// session's files from the host.

package e2b

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem"
)

const (
	// watchInterval is how often a watch lists the session's files: the
	// rate is bounded, and an event comes at most this late.
	watchInterval = 500 * time.Millisecond
	// maxWatches caps a sandbox's watches at once.
	maxWatches = 4
	// maxWatchedFiles caps the files a watch compares: a session with more
	// ends its watches (resource_exhausted) rather than list them on.
	maxWatchedFiles = 20000
)

// watchState is what a watch saw of a file.
type watchState struct {
	size  int64
	mod   time.Time
	mode  uint32
	isDir bool
}

// watchSnapshot lists the files under dir (a session file name) that a
// watch sees: its children, or everything under it when recursive, by
// their names relative to dir.
func watchSnapshot(ctx context.Context, sess moat.Session, dir string, recursive bool) (map[string]watchState, map[string]moat.FileInfo, error) {
	all, err := sess.ListFiles(ctx)
	if err != nil {
		return nil, nil, err
	}
	if len(all) > maxWatchedFiles {
		return nil, nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("e2b: the sandbox has %d files, more than a watch compares (%d)", len(all), maxWatchedFiles))
	}
	prefix := ""
	if dir != "." {
		prefix = dir + "/"
	}
	snap, infos := map[string]watchState{}, map[string]moat.FileInfo{}
	for _, fi := range all {
		rel, ok := strings.CutPrefix(fi.Name, prefix)
		if !ok || rel == "" || (!recursive && strings.Contains(rel, "/")) {
			continue
		}
		snap[rel] = watchState{size: fi.Size, mod: fi.ModTime, mode: uint32(fi.Mode), isDir: fi.IsDir}
		infos[rel] = fi
	}
	return snap, infos, nil
}

// watchEvents are the events between two snapshots, by name: created,
// removed, written (size or time changed), chmod (mode changed). A rename
// is a remove and a create.
func watchEvents(old, cur map[string]watchState) []*filesystem.FilesystemEvent {
	var evs []*filesystem.FilesystemEvent
	for _, name := range slices.Sorted(maps.Keys(cur)) {
		c := cur[name]
		o, had := old[name]
		switch {
		case !had:
			evs = append(evs, &filesystem.FilesystemEvent{Name: name, Type: filesystem.EventType_EVENT_TYPE_CREATE})
		case c.isDir != o.isDir:
			evs = append(evs, &filesystem.FilesystemEvent{Name: name, Type: filesystem.EventType_EVENT_TYPE_REMOVE},
				&filesystem.FilesystemEvent{Name: name, Type: filesystem.EventType_EVENT_TYPE_CREATE})
		default:
			if !c.isDir && (c.size != o.size || !c.mod.Equal(o.mod)) {
				evs = append(evs, &filesystem.FilesystemEvent{Name: name, Type: filesystem.EventType_EVENT_TYPE_WRITE})
			}
			if c.mode != o.mode {
				evs = append(evs, &filesystem.FilesystemEvent{Name: name, Type: filesystem.EventType_EVENT_TYPE_CHMOD})
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(old)) {
		if _, ok := cur[name]; !ok {
			evs = append(evs, &filesystem.FilesystemEvent{Name: name, Type: filesystem.EventType_EVENT_TYPE_REMOVE})
		}
	}
	return evs
}

// WatchDir streams the changes under a directory of the sandbox's, found by
// listing its session's files every watchInterval and comparing: a start
// event, then filesystem events with names relative to the directory, and
// keepalives (Keepalive-Ping-Interval seconds, default 50). A change undone
// between two listings is not seen. While the sandbox is paused the watch
// waits, without waking it; it ends with the request (the SDK's timeoutMs,
// or stop()), with the sandbox, at EndWatches, or when the session has more
// files than a watch compares.
func (f *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystem.WatchDirRequest], stream *connect.ServerStream[filesystem.WatchDirResponse]) error {
	sb := current(ctx)
	dir, sess, done, err := f.use(ctx, req.Msg.GetPath())
	if err != nil {
		return err
	}
	if dir != "." {
		fi, err := sess.Stat(ctx, dir)
		if err != nil {
			done()
			return fsError(err)
		}
		if !fi.IsDir {
			done()
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("e2b: %s is not a directory", homePath(dir)))
		}
	}
	recursive, withEntry := req.Msg.GetRecursive(), req.Msg.GetIncludeEntry()
	snap, _, err := watchSnapshot(ctx, sess, dir, recursive)
	done()
	if err != nil {
		return fsError(err)
	}
	select {
	case <-f.s.stopWatches:
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("e2b: moat serve is shutting down"))
	default:
	}
	if n := sb.watches.Add(1); n > maxWatches {
		sb.watches.Add(-1)
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("e2b: sandbox %s has %d watches, the most moat polls at once", sb.id, maxWatches))
	}
	defer sb.watches.Add(-1)
	if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Start{Start: &filesystem.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	keepalive := 50 * time.Second
	if s, err := strconv.Atoi(req.Header().Get("Keepalive-Ping-Interval")); err == nil && s > 0 {
		keepalive = max(time.Duration(s)*time.Second, time.Second)
	}
	poll, ping := time.NewTicker(watchInterval), time.NewTicker(keepalive)
	defer poll.Stop()
	defer ping.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-f.s.stopWatches:
			return nil
		case <-ping.C:
			if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Keepalive{Keepalive: &filesystem.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
			continue
		case <-poll.C:
		}
		sess, done, running, err := f.s.cfg.Sessions.PeekSession(sb.owner, sb.id)
		if err != nil {
			return connect.NewError(connect.CodeUnavailable, fmt.Errorf("e2b: sandbox %s is not running anymore: %w", sb.id, err))
		}
		if !running {
			continue // paused: nothing changes, and the watch does not wake it
		}
		cur, infos, err := watchSnapshot(ctx, sess, dir, recursive)
		done()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fsError(err)
		}
		for _, ev := range watchEvents(snap, cur) {
			if withEntry && ev.Type != filesystem.EventType_EVENT_TYPE_REMOVE {
				ev.Entry = entry(infos[ev.Name])
			}
			if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Filesystem{Filesystem: ev}}); err != nil {
				return err
			}
			ping.Reset(keepalive)
		}
		snap = cur
	}
}
