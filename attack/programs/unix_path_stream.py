# unix_path_stream: reach the harness's unix stream socket at P["path"], in a
# directory any uid may enter and of mode 0777 itself, as a host daemon's
# socket is, and send it the run's greeting.
import socket


def attack():
    if not reach_unix(P["path"], socket.SOCK_STREAM, P["path"]):
        sys.exit(3)


main(attack)
