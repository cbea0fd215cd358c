# moat's driver of a session's live interpreter in a gVisor sandbox; see
# interpreter.go.
#
# Its stdin is moat's pipe of runs: a header b'R' + nonce (32 bytes) + code
# length (4 bytes, big-endian), then the code. fd 4 is its pipe of records
# to moat, one line each: b'H' once ready; after each run
# b'X' + nonce + b' <exit status> <streams marked>'. After a run it writes
# the nonce on fds 1 and 2, so that moat knows where the run's output ends.
#
# Nothing here is secret from the code, which runs in this same process:
# moat never trusts these records beyond "the run of this nonce says it
# ended" (see interpreter.go).
import os, sys, struct, traceback, linecache


def _moat_driver():
    runs = os.dup(0)
    rec = os.dup(4)  # not inherited by what the code starts
    os.close(4)
    nul = os.open('/dev/null', os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    sys.stdout.reconfigure(line_buffering=True)
    sys.path.insert(0, os.getcwd())
    out, err = sys.stdout, sys.stderr

    def readn(n):
        parts, got = [], 0
        while got < n:
            b = os.read(runs, min(n - got, 1 << 16))
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

    g = {'__name__': '__main__', '__builtins__': __builtins__}
    os.write(rec, b'H\n')
    n = 0
    while True:
        hdr = readn(37)
        if hdr[:1] != b'R':
            os._exit(0)
        nonce, size = hdr[1:33], struct.unpack('>I', hdr[33:])[0]
        src = readn(size)
        n += 1
        name = '<run %d>' % n
        status = 0
        try:
            try:
                text = src.decode('utf-8')
                linecache.cache[name] = (len(text), None, text.splitlines(True), name)
            except UnicodeDecodeError:
                pass
            exec(compile(src, name, 'exec'), g)
        except SystemExit as e:
            status = status_of(e.code)
        except BaseException:
            t, v, tb = sys.exc_info()
            try:
                traceback.print_exception(t, v, tb.tb_next)
            except BaseException:
                pass
            status = 1
        marked = ''
        for f in (sys.stdout, sys.stderr, out, err):
            try:
                f.flush()
            except BaseException:
                pass
        sys.stdout, sys.stderr = out, err
        for fd, c in ((1, 'o'), (2, 'e')):
            try:
                os.write(fd, nonce)
                marked += c
            except OSError:
                pass
        os.write(rec, b'\nX' + nonce + (' %d %s\n' % (status, marked)).encode())


_moat_driver()
