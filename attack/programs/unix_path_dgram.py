# unix_path_dgram: reach the harness's unix datagram socket at P["path"], in
# a directory any uid may enter and of mode 0777 itself, as /dev/log is, and
# send it the run's greeting.
import socket


def attack():
    if not reach_unix(P["path"], socket.SOCK_DGRAM, P["path"]):
        sys.exit(3)


main(attack)
