# moat's driver of a session's live interpreter; see interpreter.go.
#
# It takes the control socket (SOCK_SEQPACKET: one message per record) on
# fd 0 and puts /dev/null in its place. Records from moat: a header
# b'R' + nonce (32 bytes) + code length (4 bytes, big-endian), then the code
# in records of at most 32 KiB. Records to moat: b'H' once ready; after each
# run b'X' + nonce + b'<exit status> <streams marked>'. After a run it writes
# the nonce on fds 1 and 2, so that moat knows where the run's output ends.
#
# Nothing here is secret from the code, which runs in this same process:
# moat never trusts these records beyond "the run of this nonce says it
# ended" (see interpreter.go).
#
# It imports nothing that python3 -I has not imported already (os and sys
# are site's): traceback and linecache, with what they pull in (re,
# tokenize, functools, enum, ...), cost about 1.3 MiB of every idle
# interpreter. A run's source still reaches linecache, so that tracebacks,
# the driver's and the code's own, show its lines: at once when linecache is
# loaded, and otherwise kept until it is, which an audit hook sees (the
# import of linecache, however it comes, imports it in the hook and hands it
# the sources first).
import os, sys


def _moat_driver():
    ctl = os.dup(0)
    nul = os.open('/dev/null', os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    sys.stdout.reconfigure(line_buffering=True)
    sys.path.insert(0, os.getcwd())
    out, err = sys.stdout, sys.stderr

    def recv():
        b = os.read(ctl, 1 << 16)
        if not b:
            os._exit(0)
        return b

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
    # The runs' sources, by name, not yet in linecache.cache; loaded[0]
    # once linecache is loaded (or being loaded by the hook).
    pending = {}
    loaded = [False]

    def sources():
        try:
            cache = sys.modules['linecache'].cache
        except BaseException:
            return
        loaded[0] = True
        try:
            for name, text in pending.items():
                cache[name] = (len(text), None, text.splitlines(True), name)
        except BaseException:
            pass
        pending.clear()

    def on_import(event, args):
        if loaded[0] or event != 'import' or args[0] != 'linecache':
            return
        loaded[0] = True
        try:
            import linecache
        except BaseException:
            loaded[0] = False
            return
        sources()

    sys.addaudithook(on_import)
    os.write(ctl, b'H')
    n = 0
    while True:
        hdr = recv()
        if len(hdr) != 37 or hdr[:1] != b'R':
            os._exit(0)
        nonce, size = hdr[1:33], int.from_bytes(hdr[33:], 'big')
        parts, got = [], 0
        while got < size:
            b = recv()
            parts.append(b)
            got += len(b)
        src = b''.join(parts)
        del parts
        n += 1
        name = '<run %d>' % n
        status = 0
        try:
            try:
                pending[name] = src.decode('utf-8')
                sources()
            except UnicodeDecodeError:
                pass
            exec(compile(src, name, 'exec'), g)
        except SystemExit as e:
            status = status_of(e.code)
        except BaseException:
            t, v, tb = sys.exc_info()
            try:
                import traceback
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
        os.write(ctl, b'X' + nonce + ('%d %s' % (status, marked)).encode())


_moat_driver()
