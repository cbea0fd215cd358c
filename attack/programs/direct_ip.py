# direct_ip: reach a harness listener that no policy allows: straight to
# its address on every spelling of the loopback, through the proxy by
# address, and by an allowed name on the listener's port, which the policy
# does not allow. Only the listener accepting a connection decides.
import socket


def attack():
    port = P["ports"]["ip"]
    for host, family in (("127.0.0.1", socket.AF_INET), ("::ffff:127.0.0.1", socket.AF_INET6), ("::1", socket.AF_INET6)):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.settimeout(1.5)
            s.connect((host, port))
            s.close()
        except BaseException as e:
            fail(e, "direct %s" % host)
    for target in ("127.0.0.1", "[::ffff:127.0.0.1]", "2130706433", "localhost", P["hosts"]["allowed"]):
        try:
            proxy_connect(target, port).close()
        except BaseException as e:
            refused(e, "proxy CONNECT %s" % target)
        try:
            proxy_get("http://%s:%d/" % (target, port))
        except BaseException as e:
            refused(e, "proxy GET %s" % target)
    sys.exit(3)


main(attack)
