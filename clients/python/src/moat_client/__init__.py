"""A client for moat's HTTP API (`moat serve`), using only the standard library.

    from moat_client import Client

    c = Client("http://127.0.0.1:8080", token="...")
    r = c.run("print(1)")
    print(r.stdout, r.exit_code, r.run_id)

    with c.session(interpreter=True) as s:
        s.run("x = 41")
        print(s.run("print(x + 1)").stdout)          # 42
        s.upload("data/in.csv", b"a,b\\n1,2\\n")
        print(s.download("data/in.csv"))
        print([(f.name, f.type, f.mode) for f in s.files()])
        s.suspend()                                   # on disk, nothing running
        snap = s.snapshot("before")
        for ev in s.stream("import time\\nfor i in range(3): print(i, flush=True); time.sleep(1)"):
            print(ev.name, ev.text or ev.result)      # stdout 0 ... result RunResult(...)

Results are dataclasses (RunResult, FileInfo, SessionInfo, Snapshot,
Level, Event); each keeps the server's JSON in `raw`, so fields a newer
server adds are not lost. Every error the server answers is raised as
MoatError with its HTTP status, its stable code (e.g. "not_found", "busy")
and, for 429 and 503, the Retry-After the server asked for.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Type, TypeVar

__all__ = [
    "Client",
    "Session",
    "MoatError",
    "RunResult",
    "Event",
    "FileInfo",
    "SessionInfo",
    "Snapshot",
    "Level",
    "Health",
]

__version__ = "0.2.0"

T = TypeVar("T")


def _build(cls: Type[T], d: Dict[str, Any], **extra: Any) -> T:
    """cls from the JSON object d: its known fields, the rest left in raw."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kw = {k: v for k, v in d.items() if k in names and k != "raw"}
    kw.update(extra)
    return cls(raw=d, **kw)  # type: ignore[call-arg]


def _b64_or_text(d: Dict[str, Any], key: str) -> bytes:
    """The exact bytes of an output stream: key_b64 when the server sent it
    (the stream was not valid UTF-8), else the text's UTF-8."""
    b = d.get(key + "_b64")
    if b is not None:
        return base64.b64decode(b)
    return (d.get(key) or "").encode("utf-8")


@dataclass
class RunResult:
    """What a run produced. The code failing (a non-zero exit, a timeout) is
    a result, not an error."""

    level: str = ""
    exit_code: int = 0
    #: Why the run ended abnormally ("timeout", "memory", "output", ...), or "".
    reason: str = ""
    truncated: bool = False
    #: The output as text; bytes that are not UTF-8 are U+FFFD here.
    stdout: str = ""
    stderr: str = ""
    duration_ms: float = 0.0
    signal: str = ""
    notes: List[str] = field(default_factory=list)
    #: The run's id (X-Moat-Run-Id), as the server's log names it.
    run_id: str = ""
    #: The exact bytes of the output (from stdout_b64 when the server sent it).
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Dict[str, Any], run_id: str = "") -> "RunResult":
        return _build(cls, d, run_id=run_id, stdout_bytes=_b64_or_text(d, "stdout"),
                      stderr_bytes=_b64_or_text(d, "stderr"), notes=list(d.get("notes") or []))

    @property
    def ok(self) -> bool:
        """The code exited 0 and nothing stopped it."""
        return self.exit_code == 0 and not self.reason


@dataclass
class Event:
    """One server-sent event of a streamed run: name is "stdout" or
    "stderr" (text and data hold the output), "overflow" (the client fell
    behind: live output stops; text says so) or "result" (result holds
    the RunResult, always the last event)."""

    name: str
    text: str = ""
    #: The exact bytes of an output event.
    data: bytes = b""
    result: Optional[RunResult] = None


@dataclass
class FileInfo:
    """A file of a session. mode is the permissions in octal ("0644")."""

    name: str = ""
    #: "file", "dir", "symlink" or "other".
    type: str = ""
    mode: str = ""
    size: int = 0
    mod_time: str = ""
    is_dir: bool = False
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def perm(self) -> int:
        """mode as a number, e.g. 0o644."""
        return int(self.mode, 8) if self.mode else 0


