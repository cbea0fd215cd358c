"""Tests of moat_client against a real server.

The Go test TestPythonClient (server/client_test.go) installs the package
with pip into a venv of its own, starts the server on 127.0.0.1 and runs
these with that venv's Python and MOAT_URL, MOAT_TOKEN and
MOAT_OTHER_TOKEN set.
"""

import base64
import os
import time
import unittest

import moat_client
from moat_client import Client, Event, FileInfo, Level, MoatError, RunResult

URL = os.environ.get("MOAT_URL")


@unittest.skipUnless(URL, "MOAT_URL is not set: run through the Go test TestPythonClient")
class ClientTest(unittest.TestCase):
    def setUp(self):
        self.c = Client(URL, os.environ["MOAT_TOKEN"])
        self.other = Client(URL, os.environ["MOAT_OTHER_TOKEN"])

    def test_installed(self):
        # The package under test is the one pip installed, not the source.
        if os.environ.get("MOAT_CLIENT_INSTALLED"):
            self.assertIn("site-packages", moat_client.__file__)

    def test_run(self):
        r = self.c.run("import sys\nprint('hi')\nsys.exit(4)")
        self.assertIsInstance(r, RunResult)
        self.assertEqual(r.stdout, "hi\n")
        self.assertEqual(r.stdout_bytes, b"hi\n")
        self.assertEqual(r.exit_code, 4)
        self.assertFalse(r.ok)
        self.assertEqual(r.level, "subprocess")
        self.assertTrue(r.run_id.startswith("r_"), r.run_id)
        self.assertGreater(r.duration_ms, 0)
        self.assertEqual(r.raw["exit_code"], 4)

    def test_binary_output(self):
        r = self.c.run("import sys\nsys.stdout.buffer.write(bytes(range(256)))\nsys.stderr.buffer.write(b'\\xff\\xfe')")
        self.assertEqual(r.stdout_bytes, bytes(range(256)))
        self.assertEqual(r.stderr_bytes, b"\xff\xfe")
        self.assertIn("\ufffd", r.stdout)
        self.assertEqual(base64.b64decode(r.raw["stdout_b64"]), bytes(range(256)))
        streamed = b"".join(ev.data for ev in self.c.stream("import sys\nsys.stdout.buffer.write(bytes(range(256)))") if ev.name == "stdout")
        self.assertEqual(streamed, bytes(range(256)))

    def test_health(self):
        h = self.c.health()
        self.assertEqual(h.status, "ok")
        self.assertTrue(h.version)

    def test_levels(self):
        self.assertIn(Level(level="subprocess", default=True, sessions=True, suspend=True, suspend_memory=False,
                            raw={"level": "subprocess", "default": True, "sessions": True, "suspend": True, "suspend_memory": False}),
                      self.c.levels())

    def test_suspend_resume_snapshot(self):
        with self.c.session() as s:
            s.upload("kept.txt", "kept")
            self.assertEqual(s.suspend().state, "suspended")
            self.assertEqual(s.refresh().state, "suspended")
            # A run resumes it, and says so.
            r = s.run("print(open('kept.txt').read())")
            self.assertEqual(r.stdout, "kept\n")
            self.assertTrue(any("resumed" in n for n in r.notes), r)
            s.suspend()
            self.assertEqual(s.resume().state, "running")
            snap = s.snapshot("py")
            self.assertEqual((snap.name, snap.session), ("py", s.id))
            try:
                with self.c.session(from_snapshot=snap.id) as f:
                    f.upload("kept.txt", "fork")
                    self.assertEqual(s.download("kept.txt"), b"kept")
                self.assertIn(snap.id, [x.id for x in self.c.snapshots()])
                self.assertEqual(self.other.snapshots(), [])
            finally:
                self.c.delete_snapshot(snap.id)
            self.assertEqual(self.c.snapshots(), [])

    def test_session_files_and_state(self):
        with self.c.session(interpreter=True, ttl="5m") as s:
            s.run("x = 41\nopen('out.txt', 'w').write('written by code')")
            self.assertEqual(s.run("print(x + 1)").stdout, "42\n")
            s.upload("in/data.bin", b"\x00\x01binary\xff")
            self.assertEqual(s.run("print(open('in/data.bin','rb').read()[2:8])").stdout, "b'binary'\n")
            self.assertEqual(s.download("out.txt"), b"written by code")
            files = {f.name: f for f in s.files()}
            self.assertTrue({"out.txt", "in", "in/data.bin"} <= set(files), files)
            self.assertIsInstance(files["in"], FileInfo)
            self.assertEqual((files["in"].type, files["in"].is_dir), ("dir", True))
            self.assertEqual(files["in/data.bin"].type, "file")
            s.run("import os\nos.chmod('out.txt', 0o750)\nos.symlink('out.txt', 'link')")
            st = s.stat("out.txt")
            self.assertEqual((st.mode, st.perm, st.size), ("0750", 0o750, 15))
            self.assertEqual(s.stat("link").type, "symlink")
            with self.assertRaises(MoatError) as cm:
                s.download("in")
            self.assertEqual((cm.exception.status, cm.exception.code), (409, "is_a_directory"))
            s.mkdir("made/deep")
            s.rename("out.txt", "made/deep/moved.txt")
            self.assertEqual(s.download("made/deep/moved.txt"), b"written by code")
            s.rename("made/deep/moved.txt", "out.txt")
            s.remove("out.txt")
            with self.assertRaises(MoatError) as cm:
                s.download("out.txt")
            self.assertEqual((cm.exception.status, cm.exception.code), (404, "not_found"))
            self.assertIn(s.id, [x.id for x in self.c.sessions()])
            self.assertEqual(s.info.state, "running")
            self.assertTrue(s.info.interpreter)
            sid = s.id
        with self.assertRaises(MoatError) as cm:
            self.c.get_session(sid)
        self.assertEqual(cm.exception.status, 404)

    def test_other_token_sees_nothing(self):
        with self.c.session() as s:
            s.upload("secret", "mine")
            for call in (lambda: self.other.get_session(s.id),
                         lambda: self.other.get_session(s.id).download("secret")):
                with self.assertRaises(MoatError) as cm:
                    call()
                self.assertEqual(cm.exception.status, 404)
            self.assertNotIn(s.id, [x.id for x in self.other.sessions()])
            self.assertEqual(s.download("secret"), b"mine")

    def test_bad_token(self):
        with self.assertRaises(MoatError) as cm:
            Client(URL, "not-a-token-at-all-1234").run("print(1)")
        self.assertEqual((cm.exception.status, cm.exception.code), (401, "unauthorized"))

    def test_traversal_refused(self):
        with self.c.session() as s:
            for name in ("../escape", "/etc/passwd", "a/../../b"):
                with self.assertRaises(MoatError) as cm:
                    s.upload(name, "x")
                self.assertEqual(cm.exception.status, 400, name)
            self.assertEqual(s.files(), [])

    def test_stream(self):
        events = list(self.c.stream("import time\nprint('a', flush=True)\ntime.sleep(0.2)\nprint('b')"))
        self.assertEqual(events[0], Event("stdout", text="a\n", data=b"a\n"))
        self.assertEqual(events[-1].name, "result")
        self.assertEqual(events[-1].result.stdout, "a\nb\n")
        self.assertTrue(events[-1].result.run_id.startswith("r_"))

    def test_stream_closed_early_cancels(self):
        gen = self.c.stream("import time\nprint('start', flush=True)\ntime.sleep(60)")
        self.assertEqual(next(gen).text, "start\n")
        started = time.monotonic()
        gen.close()
        # Closing disconnects; the Go suite (TestStreaming) checks that the
        # run's processes end. Here: the client and server go on.
        self.assertEqual(self.c.run("print(2)").stdout, "2\n")
        self.assertLess(time.monotonic() - started, 30)



class RedirectTest(unittest.TestCase):
    """A redirect is refused, so the bearer token never follows it."""

    def test_token_does_not_follow_a_redirect(self):
        import http.server
        import threading

        seen = []

        class Sink(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(self.headers.get("Authorization"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        sink = http.server.HTTPServer(("127.0.0.1", 0), Sink)

        class Redirect(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(302)
                self.send_header("Location", "http://127.0.0.1:%d/stolen" % sink.server_port)
                self.end_headers()

            def log_message(self, *args):
                pass

        redirect = http.server.HTTPServer(("127.0.0.1", 0), Redirect)
        for srv in (sink, redirect):
            threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            c = Client("http://127.0.0.1:%d" % redirect.server_port, "secret-token")
            with self.assertRaises(MoatError) as ctx:
                c.levels()
            self.assertEqual(ctx.exception.status, 302)
            self.assertEqual(seen, [])
        finally:
            for srv in (sink, redirect):
                srv.shutdown()
                srv.server_close()


if __name__ == "__main__":
    unittest.main()
