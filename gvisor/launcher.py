# moat's launcher of one session run inside a gVisor sandbox (see
# session.go). runsc exec starts it as root with CAP_SYS_ADMIN, CAP_SETUID,
# CAP_SETGID and CAP_SETPCAP, python3 -I -S, from /, with fd 3 a pipe to the
# host. It makes a PID namespace for the run, forks the run's first process
# into it as that namespace's init, and relays to the host on fd 3, in this
# order, one line each:
#
#   pid N      the run's init, as the sandbox's root PID namespace numbers it
#   ready      the init has exec'd python3, which reads the code from stdin
#   status S   its raw wait status, once it has ended
#   error M    instead of status, when the run could not be started
#
# then exits as the run's init did. When the init ends, gVisor's kernel kills
# every other process of the namespace and waits for them before the init's
# exit completes: once this launcher has its status, nothing of the run is
# left. The run has an IPC namespace of its own too, so that SysV IPC
# objects it made (shared memory, semaphores, message queues), which outlive
# their processes, end with it. The init is the code's python3, as the session's uid with no
# capability in any set, no_new_privs, the guest seccomp filter, and no way
# to leave the namespace (the filter denies unshare, setns and clone's
# namespace flags).
#
# Arguments: the filter (hex of struct sock_filter[]), uid, gid, the
# working directory, the interpreter, the mode ('run'; 'init' for the
# container init of a session with a live interpreter, which starts each
# interpreter itself, see serve()), the number N of the interpreter's
# arguments, those N arguments, then the code's environment. A live
# interpreter (interpreter.go) also gets fd 4, its channel of records to
# the host, which only it keeps, and RLIMIT_CPU lifted: the interpreter
# lives across runs, and the host's cgroup bounds each run's CPU time
# instead.
import ctypes
import os
import signal
import sys

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWPID = 0x20000000
CLONE_NEWIPC = 0x08000000
PR_CAPBSET_DROP = 24
RLIMIT_CPU = 0
RLIMIT_NPROC = 6
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


class sock_fprog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]


def report(line):
    os.write(3, line.encode() + b'\n')


def check(r, what):
    if r != 0:
        raise OSError(ctypes.get_errno(), what)


def child(go_r, err_w, prog, uid, gid, cwd, python, interp, pyargs, env):
    # Run only once the host knows the pid: a kill it sends then reaches
    # this process.
    os.close(3)
    if os.read(go_r, 1) != b'g':
        os._exit(125)
    os.close(go_r)
    try:
        import resource
        if interp:
            resource.setrlimit(RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        # gVisor counts a task toward its user's RLIMIT_NPROC by the uid it
        # was created with: this process, forked as root and then made the
        # session's uid, is not counted, so the tasks it creates get one
        # fewer and the run, this process included, has at most the limit.
        soft, hard = resource.getrlimit(RLIMIT_NPROC)
        if 1 < soft != resource.RLIM_INFINITY and 1 < hard != resource.RLIM_INFINITY:
            resource.setrlimit(RLIMIT_NPROC, (soft - 1, hard - 1))
        for cap in range(64):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break  # EINVAL past the last capability
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # clears the permitted and effective sets
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 'no_new_privs')
        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = sock_fprog(len(prog) // 8, ctypes.addressof(buf))
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), 'seccomp')
        os.chdir(cwd)
        # -s: the user site directory is not read. The code may write
        # there (HOME is the working directory), and a usercustomize or .pth
        # file would run when the next run's python3 starts, which is
        # before that run, between runs.
        os.execve(python, [python] + pyargs, env)
    except BaseException as e:
        os.write(err_w, ('%s' % e).encode()[:500])
    os._exit(125)


def main():
    prog = bytes.fromhex(sys.argv[1])
    uid, gid = int(sys.argv[2]), int(sys.argv[3])
    cwd, python = sys.argv[4], sys.argv[5]
    mode = sys.argv[6]
    n = int(sys.argv[7])
    pyargs = sys.argv[8:8 + n]
    env = dict(e.split('=', 1) for e in sys.argv[8 + n:])
    args = (prog, uid, gid, cwd, python, pyargs, env)
    if mode == 'init':
        serve(args)
    launch(*args)