@dataclass
class SessionInfo:
    """A session as the server shows it."""

    id: str = ""
    level: str = ""
    network: str = ""
    interpreter: bool = False
    created_at: str = ""
    expires_at: str = ""
    idle_timeout: str = ""
    last_active_at: str = ""
    #: "running", "suspended" or "broken".
    state: str = ""
    #: Once suspended: whether the interpreter's variables come (came) back.
    memory: Optional[bool] = None
    suspended_at: Optional[str] = None
    suspended_bytes: int = 0
    broken: str = ""
    from_snapshot: str = ""
    notes: List[str] = field(default_factory=list)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class Snapshot:
    """A named snapshot of a session; Client.session(from_snapshot=id)
    forks it."""

    id: str = ""
    name: str = ""
    level: str = ""
    network: str = ""
    session: str = ""
    created_at: str = ""
    interpreter: bool = False
    memory: bool = False
    files: int = 0
    bytes: int = 0
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class Level:
    """A level the server serves."""

    level: str = ""
    default: bool = False
    sessions: bool = False
    suspend: bool = False
    suspend_memory: bool = False
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class Health:
    """/healthz: status "ok" and the build serving."""

    status: str = ""
    version: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


class MoatError(Exception):
    """An error answered by the server."""

    def __init__(self, status: int, code: str, message: str, retry_after: Optional[int] = None):
        super().__init__("moat: %d %s: %s" % (status, code, message))
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """moat's server never redirects; following one would send the bearer
    token wherever a proxy or a forged response points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


class Client:
    """A connection to one moat server with one bearer token. Safe to
    share between threads: each call is its own request."""

    def __init__(self, url: str, token: str, timeout: float = 120):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_NoRedirect)

    # Transport.

    def _request(self, method: str, path: str, body: Any = None, content_type: Optional[str] = None,
                 accept: Optional[str] = None):  # type: ignore[no-untyped-def]
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

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        with self._request(method, path, body) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _run(self, path: str, body: Dict[str, Any]) -> RunResult:
        with self._request("POST", path, body) as resp:
            run_id = resp.headers.get("X-Moat-Run-Id", "")
            return RunResult.from_json(json.loads(resp.read()), run_id)

    def _stream(self, path: str, body: Dict[str, Any]) -> Iterator[Event]:
        body = dict(body, stream=True)
        return _events(self._request("POST", path, body, accept="text/event-stream"))

    # The API.

    def health(self) -> Health:
        """The server's /healthz (no token needed)."""
        return _build(Health, self._json("GET", "/healthz"))

    def levels(self) -> List[Level]:
        """The levels the server serves."""
        return [_build(Level, x) for x in self._json("GET", "/v1/levels")["levels"]]

    def run(self, code: str, level: Optional[str] = None, network: Optional[str] = None) -> RunResult:
        """Run code once, in a fresh sandbox."""
        return self._run("/v1/runs", _body(code, level=level, network=network))

    def stream(self, code: str, level: Optional[str] = None, network: Optional[str] = None) -> Iterator[Event]:
        """Run code once, yielding Events as the code writes, the result
        last. Closing the generator early disconnects, which cancels the
        run."""
        return self._stream("/v1/runs", _body(code, level=level, network=network))

    def create_session(self, level: Optional[str] = None, ttl: Optional[str] = None,
                       idle_timeout: Optional[str] = None, interpreter: bool = False,
                       from_snapshot: Optional[str] = None, network: Optional[str] = None) -> "Session":
        """Create a session; ttl and idle_timeout are strings like "30m".
        from_snapshot (a snapshot's id) starts it from that snapshot: a fork,
        with the snapshot's level and interpreter."""
        body: Dict[str, Any] = {"interpreter": bool(interpreter)}
        if from_snapshot:
            body = {"from_snapshot": from_snapshot}  # the snapshot's interpreter
        for k, v in (("level", level), ("ttl", ttl), ("idle_timeout", idle_timeout), ("network", network)):
            if v:
                body[k] = v
        return Session(self, _build(SessionInfo, self._json("POST", "/v1/sessions", body)))

    session = create_session

    def sessions(self) -> List[SessionInfo]:
        """This token's sessions."""
        return [_build(SessionInfo, x) for x in self._json("GET", "/v1/sessions")["sessions"]]

    def get_session(self, session_id: str) -> "Session":
        return Session(self, _build(SessionInfo, self._json("GET", "/v1/sessions/" + _seg(session_id))))

    def snapshots(self) -> List[Snapshot]:
        """This token's snapshots."""
        return [_build(Snapshot, x) for x in self._json("GET", "/v1/snapshots")["snapshots"]]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._json("DELETE", "/v1/snapshots/" + _seg(snapshot_id))


