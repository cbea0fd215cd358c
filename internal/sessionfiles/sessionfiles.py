# sessionfiles: one file operation on a session's working directory, run
# inside the sandbox instance as the session's uid by package sessionfiles.
#
#   python3 -I -S -B -c <this> <op> <workdir> <args...>
#
#   read   NAME LIMIT   header line, then exactly "size" bytes, then a trailer line
#   write  NAME LIMIT   contents on stdin; one answer line
#   list   CAP          one line per entry, then one answer line
#   stat   NAME         one answer line
#   mkdir  NAME         one answer line
#   rename FROM TO      one answer line
#   remove NAME         one answer line
#
# Every line is a JSON object: {"k":"ok"}, {"k":"err","e":"ENOENT"},
# {"k":"file","size":N}, {"k":"entry","n":NAME,"s":SIZE,"m":MODE,"t":MTIME_NS}.
# A listing leaves out names that are not UTF-8. The process exits 0 once it
# has answered.
#
# Every name is resolved one component at a time from a descriptor of the
# working directory (itself opened from "/" the same way), with O_NOFOLLOW:
# no symbolic link is ever followed, wherever it points. The Go side checks
# names before sending them and never trusts what comes back.

import errno
import os
import stat
import sys

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CHUNK = 1 << 20
MAX_NAME = 4096


class Refused(Exception):
    """An answer other than an errno: e is one of the names the Go side knows."""

    def __init__(self, e):
        Exception.__init__(self, e)
        self.e = e


def writeall(data):
    view = memoryview(data)
    while view:
        n = os.write(1, view)
        view = view[n:]


# JSON by hand: importing json costs more than the rest of a run.
ESCAPES = {c: "\\u%04x" % c for c in range(0x20)}
ESCAPES[ord('"')] = '\\"'
ESCAPES[ord("\\")] = "\\\\"


def answer(obj):
    fields = []
    for k, v in obj.items():
        if isinstance(v, str):
            v = '"' + v.translate(ESCAPES) + '"'
        else:
            v = str(int(v))
        fields.append('"%s":%s' % (k, v))
    writeall(("{" + ",".join(fields) + "}\n").encode("utf-8"))


def parts(name):
    if not name or len(name) > MAX_NAME or "\0" in name:
        raise Refused("BADNAME")
    ps = name.split("/")
    for p in ps:
        if p in ("", ".", ".."):
            raise Refused("BADNAME")
    return ps


