# moat's driver of a container session's live interpreter; see
# interpreter.go.
#
# It reads runs from its stdin, which only moat writes: b'R', a nonce (32
# bytes), the code's length (4 bytes, big-endian), the code. It puts
# /dev/null in place of fd 0, runs each code with exec() in one persistent
# globals dictionary, and after each run writes on its own copies of fds 1
# and 2 the end marker: b'\0MOAT' + nonce, followed on fd 1 by
# b' <exit status>\n'. Nothing here is secret from the code, which runs in
# this same process: moat takes from the markers only what the code could
# decide anyway (see interpreter.go).
import os, sys, struct, traceback, linecache


def _moat_driver():
    ctl = os.dup(0)
    nul = os.open('/dev/null', os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    mark_out, mark_err = os.dup(1), os.dup(2)
    for fd in (ctl, mark_out, mark_err):
        os.set_inheritable(fd, False)
    sys.path.insert(0, os.getcwd())
    out, err = sys.stdout, sys.stderr

    def recv(n):
        parts, got = [], 0
        while got < n:
            b = os.read(ctl, min(n - got, 1 << 20))
            if not b:
                os._exit(0)
            parts.append(b)
            got += len(b)
        return b''.join(parts)

    def status_of(code):
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xff
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        return 1

    def write_all(fd, b):
        while b:
            b = b[os.write(fd, b):]

    g = {'__name__': '__main__', '__builtins__': __builtins__}
    n = 0
    while True:
        hdr = recv(37)
        if hdr[:1] != b'R':
            os._exit(0)
        nonce, size = hdr[1:33], struct.unpack('>I', hdr[33:])[0]
        src = recv(size)
        code = None
        n += 1
        name = '<run %d>' % n
        status = 0
        try:
            try:
                text = src.decode('utf-8')
                linecache.cache[name] = (len(text), None, text.splitlines(True), name)
            except UnicodeDecodeError:
                pass
            code = compile(src, name, 'exec')
            src = text = None
            exec(code, g)
        except SystemExit as e:
            status = status_of(e.code)
        except BaseException:
            t, v, tb = sys.exc_info()
            try:
                traceback.print_exception(t, v, tb.tb_next)
            except BaseException:
                pass
            status = 1
        for f in (sys.stdout, sys.stderr, out, err):
            try:
                f.flush()
            except BaseException:
                pass
        sys.stdout, sys.stderr = out, err
        write_all(mark_out, b'\0MOAT' + nonce + b' %d\n' % status)
        write_all(mark_err, b'\0MOAT' + nonce)


_moat_driver()
