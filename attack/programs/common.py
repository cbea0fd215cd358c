# Shared helpers of moat's attack programs. The harness puts one line before
# this file; it defines P, the run's parameters decoded from a hex-encoded
# JSON object, and prints the start marker. Every marker is assembled here at
# run time from pieces and the run's nonce, so that no line of this source
# (which a traceback may echo) contains one.
import errno
import os
import sys

TAG = P["tag"]

CLASSES = {
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.ENOENT: "file_not_found",
    errno.ENETUNREACH: "network_unreachable",
    errno.EHOSTUNREACH: "host_unreachable",
    errno.EAFNOSUPPORT: "address_family_not_supported",
    errno.EPROTONOSUPPORT: "address_family_not_supported",
    errno.ECONNREFUSED: "connection_refused",
    errno.ETIMEDOUT: "timed_out",
    errno.EADDRNOTAVAIL: "address_not_available",
    errno.ENOMEM: "out_of_memory",
    errno.EAGAIN: "resource_unavailable",
    errno.EFBIG: "file_too_large",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "quota_exceeded",
    errno.EROFS: "read_only",
    errno.ENOSYS: "not_implemented",
    errno.EMFILE: "too_many_files",
    errno.ENFILE: "too_many_files",
}


def emit(kind, text):
    line = "MOAT" + "-" + kind + ":" + P["nonce"]
    if text:
        line += " " + text
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def name_self():
    # Give this process the run's tag as its name, so that the harness can
    # find it from the host if the sandbox leaves it running: through /proc,
    # or, where the sandbox hides or guards /proc, through prctl.
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(TAG)
        return
    except Exception:
        pass
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(TAG.encode()), 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def classify(e):
    if isinstance(e, MemoryError):
        return "out_of_memory"
    if type(e).__name__ == "gaierror":
        return "name_resolution"
    if isinstance(e, TimeoutError) and not e.errno:
        return "timed_out"
    if isinstance(e, OSError):
        if e.errno in CLASSES:
            return CLASSES[e.errno]
        if e.errno:
            return errno.errorcode.get(e.errno, "errno_%d" % e.errno).lower()
        return "os_error"
    return "exception"


def report(cls, where, e=None):
    # MOAT-ERR:<nonce> <class> <where>: <exception>, on one line.
    text = where
    if e is not None:
        text += ": " + type(e).__name__ + ": " + str(e)
    emit("ERR", cls + " " + " ".join(text.split())[:300])


def fail(e, where):
    report(classify(e), where, e)


def succeed(what):
    emit("OK", what)


def main(attack):
    name_self()
    try:
        attack()
    except SystemExit:
        raise
    except BaseException as e:
        fail(e, "probe")
        sys.exit(3)
    emit("DONE", "")


# Helpers of the probes that reach unix sockets.

def greeting(way):
    # What a program sends to the harness's sockets: the run's nonce behind
    # a prefix, assembled here, and the way it took. Only the host side
    # decides that it arrived.
    return ("MOAT" + "-" + "HELLO:" + P["nonce"] + " " + way + "\n").encode()


def raise_errno(what):
    import ctypes
    e = ctypes.get_errno()
    raise OSError(e, os.strerror(e) + " (" + what + ")")


def dissolve(s):
    # connect(fd, {AF_UNSPEC}): dissolves a datagram socket's association,
    # a socketpair end's included, leaving a socket that can be re-aimed
    # with connect or bound to a name. Python's connect cannot say AF_UNSPEC.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    sa = ctypes.create_string_buffer(16)  # sa_family 0 = AF_UNSPEC
    if libc.connect(s.fileno(), sa, 16) != 0:
        raise_errno("connect(AF_UNSPEC)")


def reach_unix(addr, kind, label):
    # Send the greeting to the unix socket addr (a path, or "\0" + an
    # abstract name) of type kind by every means a program has: a socket of
    # its own, and a socketpair end re-aimed with sendto or, after
    # connect(AF_UNSPEC), with connect. Each way that fails is reported; a
    # way that seems to work is only printed (the harness judges by what
    # its socket received) and counted: reach_unix returns how many did.
    import socket
    stream = kind == socket.SOCK_STREAM
    kname = "SOCK_STREAM" if stream else "SOCK_DGRAM"

    def own_connect():
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.settimeout(2)
            s.connect(addr)
            s.sendall(greeting("own_connect"))
        finally:
            s.close()

    def own_sendto():
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.sendto(greeting("own_sendto"), addr)
        finally:
            s.close()

    def pair_sendto():
        a, b = socket.socketpair(socket.AF_UNIX, kind)
        try:
            a.sendto(greeting("pair_sendto"), addr)
        finally:
            a.close()
            b.close()

    def pair_reconnect():
        a, b = socket.socketpair(socket.AF_UNIX, kind)
        try:
            dissolve(a)
            a.settimeout(2)
            a.connect(addr)
            a.sendall(greeting("pair_reconnect"))
        finally:
            a.close()
            b.close()

    ways = [("own_connect: socket(AF_UNIX, %s) connect" % kname, own_connect)]
    if not stream:
        ways.append(("own_sendto: socket(AF_UNIX, %s) sendto" % kname, own_sendto))
    ways += [("pair_sendto: socketpair(AF_UNIX, %s) sendto" % kname, pair_sendto),
             ("pair_reconnect: socketpair(AF_UNIX, %s) connect(AF_UNSPEC) then connect" % kname, pair_reconnect)]
    sent = 0
    for how, way in ways:
        where = how + " " + label
        try:
            way()
            sys.stdout.write("MOAT-SENT " + where + "\n")
            sys.stdout.flush()
            sent += 1
        except BaseException as e:
            fail(e, where)
    return sent


# Helpers of the egress probes: the proxy is what the sandbox's environment
# names, whichever level runs the program.

class Refused(Exception):
    pass


def proxy_addr():
    import urllib.parse
    url = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or os.environ.get("HTTP_PROXY")
    if not url:
        raise Refused("no proxy in the environment")
    u = urllib.parse.urlsplit(url)
    return u.hostname, u.port or 80


def proxy_request(head, timeout=3):
    # Sends one request head to the proxy and returns the socket and the
    # status line's code and what came with it.
    import socket
    host, port = proxy_addr()
    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall(head.encode())
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        b = s.recv(4096)
        if not b:
            break
        data += b
    line = data.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    code = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return s, code, data


def proxy_connect(host, port, timeout=3):
    s, code, data = proxy_request("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host, port, host, port), timeout)
    if code != 200:
        s.close()
        raise Refused("CONNECT %s:%d: %s" % (host, port, data.split(b"\r\n", 1)[0].decode("latin-1")))
    return s


def proxy_get(url, headers=None, timeout=3):
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    head = "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n" % (url, u.netloc)
    for k, v in (headers or {}).items():
        head += "%s: %s\r\n" % (k, v)
    s, code, data = proxy_request(head + "\r\n", timeout)
    try:
        while len(data) < 1 << 20:
            b = s.recv(65536)
            if not b:
                break
            data += b
    finally:
        s.close()
    if code != 200:
        raise Refused("GET %s: %s" % (url, data.split(b"\r\n", 1)[0].decode("latin-1")))
    return data


def refused(e, where):
    if isinstance(e, Refused):
        report("refused", where, e)
    else:
        fail(e, where)
