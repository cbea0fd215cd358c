# host_net: list the network interfaces this program can see and their
# hardware (MAC) addresses, through sysfs, /proc/net/dev and the interface
# ioctls on any socket it can get (a socketpair end will do: the kernel
# answers SIOCGIF* on every socket). The harness looks for a MAC address of
# one of the host's own interfaces.
import fcntl
import socket
import struct

SIOCGIFNAME = 0x8910
SIOCGIFCONF = 0x8912
SIOCGIFHWADDR = 0x8927


SHOWN = []


def show(how, name, mac):
    SHOWN.append(mac)
    sys.stdout.write("MOAT-IF %s %s %s\n" % (how, name, mac))
    sys.stdout.flush()


def fmt(b):
    return ":".join("%02x" % c for c in b[:6])


def sockets():
    # Every kind of socket that may serve for the ioctls.
    for how, make in (("socket(AF_INET)", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),
                      ("socket(AF_UNIX)", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)),
                      ("socketpair(AF_UNIX)", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0])):
        try:
            yield how, make()
        except BaseException as e:
            fail(e, how)


def ioctls(how, s):
    names = set()
    for index in range(1, 257):  # SIOCGIFNAME: index to name
        req = struct.pack("16si20x", b"", index)
        try:
            names.add(fcntl.ioctl(s.fileno(), SIOCGIFNAME, req)[:16].split(b"\0")[0].decode())
        except OSError:
            pass
    try:  # SIOCGIFCONF: the interfaces with an IPv4 address
        import array
        buf = array.array("B", b"\0" * 40 * 64)
        addr, _ = buf.buffer_info()
        n = struct.unpack("iL", fcntl.ioctl(s.fileno(), SIOCGIFCONF, struct.pack("iL", len(buf), addr)))[0]
        raw = buf.tobytes()[:n]
        for i in range(0, n, 40):
            names.add(raw[i:i + 16].split(b"\0")[0].decode())
    except OSError as e:
        fail(e, how + " SIOCGIFCONF")
    for name in sorted(names):
        try:
            r = fcntl.ioctl(s.fileno(), SIOCGIFHWADDR, struct.pack("16s24x", name.encode()))
            show(how + " SIOCGIFHWADDR", name, fmt(r[18:24]))
        except OSError as e:
            fail(e, how + " SIOCGIFHWADDR " + name)


def attack():
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            try:
                with open("/sys/class/net/%s/address" % name) as f:
                    show("sysfs", name, f.read().strip())
            except OSError:
                pass
    except BaseException as e:
        fail(e, "/sys/class/net")
    try:
        with open("/proc/net/dev") as f:
            names = [l.split(":")[0].strip() for l in f.readlines()[2:]]
        sys.stdout.write("MOAT-IFNAMES /proc/net/dev " + " ".join(names) + "\n")
    except BaseException as e:
        fail(e, "/proc/net/dev")
    for how, s in sockets():
        try:
            ioctls(how, s)
        finally:
            s.close()
    if not SHOWN:
        sys.exit(3)


main(attack)
