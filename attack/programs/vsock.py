# vsock: create an AF_VSOCK socket. Creating it is the whole probe: vsock
# ports are not namespaced, so such a socket shares the host's port space and
# could dial the hypervisor. It is never bound, connected or written to.
import socket

AF_VSOCK = 40


def attack():
    for kind, kname in ((socket.SOCK_STREAM, "SOCK_STREAM"), (socket.SOCK_DGRAM, "SOCK_DGRAM")):
        try:
            s = socket.socket(AF_VSOCK, kind)
        except BaseException as e:
            fail(e, "socket(AF_VSOCK, %s)" % kname)
            continue
        s.close()
        succeed("socket(AF_VSOCK, %s) created (and closed, never connected)" % kname)
        return
    sys.exit(3)


main(attack)
