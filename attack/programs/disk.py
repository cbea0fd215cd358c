# disk: write one file of P["mib"] MiB, in the working directory or, failing
# that, in the other places a program can usually write to.


def attack():
    MiB = 1 << 20
    want = P["mib"] * MiB
    chunk = b"\xa5" * MiB
    dirs = []
    for d in (os.getcwd(), os.environ.get("TMPDIR"), "/tmp", "/var/tmp", "/dev/shm"):
        if d and d not in dirs:
            dirs.append(d)
    for d in dirs:
        path = os.path.join(d, "moat-disk-" + TAG)
        written = 0
        try:
            with open(path, "wb") as f:
                while written < want:
                    f.write(chunk)
                    written += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            size = os.path.getsize(path)
            if size == want:
                succeed("wrote %d MiB in %s" % (size // MiB, d))
                return
            report("short_file", "%s: size %d" % (d, size))
        except BaseException as e:
            fail(e, "%s after %d MiB" % (d, written // MiB))
        finally:
            try:
                os.unlink(path)
            except Exception:
                pass
    sys.exit(3)


main(attack)
