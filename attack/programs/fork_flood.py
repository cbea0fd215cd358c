# fork_flood: start P["procs"] children that all stay alive at once. Each
# child tells the parent it runs, then blocks reading a pipe whose only
# writer is the parent: when the parent closes it, or dies, every child
# exits.
import signal


def attack():
    want = P["procs"]
    release_r, release_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pids = []
    err = None
    for _ in range(want):
        try:
            pid = os.fork()
        except BaseException as e:
            err = e
            break
        if pid == 0:
            try:
                os.close(release_w)
                os.close(ready_r)
                signal.alarm(P["linger"])
                os.write(ready_w, b"x")
                os.read(release_r, 1)
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(ready_w)
    ready = 0
    while ready < len(pids):
        b = os.read(ready_r, 4096)
        if not b:
            break
        ready += len(b)
    alive = sum(1 for pid in pids if os.waitpid(pid, os.WNOHANG) == (0, 0))
    if err is None and ready == want and alive == want:
        succeed("%d processes alive at once" % alive)
    os.close(release_w)
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    if err is not None:
        if isinstance(err, OSError) and err.errno == errno.EAGAIN:
            report("fork_refused", "fork %d" % (len(pids) + 1), err)
        else:
            fail(err, "fork %d" % (len(pids) + 1))
        sys.exit(3)
    if alive != want:
        report("children_died", "%d of %d ready, %d alive" % (ready, want, alive))
        sys.exit(3)


main(attack)
