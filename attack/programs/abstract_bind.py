# abstract_bind: bind abstract unix names in whatever network namespace the
# program is in, by every way it has (a socket of its own, a socketpair end
# with or without connect(AF_UNSPEC) first), each way its own name: P["name"],
# a dash and the way. It holds them all P["hold"] seconds; the harness looks
# for them in the host's network namespace meanwhile.
import socket
import time


def attack():
    keep = []

    def own(kind):
        return lambda: socket.socket(socket.AF_UNIX, kind)

    def pair(kind, unspec):
        def make():
            a, b = socket.socketpair(socket.AF_UNIX, kind)
            keep.append(b)
            if unspec:
                dissolve(a)
            return a
        return make

    ways = [("own_dgram", "socket(AF_UNIX, SOCK_DGRAM)", own(socket.SOCK_DGRAM)),
            ("own_stream", "socket(AF_UNIX, SOCK_STREAM)", own(socket.SOCK_STREAM)),
            ("pair_dgram_unspec", "socketpair(AF_UNIX, SOCK_DGRAM) end after connect(AF_UNSPEC)",
             pair(socket.SOCK_DGRAM, True)),
            ("pair_dgram", "socketpair(AF_UNIX, SOCK_DGRAM) end", pair(socket.SOCK_DGRAM, False)),
            ("pair_stream", "socketpair(AF_UNIX, SOCK_STREAM) end", pair(socket.SOCK_STREAM, False))]
    bound = 0
    for way, how, make in ways:
        name = P["name"] + "-" + way
        try:
            s = make()
            keep.append(s)
            s.bind("\0" + name)
        except BaseException as e:
            fail(e, "bind @" + name + " on " + how)
            continue
        bound += 1
        sys.stdout.write("MOAT-BOUND @" + name + " on " + how + "\n")
        sys.stdout.flush()
    if bound:
        time.sleep(P["hold"])
    for s in keep:
        s.close()
    if not bound:
        sys.exit(3)


main(attack)
