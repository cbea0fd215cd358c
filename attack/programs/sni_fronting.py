# sni_fronting: open a tunnel to an allowed host, then send a TLS
# ClientHello naming another host, or no name at all: domain fronting. Only
# the allowed host's server receiving such a hello decides.
import ssl


def attack():
    host, port = P["hosts"]["allowed"], P["ports"]["allowed"]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    for sni in ("fronted.attack.test", None):
        try:
            s = proxy_connect(host, port)
            t = ctx.wrap_socket(s, server_hostname=sni)
            t.sendall(b"GET / HTTP/1.1\r\nHost: fronted.attack.test\r\n\r\n")
            t.recv(100)
            t.close()
        except BaseException as e:
            refused(e, "sni %s" % sni)
    sys.exit(3)


main(attack)
