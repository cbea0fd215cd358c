# io_uring: call io_uring_setup, the door to a second system call interface
# (one that creates sockets, opens files and connects without the system
# calls a filter watches).
import ctypes
import platform

NR = {"x86_64": 425, "aarch64": 425, "arm64": 425}


def attack():
    nr = NR.get(platform.machine())
    if nr is None:
        report("not_implemented", "io_uring_setup: unknown machine " + platform.machine())
        sys.exit(3)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    p = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(ctypes.c_long(nr), ctypes.c_uint(4), p)
    if fd < 0:
        e = ctypes.get_errno()
        fail(OSError(e, os.strerror(e)), "io_uring_setup")
        sys.exit(3)
    succeed("io_uring_setup returned descriptor %d" % fd)
    os.close(fd)


main(attack)
