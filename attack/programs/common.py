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
