# abstract_unix: reach the abstract unix name P["name"] the harness listens
# on, datagram and stream, in the host's network namespace, and send it the
# run's greeting.
import socket


def attack():
    addr = "\0" + P["name"]
    sent = reach_unix(addr, socket.SOCK_DGRAM, "@" + P["name"])
    sent += reach_unix(addr, socket.SOCK_STREAM, "@" + P["name"])
    if not sent:
        sys.exit(3)


main(attack)