def launch(prog, uid, gid, cwd, python, pyargs, env):
    try:
        check(libc.unshare(CLONE_NEWPID | CLONE_NEWIPC), 'unshare')
        go_r, go_w = os.pipe()
        err_r, err_w = os.pipe()  # close-on-exec: EOF once the code's python runs
        pid = os.fork()
    except OSError as e:
        report('error %s' % e)
        os._exit(125)
    if pid == 0:
        os.close(go_w)
        os.close(err_r)
        child(go_r, err_w, prog, uid, gid, cwd, python, False, pyargs, env)
    os.close(go_r)
    os.close(err_w)
    report('pid %d' % pid)
    os.write(go_w, b'g')
    os.close(go_w)
    failed = b''
    while True:
        b = os.read(err_r, 512)
        if not b:
            break
        failed += b
    if not failed:
        report('ready')
    _, status = os.waitpid(pid, 0)
    if failed:
        report('error %s' % failed.decode(errors='replace').replace('\n', ' '))
        os._exit(125)
    report('status %d' % status)
    os.close(3)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP need no reset
        os.kill(os.getpid(), sig)
        os._exit(125)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 125)


# Mode 'init': the container init of a session with a live interpreter
# (interpreter.go). It is the sandbox's first process, as root with the
# interpreter launcher's capabilities, and the only one holding the host's
# pipes (its stdin, stdout and stderr, which runsc donates again on each
# restore of a checkpoint, so that the session survives one). It starts
# each interpreter itself, as launch() starts a run: a child
# that is the init of a PID namespace of its own (gVisor's unshare gives
# each call a new namespace for the next child), with fds 0, 1, 2 and 4
# pipes of this process's (the runs, stdout, stderr, the records), and it
# relays between those pipes and the host's.
#
# From the host, on stdin: frames of kind (1 byte), length (4 bytes,
# big-endian) and payload: b'S' starts an interpreter (none may run), b'D'
# is bytes for the interpreter's stdin (dropped when none runs), b'P' asks
# for a b'P' back, whose payload is the pid of the interpreter this
# process has not yet reported ended with b'z' (empty when none). To the host, on stdout: frames of kind (1 byte), length
# (2 bytes, big-endian) and payload, at most PIPE_BUF bytes in all, so that
# each write is atomic and a checkpoint never splits one: b'R' once this
# process is ready, b'o', b'e' and b'r' what the interpreter wrote on its
# stdout, stderr and records, b'c' one report line (pid, ready, status,
# error, as launch() reports them), b'z' once the interpreter has ended and every stream
# of it with it, after everything it wrote, and b'P'. Nothing the code
# writes can make a frame: the frames are this process's, the code's bytes
# only payloads.
MAX_OUT = 4096 - 3
K_OUT = {1: b'o', 2: b'e', 4: b'r'}


def send(kind, payload=b''):
    while True:
        n = min(len(payload), MAX_OUT)
        os.write(1, kind + n.to_bytes(2, 'big') + payload[:n])
        payload = payload[n:]
        if not payload:
            return