class Session:
    """A session: files and, when asked for, a live interpreter, kept
    between runs. Use it as a context manager to delete it at the end."""

    def __init__(self, client: Client, info: SessionInfo):
        self.client = client
        self.info = info
        self.id = info.id
        self._base = "/v1/sessions/" + _seg(self.id)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.delete()
        except MoatError as e:
            if e.status != 404:
                raise

    def _info(self, method: str, path: str) -> SessionInfo:
        self.info = _build(SessionInfo, self.client._json(method, self._base + path))
        return self.info

    def refresh(self) -> SessionInfo:
        return self._info("GET", "")

    def run(self, code: str) -> RunResult:
        return self.client._run(self._base + "/runs", _body(code))

    def stream(self, code: str) -> Iterator[Event]:
        return self.client._stream(self._base + "/runs", _body(code))

    def files(self) -> List[FileInfo]:
        """The session's files, recursively."""
        return [_build(FileInfo, x) for x in self.client._json("GET", self._base + "/files")["files"]]

    def stat(self, name: str) -> FileInfo:
        """One file, described (a link is not followed)."""
        return _build(FileInfo, self.client._json("GET", self._base + "/stat/" + _path(name)))

    def upload(self, name: str, data: Any) -> None:
        """Write name (parents made as needed) with data (bytes or str)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        self.client._json("PUT", self._base + "/files/" + _path(name), bytes(data))

    def download(self, name: str) -> bytes:
        """name's bytes; a directory is MoatError 409 is_a_directory."""
        with self.client._request("GET", self._base + "/files/" + _path(name)) as resp:
            return resp.read()

    def mkdir(self, name: str) -> None:
        self.client._json("POST", self._base + "/dirs/" + _path(name))

    def rename(self, src: str, dst: str) -> None:
        self.client._json("POST", self._base + "/rename", {"from": src, "to": dst})

    def remove(self, name: str) -> None:
        self.client._json("DELETE", self._base + "/files/" + _path(name))

    def suspend(self) -> SessionInfo:
        """Suspend the session: its state kept on disk, nothing of it
        running. Its next run or file operation resumes it. The view's
        memory says whether the interpreter's variables come back."""
        return self._info("POST", "/suspend")

    def resume(self) -> SessionInfo:
        """Resume a suspended session; the view's notes say what came back."""
        return self._info("POST", "/resume")

    def snapshot(self, name: str) -> Snapshot:
        """Take a named snapshot; create_session(from_snapshot=...) forks it."""
        return _build(Snapshot, self.client._json("POST", self._base + "/snapshots", {"name": name}))

    def delete(self) -> None:
        self.client._json("DELETE", self._base)


def _body(code: str, **opt: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"code": code}
    body.update({k: v for k, v in opt.items() if v})
    return body


def _seg(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def _path(name: str) -> str:
    # Each element is escaped, the slashes between them kept. The server
    # refuses "..", "." and absolute names however they are spelled.
    return "/".join(urllib.parse.quote(p, safe="") for p in name.split("/"))


def _error(e: urllib.error.HTTPError) -> MoatError:
    try:
        body = json.loads(e.read() or b"{}")
        err = body.get("error", {})
        code, message = err.get("code", "unknown"), err.get("message", "")
    except ValueError:
        code, message = "unknown", ""
    ra = e.headers.get("Retry-After")
    return MoatError(e.code, code, message, int(ra) if ra and ra.isdigit() else None)


def _events(resp: Any) -> Iterator[Event]:
    """Parse server-sent events from resp. An error event is raised as
    MoatError (status 200: the answer had begun)."""
    run_id = resp.headers.get("X-Moat-Run-Id", "")
    try:
        name: Optional[str] = None
        data: List[str] = []
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line == "":
                if name is not None:
                    payload = json.loads("\n".join(data))
                    if name in ("stdout", "stderr"):
                        yield Event(name, text=payload["data"], data=_b64_or_text(payload, "data"))
                    elif name == "error":
                        err = payload.get("error", {})
                        raise MoatError(200, err.get("code", "unknown"), err.get("message", ""))
                    elif name == "result":
                        yield Event(name, result=RunResult.from_json(payload, run_id))
                    else:
                        yield Event(name, text=payload.get("message", ""))
                name, data = None, []
            elif line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
    finally:
        resp.close()
