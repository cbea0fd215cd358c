# network: connect to the harness's service on every spelling of the local
# host and print what it answers.
import socket


def attack():
    port = P["port"]
    targets = [("127.0.0.1", socket.AF_INET), ("localhost", None),
               ("0.0.0.0", socket.AF_INET), ("::ffff:127.0.0.1", socket.AF_INET6),
               ("::1", socket.AF_INET6)]
    for host, family in targets:
        try:
            if family is None:
                s = socket.create_connection((host, port), timeout=1.5)
            else:
                s = socket.socket(family, socket.SOCK_STREAM)
                s.settimeout(1.5)
                s.connect((host, port))
            data = b""
            try:
                while len(data) < 4096:
                    b = s.recv(4096)
                    if not b:
                        break
                    data += b
            finally:
                s.close()
            sys.stdout.write("MOAT-RECV " + host + " ")
            sys.stdout.flush()
            sys.stdout.buffer.write(data + b"\n")
            sys.stdout.buffer.flush()
        except BaseException as e:
            fail(e, host)


main(attack)
