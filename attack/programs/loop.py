# loop: spin forever, ignoring every signal a sandbox might politely send.
# A child in a session of its own sleeps meanwhile, so that a sandbox that
# kills only the process group, or enforces only a CPU limit, leaves it
# behind for the harness to find.
import signal
import time


def attack():
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
              signal.SIGXCPU, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        try:
            signal.signal(s, signal.SIG_IGN)
        except Exception:
            pass
    try:
        pid = os.fork()
    except Exception as e:
        fail(e, "fork")
        pid = -1
    if pid == 0:
        try:
            os.setsid()
            time.sleep(P["linger"])
        finally:
            os._exit(0)
    while True:
        pass


main(attack)
