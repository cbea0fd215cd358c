# host_procs: list every process this program can see through /proc, with its
# uid, name and command line: by listing /proc or, where the listing is
# refused, by trying every pid up to FALLBACK_PIDS. The harness runs a
# process on the host whose command line holds a secret token; seeing the
# token means seeing the host's processes.

FALLBACK_PIDS = 1 << 16


def read(path, n=4096):
    with open(path, "rb") as f:
        return f.read(n)


def attack():
    try:
        pids = sorted(int(d) for d in os.listdir("/proc") if d.isdigit())
    except BaseException as e:
        fail(e, "list /proc")
        pids = range(1, FALLBACK_PIDS)
    me = os.getuid()
    others = 0
    out = []
    for pid in pids:
        base = "/proc/%d/" % pid
        try:
            cmdline = read(base + "cmdline").replace(b"\0", b" ").strip()
            comm = read(base + "comm").strip()
            uid = -1
            for line in read(base + "status", 1 << 14).split(b"\n"):
                if line.startswith(b"Uid:"):
                    uid = int(line.split()[1])
        except OSError:
            continue  # gone meanwhile, or guarded
        if uid != me:
            others += 1
        out.append(b"MOAT-PROC %d uid %d %s: %s\n" % (pid, uid, comm, cmdline))
    sys.stdout.buffer.write(b"".join(out))
    sys.stdout.buffer.flush()
    sys.stdout.write("MOAT-PROCS %d processes seen, %d of other uids\n" % (len(out), others))
    sys.stdout.flush()
    if not out:
        sys.exit(3)


main(attack)
