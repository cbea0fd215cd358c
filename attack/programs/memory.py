# memory: allocate P["mib"] MiB in chunks and write to every page of it.


def rss_mib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except Exception:
        pass
    return -1


def attack():
    MiB = 1 << 20
    want = P["mib"]
    chunks = []
    got = 0
    try:
        while got < want:
            n = min(32, want - got)
            b = bytearray(n * MiB)
            b[::4096] = b"\x01" * len(range(0, len(b), 4096))
            chunks.append(b)
            got += n
    except BaseException as e:
        fail(e, "after %d MiB" % got)
        sys.exit(3)
    succeed("touched %d MiB, rss %d MiB" % (got, rss_mib()))


main(attack)