def spawn(args):
    prog, uid, gid, cwd, python, pyargs, env = args
    ends = [os.pipe() for _ in range(4)]  # runs, out, err, records
    go_r, go_w = os.pipe()
    err_r, err_w = os.pipe()
    mine = [ends[0][0], ends[1][1], ends[2][1], ends[3][1], go_r, err_w]
    try:
        check(libc.unshare(CLONE_NEWPID | CLONE_NEWIPC), 'unshare')
        pid = os.fork()
    except OSError as e:
        for fd in mine + [ends[0][1], ends[1][0], ends[2][0], ends[3][0], go_w, err_r]:
            os.close(fd)
        send(b'c', ('error %s' % e).encode()[:MAX_OUT])
        send(b'z')
        return None
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            null = os.open('/dev/null', os.O_RDONLY)
            # 0 runs, 1 out, 2 err, 3 a stand-in that child() closes, 4
            # records, 5 go, 6 the exec's error (close-on-exec).
            fds = [ends[0][0], ends[1][1], ends[2][1], null, ends[3][1], go_r, err_w]
            for i, fd in enumerate(fds):
                os.dup2(fd, 100 + i)
            for i in range(len(fds)):
                os.dup2(100 + i, i, inheritable=(i != 6))
            os.closerange(len(fds), 65536)
            child(5, 6, prog, uid, gid, cwd, python, True, pyargs, env)
        finally:
            os._exit(125)
    for fd in mine:
        os.close(fd)
    send(b'c', b'pid %d' % pid)
    os.write(go_w, b'g')
    os.close(go_w)
    reading = {ends[1][0]: 1, ends[2][0]: 2, ends[3][0]: 4, err_r: 0}
    for fd in reading:
        os.set_blocking(fd, False)
    os.set_blocking(ends[0][1], False)
    return {'pid': pid, 'stdin': ends[0][1], 'reading': reading, 'pending': bytearray(),
            'failed': b'', 'status': None}


def reap(gen):
    """Takes the interpreter's status once it has ended; True once it and
    every stream of it have ended."""
    if gen['status'] is None:
        try:
            pid, status = os.waitpid(gen['pid'], os.WNOHANG)
        except ChildProcessError:
            pid, status = gen['pid'], 0xff00
        if pid == gen['pid']:
            gen['status'] = status
    if gen['status'] is None or gen['reading']:
        return False
    if gen['failed']:
        send(b'c', b'error ' + gen['failed'].replace(b'\n', b' ')[:MAX_OUT - 6])
    else:
        send(b'c', b'status %d' % gen['status'])
    os.close(gen['stdin'])
    send(b'z')
    return True


def serve(args):
    import resource
    import select
    # This process lives as long as the session: RLIMIT_CPU counts its
    # whole life, and the host's cgroup bounds the session instead.
    resource.setrlimit(RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    # SIGCHLD wakes the loop (an interpreter that closed its streams may
    # still run; its end is its status).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    os.set_blocking(0, False)
    gen = None
    inbuf = bytearray()  # bytearrays: taking from the front costs no copy
    send(b'R')
    while True:
        rd, wr = [0, wake_r], []
        if gen is not None:
            rd += list(gen['reading'])
            if gen['pending']:
                wr.append(gen['stdin'])
        rs, ws, _ = select.select(rd, wr, [])
        if gen is not None and gen['stdin'] in ws:
            try:
                n = os.write(gen['stdin'], memoryview(gen['pending'])[:1 << 16])
                del gen['pending'][:n]
            except BlockingIOError:
                pass
            except OSError:
                gen['pending'] = bytearray()
        for fd in rs:
            if fd == wake_r:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
                continue
            if fd == 0:
                try:
                    b = os.read(0, 1 << 16)
                except BlockingIOError:
                    continue
                if not b:
                    os._exit(0)  # the host is gone
                inbuf += b
                continue
            i = gen['reading'][fd]
            try:
                b = os.read(fd, MAX_OUT)
            except BlockingIOError:
                continue
            if b:
                if i == 0:
                    gen['failed'] += b[:512]
                else:
                    send(K_OUT[i], b)
                continue
            os.close(fd)
            del gen['reading'][fd]
            if i == 0 and not gen['failed']:
                send(b'c', b'ready')
        if gen is not None and reap(gen):
            gen = None
        while len(inbuf) >= 5:
            size = int.from_bytes(inbuf[1:5], 'big')
            if len(inbuf) < 5 + size:
                break
            kind, payload = bytes(inbuf[:1]), inbuf[5:5 + size]
            del inbuf[:5 + size]
            if kind == b'S' and gen is None:
                gen = spawn(args)
            elif kind == b'S':
                send(b'c', b'error an interpreter runs already')
            elif kind == b'D' and gen is not None:
                gen['pending'] += payload
            elif kind == b'P':
                send(b'P', b'%d' % gen['pid'] if gen is not None else b'')


main()
