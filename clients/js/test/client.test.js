// Tests of moat-client against a real server. The Go test TestJSClient
// (server/client_test.go) starts the server on 127.0.0.1 and runs
// `node --test` here with MOAT_URL, MOAT_TOKEN and MOAT_OTHER_TOKEN set.

import { test, describe, before } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { Client, MoatError, Session } from "../index.js";

const URL = process.env.MOAT_URL;

const allBytes = Uint8Array.from({ length: 256 }, (_, i) => i);

/** await fn() and return the MoatError it throws. */
async function moatError(fn) {
  try {
    await fn();
  } catch (e) {
    assert.ok(e instanceof MoatError, `not a MoatError: ${e}`);
    return e;
  }
  assert.fail("no error thrown");
}

describe("against a server", { skip: URL ? false : "MOAT_URL is not set: run through the Go test TestJSClient" }, () => {
  let c, other;
  before(() => {
    c = new Client(URL, process.env.MOAT_TOKEN);
    other = new Client(URL, process.env.MOAT_OTHER_TOKEN);
  });

  test("health", async () => {
    const h = await c.health();
    assert.equal(h.status, "ok");
    assert.ok(h.version);
  });

  test("levels", async () => {
    const l = await c.levels();
    assert.ok(l.some((x) => x.level === "subprocess" && x.default && x.sessions), JSON.stringify(l));
  });

  test("run", async () => {
    const r = await c.run("import sys\nprint('hi')\nsys.exit(4)");
    assert.equal(r.stdout, "hi\n");
    assert.deepEqual(r.stdoutBytes, new TextEncoder().encode("hi\n"));
    assert.equal(r.exitCode, 4);
    assert.equal(r.ok, false);
    assert.equal(r.level, "subprocess");
    assert.match(r.runId, /^r_[0-9a-f]+$/);
    assert.ok(r.durationMs > 0);
    assert.equal(r.raw.exit_code, 4);
  });

  test("binary output, exact", async () => {
    const r = await c.run("import sys\nsys.stdout.buffer.write(bytes(range(256)))\nsys.stderr.buffer.write(b'\\xff\\xfe')");
    assert.deepEqual(r.stdoutBytes, allBytes);
    assert.deepEqual(r.stderrBytes, Uint8Array.of(0xff, 0xfe));
    assert.ok(r.stdout.includes("\uFFFD"));
    const parts = [];
    for await (const ev of c.stream("import sys\nsys.stdout.buffer.write(bytes(range(256)))")) {
      if (ev.name === "stdout") parts.push(...ev.data);
    }
    assert.deepEqual(Uint8Array.from(parts), allBytes);
  });

  test("stream", async () => {
    const events = [];
    for await (const ev of c.stream("import time\nprint('a', flush=True)\ntime.sleep(0.2)\nprint('b')")) events.push(ev);
    assert.equal(events[0].name, "stdout");
    assert.equal(events[0].text, "a\n");
    const last = events.at(-1);
    assert.equal(last.name, "result");
    assert.equal(last.result.stdout, "a\nb\n");
    assert.match(last.result.runId, /^r_/);
  });

  test("a stream left early cancels its run", async () => {
    const started = Date.now();
    for await (const ev of c.stream("import time\nprint('start', flush=True)\ntime.sleep(60)")) {
      assert.equal(ev.text, "start\n");
      break;
    }
    // The Go suite (TestStreaming) checks that the run's processes end;
    // here: the client goes on, and did not wait for the run.
    assert.equal((await c.run("print(2)")).stdout, "2\n");
    assert.ok(Date.now() - started < 30000);
  });

  test("a session: interpreter, files, modes", async () => {
    const s = await c.createSession({ interpreter: true, ttl: "5m" });
    assert.ok(s instanceof Session);
    assert.equal(s.info.state, "running");
    assert.equal(s.info.interpreter, true);
    try {
      await s.run("x = 41\nopen('out.txt', 'w').write('written by code')");
      assert.equal((await s.run("print(x + 1)")).stdout, "42\n");
      await s.upload("in/data.bin", Uint8Array.of(0, 1, 0x62, 0xff));
      assert.equal((await s.run("print(open('in/data.bin','rb').read())")).stdout, "b'\\x00\\x01b\\xff'\n");
      assert.deepEqual(await s.download("in/data.bin"), Uint8Array.of(0, 1, 0x62, 0xff));
      await s.upload("text.txt", "héllo");
      assert.equal(new TextDecoder().decode(await s.download("text.txt")), "héllo");
      const files = Object.fromEntries((await s.files()).map((f) => [f.name, f]));
      assert.ok(["out.txt", "in", "in/data.bin"].every((n) => n in files), JSON.stringify(files));
      assert.equal(files.in.type, "dir");
      assert.equal(files.in.isDir, true);
      assert.equal(files["in/data.bin"].type, "file");
      await s.run("import os\nos.chmod('out.txt', 0o750)\nos.symlink('out.txt', 'link')");
      const st = await s.stat("out.txt");
      assert.deepEqual([st.mode, st.perm, st.size], ["0750", 0o750, 15]);
      assert.equal((await s.stat("link")).type, "symlink");
      const dir = await moatError(() => s.download("in"));
      assert.deepEqual([dir.status, dir.code], [409, "is_a_directory"]);
      await s.mkdir("made/deep");
      await s.rename("out.txt", "made/deep/moved.txt");
      assert.equal(new TextDecoder().decode(await s.download("made/deep/moved.txt")), "written by code");
      await s.remove("made/deep/moved.txt");
      const gone = await moatError(() => s.download("made/deep/moved.txt"));
      assert.deepEqual([gone.status, gone.code], [404, "not_found"]);
      assert.ok((await c.sessions()).some((x) => x.id === s.id));
      const streamed = [];
      for await (const ev of s.stream("print(x)")) streamed.push(ev.name);
      assert.deepEqual(streamed, ["stdout", "result"]);
    } finally {
      await s.delete();
    }
    const e = await moatError(() => c.getSession(s.id));
    assert.equal(e.status, 404);
  });

  test("suspend, resume, snapshot", async () => {
    const s = await c.createSession();
    try {
      await s.upload("kept.txt", "kept");
      assert.equal((await s.suspend()).state, "suspended");
      assert.equal((await s.refresh()).state, "suspended");
      const r = await s.run("print(open('kept.txt').read())");
      assert.equal(r.stdout, "kept\n");
      assert.ok(r.notes.some((n) => n.includes("resumed")), JSON.stringify(r.notes));
      await s.suspend();
      assert.equal((await s.resume()).state, "running");
      const snap = await s.snapshot("js");
      try {
        const f = await c.createSession({ fromSnapshot: snap.id });
        await f.upload("kept.txt", "fork");
        assert.equal(new TextDecoder().decode(await s.download("kept.txt")), "kept");
        await f.delete();
        assert.ok((await c.snapshots()).some((x) => x.id === snap.id));
        assert.deepEqual(await other.snapshots(), []);
      } finally {
        await c.deleteSnapshot(snap.id);
      }
    } finally {
      await s.delete();
    }
  });

  test("another token sees nothing", async () => {
    const s = await c.createSession();
    try {
      await s.upload("secret", "mine");
      assert.equal((await moatError(() => other.getSession(s.id))).status, 404);
      const theirs = new Session(other, s.info);
      assert.equal((await moatError(() => theirs.download("secret"))).status, 404);
      assert.ok(!(await other.sessions()).some((x) => x.id === s.id));
    } finally {
      await s.delete();
    }
  });

  test("a bad token", async () => {
    const e = await moatError(() => new Client(URL, "not-a-token-at-all-1234").run("print(1)"));
    assert.deepEqual([e.status, e.code], [401, "unauthorized"]);
  });

  test("traversal refused", async () => {
    const s = await c.createSession();
    try {
      for (const name of ["../escape", "/etc/passwd", "a/../../b", "a//b"]) {
        assert.equal((await moatError(() => s.upload(name, "x"))).status, 400, name);
      }
      // A URL would resolve ".." to the session itself (DELETE
      // /v1/sessions/ID); the client refuses before sending.
      for (const name of ["..", "../", "a/../.."]) {
        assert.equal((await moatError(() => s.remove(name))).status, 400, name);
      }
      assert.equal((await s.refresh()).state, "running");
      assert.deepEqual(await s.files(), []);
    } finally {
      await s.delete();
    }
  });
});

test("the token does not follow a redirect", async () => {
  const seen = [];
  const sink = http.createServer((req, res) => {
    seen.push(req.headers.authorization);
    res.end("{}");
  });
  const redirect = http.createServer((req, res) => {
    res.writeHead(302, { Location: `http://127.0.0.1:${sink.address().port}/stolen` });
    res.end();
  });
  await Promise.all([sink, redirect].map((s) => new Promise((ok) => s.listen(0, "127.0.0.1", ok))));
  try {
    const e = await moatError(() => new Client(`http://127.0.0.1:${redirect.address().port}`, "secret-token").levels());
    assert.equal(e.status, 302);
    assert.deepEqual(seen, []);
  } finally {
    await Promise.all([sink, redirect].map((s) => new Promise((ok) => s.close(ok))));
  }
});
