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
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem"
)

const (
	// watchInterval is how often a watch lists the session's files at
	// most, and so how late an event comes at least.
	watchInterval = 500 * time.Millisecond
	// watchDuty bounds the time a watch spends listing: after a listing
	// that took d, the next waits at least watchDuty*d, so that a watch of
	// many files lists them less often instead of using a core.
	watchDuty = 10
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
		if !ok || rel == "" || (!recursive && strings.Contains(rel, "/")) || hiddenName(fi.Name) {
			continue
		}
		snap[rel] = watchState{size: fi.Size, mod: fi.ModTime, mode: uint32(fi.Mode), isDir: fi.IsDir}
		infos[rel] = fi
	}
	return snap, infos, nil
}

// startWatch checks that p is a directory of the current sandbox's and
// takes a watch's first listing of it, counted in the sandbox's watches
// (the caller takes it off when the watch ends).
func (f *filesystemService) startWatch(ctx context.Context, p string, recursive bool) (string, map[string]watchState, error) {
	sb := current(ctx)
	dir, sess, done, err := f.use(ctx, p)
	if err != nil {
		return "", nil, err
	}
	defer done()
	if dir != "." {
		fi, err := sess.Stat(ctx, dir)
		if err != nil {
			return "", nil, fsError(err)
		}
		if !fi.IsDir {
			return "", nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("e2b: %s is not a directory", homePath(dir)))
		}
	}
	snap, _, err := watchSnapshot(ctx, sess, dir, recursive)
	if err != nil {
		return "", nil, fsError(err)
	}
	select {
	case <-f.s.stopWatches:
		return "", nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("e2b: moat serve is shutting down"))
	default:
	}
	if n := sb.watches.Add(1); n > maxWatches {
		sb.watches.Add(-1)
		return "", nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("e2b: sandbox %s has %d watches, the most moat polls at once", sb.id, maxWatches))
	}
	return dir, snap, nil
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
// listing its session's files every watchInterval (or watchDuty times as
// long as the last listing took, if longer) and comparing: a start
// event, then filesystem events with names relative to the directory, and
// keepalives (Keepalive-Ping-Interval seconds, default 50). A change undone
// between two listings is not seen. While the sandbox is paused the watch
// waits, without waking it; it ends with the request (the SDK's timeoutMs,
// or stop()), with the sandbox, at EndWatches, or when the session has more
// files than a watch compares.
func (f *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystem.WatchDirRequest], stream *connect.ServerStream[filesystem.WatchDirResponse]) error {
	sb := current(ctx)
	recursive, withEntry := req.Msg.GetRecursive(), req.Msg.GetIncludeEntry()
	dir, snap, err := f.startWatch(ctx, req.Msg.GetPath(), recursive)
	if err != nil {
		return err
	}
	defer sb.watches.Add(-1)
	if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Start{Start: &filesystem.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	keepalive := 50 * time.Second
	if s, err := strconv.Atoi(req.Header().Get("Keepalive-Ping-Interval")); err == nil && s > 0 {
		keepalive = max(time.Duration(s)*time.Second, time.Second)
	}
	poll, ping := time.NewTimer(watchInterval), time.NewTicker(keepalive)
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
			poll.Reset(watchInterval)
			continue // paused: nothing changes, and the watch does not wake it
		}
		start := time.Now()
		cur, infos, err := watchSnapshot(ctx, sess, dir, recursive)
		done()
		poll.Reset(max(watchInterval, watchDuty*time.Since(start)))
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

// watcher is a watch that its client polls (CreateWatcher and
// GetWatcherEvents, what the Python SDK's watch_dir calls) instead of a
// stream. One that is not polled for watcherIdle is dropped at the next
// CreateWatcher of its sandbox, so that forgotten watchers do not hold
// the sandbox's watches.
type watcher struct {
	dir       string
	recursive bool
	withEntry bool

	mu   sync.Mutex
	snap map[string]watchState
	// last is when it was last listed, or made; cost how long that
	// listing took.
	last time.Time
	cost time.Duration
}

const watcherIdle = time.Minute

func (f *filesystemService) CreateWatcher(ctx context.Context, req *connect.Request[filesystem.CreateWatcherRequest]) (*connect.Response[filesystem.CreateWatcherResponse], error) {
	sb := current(ctx)
	sb.watchMu.Lock()
	for id, w := range sb.watchers {
		w.mu.Lock()
		idle := time.Since(w.last) > watcherIdle
		w.mu.Unlock()
		if idle {
			delete(sb.watchers, id)
			sb.watches.Add(-1)
		}
	}
	sb.watchMu.Unlock()
	dir, snap, err := f.startWatch(ctx, req.Msg.GetPath(), req.Msg.GetRecursive())
	if err != nil {
		return nil, err
	}
	id := newContextID()
	sb.watchMu.Lock()
	if sb.watchers == nil {
		sb.watchers = map[string]*watcher{}
	}
	sb.watchers[id] = &watcher{dir: dir, recursive: req.Msg.GetRecursive(), withEntry: req.Msg.GetIncludeEntry(), snap: snap, last: time.Now()}
	sb.watchMu.Unlock()
	return connect.NewResponse(&filesystem.CreateWatcherResponse{WatcherId: id}), nil
}

func (f *filesystemService) watcher(ctx context.Context, id string) (*watcher, error) {
	sb := current(ctx)
	sb.watchMu.Lock()
	defer sb.watchMu.Unlock()
	w, ok := sb.watchers[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("e2b: no watcher %q in sandbox %s", id, sb.id))
	}
	return w, nil
}

// GetWatcherEvents returns the changes since the watcher's last listing.
// It lists the session's files at most once every watchInterval, or
// watchDuty times as long as the last listing took (an earlier call gets
// no events), and not while the sandbox is paused.
func (f *filesystemService) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystem.GetWatcherEventsRequest]) (*connect.Response[filesystem.GetWatcherEventsResponse], error) {
	sb := current(ctx)
	w, err := f.watcher(ctx, req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	out := &filesystem.GetWatcherEventsResponse{}
	if time.Since(w.last) < max(watchInterval, watchDuty*w.cost) {
		return connect.NewResponse(out), nil
	}
	sess, done, running, err := f.s.cfg.Sessions.PeekSession(sb.owner, sb.id)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("e2b: sandbox %s is not running anymore: %w", sb.id, err))
	}
	if !running {
		return connect.NewResponse(out), nil
	}
	start := time.Now()
	cur, infos, err := watchSnapshot(ctx, sess, w.dir, w.recursive)
	done()
	if err != nil {
		return nil, fsError(err)
	}
	w.cost = time.Since(start)
	for _, ev := range watchEvents(w.snap, cur) {
		if w.withEntry && ev.Type != filesystem.EventType_EVENT_TYPE_REMOVE {
			ev.Entry = entry(infos[ev.Name])
		}
		out.Events = append(out.Events, ev)
	}
	w.snap, w.last = cur, time.Now()
	return connect.NewResponse(out), nil
}

func (f *filesystemService) RemoveWatcher(ctx context.Context, req *connect.Request[filesystem.RemoveWatcherRequest]) (*connect.Response[filesystem.RemoveWatcherResponse], error) {
	sb := current(ctx)
	sb.watchMu.Lock()
	defer sb.watchMu.Unlock()
	if _, ok := sb.watchers[req.Msg.GetWatcherId()]; !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("e2b: no watcher %q in sandbox %s", req.Msg.GetWatcherId(), sb.id))
	}
	delete(sb.watchers, req.Msg.GetWatcherId())
	sb.watches.Add(-1)
	return connect.NewResponse(&filesystem.RemoveWatcherResponse{}), nil
}
