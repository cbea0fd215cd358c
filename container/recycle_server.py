# The init of a recycled container of the runc driver (runc_recycle.go): it
# starts, on the host's word, the python3 of each run and reports how it
# ended; it runs nothing of the code's and reads nothing the code can write.
#
# It runs as uid 0 with CAP_SETUID, CAP_SETGID and CAP_SETPCAP only (and
# moat's seccomp filter, no_new_privs, the container's namespaces): each
# run's python3 drops the bounding set, then its groups, gid and uid to the
# container's uid, which leaves it no capability in any set, as a fresh
# container's init has none. The code, of another uid, can then neither
# signal the server nor trace it, read its memory or descriptors, nor
# change its limits or scheduling (prlimit, setpriority, sched_setattr,
# ioprio_set all need the same uid): none of what it could do to a process
# of its own uid reaches the next run through the server.
#
# fd 3 is its end of a unix SOCK_SEQPACKET socket pair whose other end is
# moat's, on the host; nothing else in the container can reach it. Messages:
#   host -> server  b'S' with three descriptors (SCM_RIGHTS): start the next
#                   run's python3 with them as its stdin, stdout and stderr
#   server -> host  b'R'            ready (undumpable, SIGINT ignored)
#                   b'P<pid>'       started (its pid in the container)
#                   b'F<why>'       could not start it
#                   b'E<pid> <st>'  it ended, st its raw wait status
# Any other message from the host ends the server, and so the container.
#
# It also makes itself undumpable, ignores SIGINT and catches only SIGCHLD
# (the host checks that from /proc), and imports everything it needs
# before any run: python3 -I -S keeps the working directory and the user's
# site off sys.path anyway.
import array, ctypes, os, select, signal, socket, sys

ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE, 0
signal.signal(signal.SIGINT, signal.SIG_IGN)
wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
os.set_inheritable(3, False)
ctl = socket.socket(fileno=3)
python = sys.argv[1]
workdir = sys.argv[2]
uid = int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
PR_CAPBSET_DROP = 24
env = dict(os.environ)
env['PWD'] = workdir  # as the shell of a fresh container's init sets it
child = 0


def send(msg):
    try:
        ctl.send(msg)
    except OSError:
        os._exit(0)


def start(fds):
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for s in signal.valid_signals():
                try:
                    signal.signal(s, signal.SIG_DFL)
                except (OSError, ValueError, RuntimeError):
                    pass
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            os.setsid()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
            os.closerange(3, 1 << 20)
            # The OOM killer's choice before the server (raising it needs
            # no capability; only uid 0 may still write it).
            with open('/proc/self/oom_score_adj', 'w') as f:
                f.write('1000')
            last = int(open('/proc/sys/kernel/cap_last_cap').read())
            for cap in range(last + 1):
                if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    os._exit(126)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.chdir(workdir)
            os.execvpe(python, [python, '-'], env)
        finally:
            os._exit(127)
    return pid


ctl.send(b'R')
while True:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid == child:
            child = 0
            send(b'E%d %d' % (pid, status))
    ready, _, _ = select.select([ctl, wake_r], [], [])
    if wake_r in ready:
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
    if ctl not in ready:
        continue
    try:
        msg, fds, _, _ = socket.recv_fds(ctl, 16, 3)
    except OSError:
        os._exit(0)
    if msg != b'S' or len(fds) != 3 or child:
        os._exit(0)
    try:
        child = start(fds)
    except OSError as e:
        send(b'F' + repr(e).encode('ascii', 'replace')[:200])
    else:
        send(b'P%d' % child)
    for fd in fds:
        os.close(fd)
