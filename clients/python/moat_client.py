"""A client for moat's HTTP API (`moat serve`), using only the standard library.

    from moat_client import Client

    c = Client("http://127.0.0.1:8080", token="...")
    print(c.run("print(1)")["stdout"])

    with c.session(interpreter=True) as s:
        s.run("x = 41")
        print(s.run("print(x + 1)")["stdout"])      # 42
        s.upload("data/in.csv", b"a,b\\n1,2\\n")
        print(s.download("data/in.csv"))
        s.suspend()                                   # on disk, nothing running
        snap = s.snapshot("before")
        for ev in s.stream("import time\\nfor i in range(3): print(i, flush=True); time.sleep(1)"):
            print(ev)                                 # ('stdout', '0\\n') ... ('result', {...})

Every error the server answers is raised as MoatError with its HTTP status,
its stable code (e.g. "not_found", "busy") and, for 429 and 503, the
Retry-After the server asked for.
"""

import json
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["Client", "Session", "MoatError"]


class MoatError(Exception):
    """An error answered by the server."""

    def __init__(self, status, code, message, retry_after=None):
        super().__init__("moat: %d %s: %s" % (status, code, message))
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """moat's server never redirects; following one would send the bearer
    token wherever a proxy or a forged response points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class Client:
    """A connection to one moat server with one bearer token."""

    def __init__(self, url, token, timeout=120):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_NoRedirect)

    # Transport.

    def _request(self, method, path, body=None, content_type=None, accept=None):
        headers = {"Authorization": "Bearer " + self.token}
        data = None
        if body is not None:
            if isinstance(body, (bytes, bytearray)):
                data = bytes(body)
                headers["Content-Type"] = content_type or "application/octet-stream"
            else:
                data = json.dumps(body).encode("utf-8")
                headers["Content-Type"] = "application/json"
        if accept:
            headers["Accept"] = accept
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            return self._opener.open(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise _error(e) from None

    def _json(self, method, path, body=None):
        with self._request(method, path, body) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    # The API.

    def levels(self):
        """The levels the server serves: [{level, default, sessions, suspend}]."""
        return self._json("GET", "/v1/levels")["levels"]

    def run(self, code, level=None):
        """Run code once; returns the result: level, stdout, stderr, exit_code,
        duration_ms, reason, truncated."""
        body = {"code": code}
        if level:
            body["level"] = level
        return self._json("POST", "/v1/runs", body)

    def stream(self, code, level=None):
        """Run code once, yielding ('stdout', text) and ('stderr', text) as the
        code writes, then ('result', result). Closing the generator early
        disconnects, which cancels the run."""
        body = {"code": code, "stream": True}
        if level:
            body["level"] = level
        return _events(self._request("POST", "/v1/runs", body, accept="text/event-stream"))

    def create_session(self, level=None, ttl=None, idle_timeout=None, interpreter=False, from_snapshot=None):
        """Create a session; ttl and idle_timeout are strings like "30m".
        from_snapshot (a snapshot's id) starts it from that snapshot: a fork,
        with the snapshot's level and interpreter."""
        body = {"interpreter": bool(interpreter)}
        if from_snapshot:
            body = {"from_snapshot": from_snapshot}  # the snapshot's interpreter
        if level:
            body["level"] = level
        if ttl:
            body["ttl"] = ttl
        if idle_timeout:
            body["idle_timeout"] = idle_timeout
        return Session(self, self._json("POST", "/v1/sessions", body))

    session = create_session

    def sessions(self):
        """This token's sessions, as dicts."""
        return self._json("GET", "/v1/sessions")["sessions"]

    def get_session(self, session_id):
        return Session(self, self._json("GET", "/v1/sessions/" + _seg(session_id)))

    def snapshots(self):
        """This token's snapshots: {snapshots: [...], bytes, quota_bytes}."""
        return self._json("GET", "/v1/snapshots")

    def delete_snapshot(self, snapshot_id):
        self._json("DELETE", "/v1/snapshots/" + _seg(snapshot_id))


class Session:
    """A session: files and, when asked for, a live interpreter, kept
    between runs. Use it as a context manager to delete it at the end."""

    def __init__(self, client, info):
        self.client = client
        self.info = info
        self.id = info["id"]
        self._base = "/v1/sessions/" + _seg(self.id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.delete()
        except MoatError as e:
            if e.status != 404:
                raise

    def refresh(self):
        self.info = self.client._json("GET", self._base)
        return self.info

    def run(self, code):
        return self.client._json("POST", self._base + "/runs", {"code": code})

    def stream(self, code):
        return _events(self.client._request("POST", self._base + "/runs", {"code": code, "stream": True}, accept="text/event-stream"))

    def files(self):
        """The session's files: [{name, size, mode, mod_time, is_dir}]."""
        return self.client._json("GET", self._base + "/files")["files"]

    def upload(self, name, data):
        if isinstance(data, str):
            data = data.encode("utf-8")
        self.client._json("PUT", self._base + "/files/" + _path(name), bytes(data))

    def download(self, name):
        with self.client._request("GET", self._base + "/files/" + _path(name)) as resp:
            return resp.read()

    def remove(self, name):
        self.client._json("DELETE", self._base + "/files/" + _path(name))

    def suspend(self):
        """Suspend the session: its state kept on disk, nothing of it
        running. Its next run or file operation resumes it. Returns the
        session's view: state "suspended", memory (whether the
        interpreter's variables come back)."""
        self.info = self.client._json("POST", self._base + "/suspend")
        return self.info

    def resume(self):
        """Resume a suspended session; the view's notes say what came back."""
        self.info = self.client._json("POST", self._base + "/resume")
        return self.info

    def snapshot(self, name):
        """Take a named snapshot; create_session(from_snapshot=...) forks it."""
        return self.client._json("POST", self._base + "/snapshots", {"name": name})

    def delete(self):
        self.client._json("DELETE", self._base)


def _seg(s):
    return urllib.parse.quote(s, safe="")


def _path(name):
    # Each element is escaped, the slashes between them kept. The server
    # refuses "..", "." and absolute names however they are spelled.
    return "/".join(urllib.parse.quote(p, safe="") for p in name.split("/"))


def _error(e):
    try:
        body = json.loads(e.read() or b"{}")
        err = body.get("error", {})
        code, message = err.get("code", "unknown"), err.get("message", "")
    except ValueError:
        code, message = "unknown", ""
    ra = e.headers.get("Retry-After")
    return MoatError(e.code, code, message, int(ra) if ra and ra.isdigit() else None)


def _events(resp):
    """Parse server-sent events from resp, yielding (name, data)."""
    try:
        name, data = None, []
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line == "":
                if name is not None:
                    payload = json.loads("\n".join(data))
                    if name in ("stdout", "stderr"):
                        yield name, payload["data"]
                    elif name == "error":
                        err = payload.get("error", {})
                        raise MoatError(200, err.get("code", "unknown"), err.get("message", ""))
                    else:
                        yield name, payload
                name, data = None, []
            elif line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
    finally:
        resp.close()