def open_workdir(path):
    if not path.startswith("/"):
        raise Refused("BADNAME")
    fd = os.open("/", DIR_FLAGS)
    for p in path.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            os.close(fd)
            raise Refused("BADNAME")
        try:
            nfd = os.open(p, DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nfd
    return fd


def open_parent(root, ps, create=False):
    """A descriptor of the directory holding ps[-1], walked from root."""
    fd = os.dup(root)
    for p in ps[:-1]:
        try:
            try:
                nfd = os.open(p, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(p, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(p, DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nfd
    return fd


def op_read(root, name, limit):
    ps = parts(name)
    pfd = open_parent(root, ps)
    try:
        st = os.stat(ps[-1], dir_fd=pfd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "symbolic link")
        if stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EISDIR, "directory")
        if not stat.S_ISREG(st.st_mode):
            raise Refused("NOTREG")
        # O_NONBLOCK: a FIFO swapped in since the stat must not block.
        fd = os.open(ps[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=pfd)
    finally:
        os.close(pfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("NOTREG")
        size = st.st_size
        if size > limit:
            raise Refused("TOOBIG")
        answer({"k": "file", "size": size})
        # From here on every answer is the trailer, after exactly size bytes.
        left = size
        try:
            while left > 0:
                b = os.read(fd, min(CHUNK, left))
                if not b:
                    break
                writeall(b)
                left -= len(b)
        except OSError as e:
            writeall(b"\0" * left)
            answer({"k": "err", "e": errno.errorcode.get(e.errno, "EIO")})
            return
        if left > 0:
            writeall(b"\0" * left)
            answer({"k": "err", "e": "SHRANK"})
            return
        answer({"k": "ok"})
    finally:
        os.close(fd)


def op_write(root, name, limit):
    ps = parts(name)
    pfd = open_parent(root, ps, create=True)
    try:
        try:
            st = os.stat(ps[-1], dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise OSError(errno.EISDIR, "directory")
        except FileNotFoundError:
            pass
        tmp = ".moat-upload-" + os.urandom(6).hex()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=pfd)
        done = False
        try:
            n = 0
            while True:
                b = os.read(0, CHUNK)
                if not b:
                    break
                n += len(b)
                if n > limit:
                    raise Refused("TOOBIG")
                view = memoryview(b)
                while view:
                    view = view[os.write(fd, view):]
            os.close(fd)
            fd = -1
            os.rename(tmp, ps[-1], src_dir_fd=pfd, dst_dir_fd=pfd)
            done = True
        finally:
            if fd >= 0:
                os.close(fd)
            if not done:
                try:
                    os.unlink(tmp, dir_fd=pfd)
                except OSError:
                    pass
    finally:
        os.close(pfd)
    answer({"k": "ok"})


def entry(name, st):
    return {"k": "entry", "n": name, "s": st.st_size, "m": st.st_mode, "t": st.st_mtime_ns}


def utf8_names(fd):
    """The names in directory fd that are UTF-8, in reverse byte order.

    A name that is not UTF-8 is left out: no other operation could name it.
    """
    out = []
    for n in os.listdir(fd):
        try:
            out.append((n.encode("utf-8"), n))
        except UnicodeEncodeError:
            continue
    out.sort(reverse=True)  # popped from the end: first name last
    return [n for _, n in out]


def op_list(root, cap):
    count = 0
    # A stack of (descriptor, prefix, names left): depth-first, in name order,
    # as Go's fs.WalkDir lists.
    stack = [(os.dup(root), "", utf8_names(root))]
    try:
        while stack:
            fd, prefix, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            n = names.pop()
            path = prefix + n
            if len(path.encode("utf-8")) > MAX_NAME:
                raise OSError(errno.ENAMETOOLONG, "name too long")
            try:
                st = os.stat(n, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since the listing
            count += 1
            if count > cap:
                raise Refused("TOOMANY")
            answer(entry(path, st))
            if stat.S_ISDIR(st.st_mode):
                try:
                    cfd = os.open(n, DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        continue  # replaced since the stat
                    raise
                try:
                    sub = utf8_names(cfd)
                except BaseException:
                    os.close(cfd)
                    raise
                stack.append((cfd, path + "/", sub))
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    answer({"k": "ok"})


def op_stat(root, name):
    ps = parts(name)
    pfd = open_parent(root, ps)
    try:
        st = os.stat(ps[-1], dir_fd=pfd, follow_symlinks=False)
    finally:
        os.close(pfd)
    answer(entry("", st))


def op_mkdir(root, name):
    ps = parts(name)
    pfd = open_parent(root, ps, create=True)
    try:
        try:
            os.mkdir(ps[-1], 0o755, dir_fd=pfd)
        except FileExistsError:
            st = os.stat(ps[-1], dir_fd=pfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise
    finally:
        os.close(pfd)
    answer({"k": "ok"})


def op_rename(root, src, dst):
    sps, dps = parts(src), parts(dst)
    sfd = open_parent(root, sps)
    try:
        dfd = open_parent(root, dps)
        try:
            os.rename(sps[-1], dps[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    answer({"k": "ok"})


def op_remove(root, name):
    ps = parts(name)
    pfd = open_parent(root, ps)
    try:
        try:
            os.unlink(ps[-1], dir_fd=pfd)
        except IsADirectoryError:
            os.rmdir(ps[-1], dir_fd=pfd)
    finally:
        os.close(pfd)
    answer({"k": "ok"})


OPS = {
    "read": (op_read, 2),
    "write": (op_write, 2),
    "list": (op_list, 1),
    "stat": (op_stat, 1),
    "mkdir": (op_mkdir, 1),
    "rename": (op_rename, 2),
    "remove": (op_remove, 1),
}


def main(argv):
    os.umask(0o022)
    if len(argv) < 2 or argv[0] not in OPS or len(argv) != 2 + OPS[argv[0]][1]:
        raise Refused("USAGE")
    fn, _ = OPS[argv[0]]
    args = list(argv[2:])
    if argv[0] in ("read", "write"):
        args[1] = int(args[1])
    elif argv[0] == "list":
        args[0] = int(args[0])
    root = open_workdir(argv[1])
    try:
        fn(root, *args)
    finally:
        os.close(root)


try:
    main(sys.argv[1:])
except Refused as r:
    answer({"k": "err", "e": r.e})
except OSError as e:
    answer({"k": "err", "e": errno.errorcode.get(e.errno, "EIO")})
except ValueError:
    answer({"k": "err", "e": "USAGE"})
