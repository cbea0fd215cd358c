# uid_shared_limit: two runs side by side; P["role"] says which this is.
#
# The hog opens inotify instances until the kernel refuses with EMFILE while
# there is still room for a descriptor: the per-uid limit
# (fs.inotify.max_user_instances) is reached. Each time its descriptor table
# fills first, a child with a table of its own carries on, until the run's
# own limits refuse another process or P["max"] instances are held. It then
# prints its ready marker and holds everything until it is killed (or
# P["linger"] seconds pass).
#
# The probe, run while the hog holds, asks for one inotify instance. Failing
# with EMFILE while it has room for descriptors means that its neighbour
# exhausted a limit the two share: the per-uid limit of a uid they share.
import ctypes
import resource
import signal
import time

libc = ctypes.CDLL(None, use_errno=True)


def inotify():
    fd = libc.inotify_init1(0)
    if fd < 0:
        raise_errno("inotify_init1")
    return fd


def room():
    # Whether a plain descriptor can still be opened.
    try:
        os.close(os.open("/dev/null", os.O_RDONLY))
        return True
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return False
        raise


def fill(held):
    # Opens instances until something stops it. Returns how many and why it
    # stopped: "uid" (the per-uid limit), "table" (this process's descriptor
    # table is full), "cap" (P["max"] instances held in all) or "errno:N".
    n = 0
    while held + n < P["max"]:
        try:
            inotify()
        except OSError as e:
            if e.errno != errno.EMFILE:
                return n, "errno:%d" % e.errno
            return n, "uid" if room() else "table"
        n += 1
    return n, "cap"


def hold_until_released(release_r, release_w):
    # Keeps this process's instances until the top process dies.
    os.close(release_w)
    os.read(release_r, 1)
    os._exit(0)


def hog():
    status_r, status_w = os.pipe()
    release_r, release_w = os.pipe()
    top = os.getpid()
    held, procs = 0, 1
    while True:
        n, why = fill(held)
        held += n
        if why != "table":
            break
        try:
            pid = os.fork()
        except OSError as e:
            why = "fork:%d" % e.errno  # the run's own limits stop the hog
            break
        if pid == 0:
            # The child carries on with a descriptor table of its own once
            # it has closed its copies of its parent's instances (which the
            # parent keeps open).
            name_self()
            signal.alarm(P["linger"])
            lo = 3
            for fd in sorted((status_w, release_r, release_w)) + [resource.getrlimit(resource.RLIMIT_NOFILE)[0]]:
                os.closerange(lo, fd)
                lo = fd + 1
            procs += 1
            continue
        os.close(status_w)  # the last process of the chain writes the status
        if os.getpid() != top:
            hold_until_released(release_r, release_w)
        got = os.read(status_r, 4096).decode().split()
        if len(got) == 3:
            held, why, procs = int(got[0]), got[1], int(got[2])
        else:
            why = "a child died"
        break
    if os.getpid() != top:
        os.write(status_w, ("%d %s %d" % (held, why, procs)).encode())
        hold_until_released(release_r, release_w)
    err = None
    if why.startswith("errno:"):
        code = int(why[len("errno:"):])
        err = OSError(code, os.strerror(code))
    if held == 0:
        if err is not None:
            fail(err, "inotify_init1")
        else:
            report("no_instances", "inotify_init1: " + why)
        sys.exit(3)
    if why == "uid":
        succeed("holds %d inotify instances in %d process(es): the per-uid limit is reached" % (held, procs))
    elif why.startswith("fork:"):
        code = int(why[len("fork:"):])
        report("own_limits", "%d inotify instances in %d process(es), then fork: %s" % (held, procs, os.strerror(code)))
    elif err is not None:
        fail(err, "inotify_init1 after %d instances" % held)
    else:
        report("not_exhausted", "%d inotify instances in %d process(es) and no per-uid limit reached (%s)" % (held, procs, why))
    emit("READY", "%d" % held)
    time.sleep(P["linger"])


def probe():
    try:
        fd = inotify()
    except OSError as e:
        if e.errno == errno.EMFILE and room():
            succeed("inotify_init1 failed with EMFILE while the neighbour held its instances, with room for descriptors")
            return
        fail(e, "inotify_init1")
        sys.exit(3)
    os.close(fd)
    sys.stdout.write("MOAT-GOT an inotify instance of its own\n")
    sys.stdout.flush()


main(hog if P["role"] == "hog" else probe)
