// A client for moat's HTTP API (`moat serve`): an ES module with no
// dependencies, for Node 20+ (and any runtime with fetch, TextDecoder and
// AbortController). Types: index.d.ts, and the JSDoc below.
//
//   import { Client } from "moat-client";
//   const c = new Client("http://127.0.0.1:8080", process.env.MOAT_TOKEN);
//   const r = await c.run("print(6 * 7)");
//   console.log(r.stdout, r.exitCode, r.runId);
//
// Every error the server answers is thrown as a MoatError with its HTTP
// status, the server's stable code and, for 429 and 503, retryAfter.

/**
 * @typedef {object} RunResult What a run produced. The code failing (a
 *   non-zero exit, a timeout) is a result, not an error.
 * @property {string} level
 * @property {number} exitCode
 * @property {string} reason Why the run ended abnormally ("timeout", "memory", "output", ...), or "".
 * @property {boolean} truncated
 * @property {string} stdout The output as text; bytes that are not UTF-8 are U+FFFD.
 * @property {string} stderr
 * @property {Uint8Array} stdoutBytes The exact bytes (the server's stdout_b64 when it sent one).
 * @property {Uint8Array} stderrBytes
 * @property {number} durationMs
 * @property {string} signal
 * @property {string[]} notes
 * @property {string} runId The X-Moat-Run-Id header: the run's id in the server's log.
 * @property {boolean} ok The code exited 0 and nothing stopped it.
 * @property {Record<string, any>} raw The server's JSON.
 */

/**
 * @typedef {object} StreamEvent One server-sent event of a streamed run.
 * @property {"stdout"|"stderr"|"overflow"|"result"} name
 * @property {string} [text] An output event's text, or the overflow's message.
 * @property {Uint8Array} [data] An output event's exact bytes.
 * @property {RunResult} [result] The result: the last event.
 */

/**
 * @typedef {object} FileInfo A file of a session.
 * @property {string} name Slash-separated, relative to the session's directory.
 * @property {"file"|"dir"|"symlink"|"other"} type
 * @property {string} mode The permissions in octal, e.g. "0644".
 * @property {number} perm mode as a number, e.g. 0o644.
 * @property {number} size
 * @property {string} modTime
 * @property {boolean} isDir
 * @property {Record<string, any>} raw
 */

/**
 * @typedef {object} SessionInfo A session as the server shows it.
 * @property {string} id
 * @property {string} level
 * @property {string} network
 * @property {boolean} interpreter
 * @property {string} state "running", "suspended" or "broken".
 * @property {boolean|undefined} memory Once suspended: whether the interpreter's variables come back.
 * @property {string} createdAt
 * @property {string} expiresAt
 * @property {string[]} notes
 * @property {Record<string, any>} raw
 */

/**
 * @typedef {object} RunOptions
 * @property {string} [level] One-shot runs: the level (default: the server's).
 * @property {string} [network] The name of a network profile this token may use.
 * @property {AbortSignal} [signal] Aborting it disconnects, which cancels the run.
 */

/**
 * @typedef {object} SessionOptions
 * @property {string} [level]
 * @property {string} [network]
 * @property {string} [ttl] e.g. "30m"
 * @property {string} [idleTimeout] e.g. "10m"
 * @property {boolean} [interpreter] Keep a live interpreter: variables last between runs.
 * @property {string} [fromSnapshot] Start from a snapshot of this token's (a fork).
 */

/** An error answered by the server. */
export class MoatError extends Error {
  /**
   * @param {number} status
   * @param {string} code
   * @param {string} message
   * @param {number} [retryAfter]
   */
  constructor(status, code, message, retryAfter) {
    super(`moat: ${status} ${code}: ${message}`);
    this.name = "MoatError";
    /** @type {number} */ this.status = status;
    /** @type {string} */ this.code = code;
    /** @type {string} */ this.serverMessage = message;
    /** @type {number|undefined} */ this.retryAfter = retryAfter;
  }
}

const utf8 = new TextEncoder();

/** @param {string} b64 */
function fromBase64(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

/** The exact bytes of an output field: key_b64 when sent, else the text's UTF-8. */
function bytesOf(obj, key) {
  const b = obj[key + "_b64"];
  return typeof b === "string" ? fromBase64(b) : utf8.encode(obj[key] ?? "");
}

/**
 * @param {Record<string, any>} j
 * @param {string} runId
 * @returns {RunResult}
 */
function toResult(j, runId) {
  return {
    level: j.level ?? "",
    exitCode: j.exit_code ?? 0,
    reason: j.reason ?? "",
    truncated: !!j.truncated,
    stdout: j.stdout ?? "",
    stderr: j.stderr ?? "",
    stdoutBytes: bytesOf(j, "stdout"),
    stderrBytes: bytesOf(j, "stderr"),
    durationMs: j.duration_ms ?? 0,
    signal: j.signal ?? "",
    notes: j.notes ?? [],
    runId,
    ok: (j.exit_code ?? 0) === 0 && !j.reason,
    raw: j,
  };
}

/** @returns {FileInfo} */
function toFile(j) {
  return {
    name: j.name, type: j.type, mode: j.mode, perm: j.mode ? parseInt(j.mode, 8) : 0,
    size: j.size ?? 0, modTime: j.mod_time ?? "", isDir: !!j.is_dir, raw: j,
  };
}

/** @returns {SessionInfo} */
function toSession(j) {
  return {
    id: j.id, level: j.level, network: j.network ?? "", interpreter: !!j.interpreter,
    state: j.state ?? "running", memory: j.memory, createdAt: j.created_at ?? "",
    expiresAt: j.expires_at ?? "", notes: j.notes ?? [], raw: j,
  };
}

/**
 * One path segment, escaped. URLs resolve "." and ".." segments, escaped
 * as %2e or not, before the request is sent: "a/../../x" would reach
 * another route of the session (a DELETE of "..", the session itself). So
 * they are refused here, as the server refuses them, before anything is
 * sent.
 * @param {string} s
 */
function seg(s) {
  if (s === "" || s === "." || s === "..") {
    throw new MoatError(400, "invalid", `moat-client: the path element ${JSON.stringify(s)} is refused: no empty, "." or ".." elements, no absolute names`);
  }
  return encodeURIComponent(s);
}

/** Each path element escaped, the slashes between them kept. @param {string} name */
function filePath(name) {
  return name.split("/").map(seg).join("/");
}

/** A connection to one moat server with one bearer token. */
export class Client {
  /**
   * @param {string} url e.g. "http://127.0.0.1:8080"
   * @param {string} token a bearer token of the server's tokens file
   * @param {{fetch?: typeof fetch}} [options] fetch: another implementation (tests, proxies)
   */
  constructor(url, token, options = {}) {
    this.url = url.replace(/\/+$/, "");
    this.token = token;
    this._fetch = options.fetch ?? globalThis.fetch;
  }

  /**
   * One request; an error status is thrown as MoatError. The server never
   * redirects, and a redirect is not followed: the token would go with it.
   * @param {string} method
   * @param {string} path
   * @param {{json?: any, body?: any, accept?: string, signal?: AbortSignal}} [opt]
   * @returns {Promise<Response>}
   */
  async _request(method, path, opt = {}) {
    /** @type {Record<string, string>} */
    const headers = { Authorization: `Bearer ${this.token}` };
    let body;
    if (opt.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(opt.json);
    } else if (opt.body !== undefined) {
      headers["Content-Type"] = "application/octet-stream";
      body = typeof opt.body === "string" ? utf8.encode(opt.body) : opt.body;
    }
    if (opt.accept) headers.Accept = opt.accept;
    const resp = await this._fetch(this.url + path, { method, headers, body, redirect: "manual", signal: opt.signal });
    if (resp.status >= 300 || resp.type === "opaqueredirect") {
      const text = await resp.text().catch(() => "");
      let code = "unknown", message = text;
      try {
        const e = JSON.parse(text).error;
        if (e) ({ code, message } = e);
      } catch { /* not JSON: keep the text */ }
      const ra = resp.headers.get("Retry-After");
      throw new MoatError(resp.status, code, message, ra && /^\d+$/.test(ra) ? Number(ra) : undefined);
    }
    return resp;
  }

  /** @returns {Promise<any>} */
  async _json(method, path, json) {
    const resp = await this._request(method, path, { json });
    const text = await resp.text();
    return text ? JSON.parse(text) : null;
  }

  /** @returns {Promise<RunResult>} */
  async _run(path, code, opt = {}) {
    const resp = await this._request("POST", path, { json: runBody(code, opt), signal: opt.signal });
    return toResult(await resp.json(), resp.headers.get("X-Moat-Run-Id") ?? "");
  }

  /** @returns {AsyncGenerator<StreamEvent, void, undefined>} */
  async *_stream(path, code, opt = {}) {
    const ctl = new AbortController();
    const onAbort = () => ctl.abort(opt.signal?.reason);
    opt.signal?.addEventListener("abort", onAbort, { once: true });
    try {
      const resp = await this._request("POST", path, {
        json: { ...runBody(code, opt), stream: true }, accept: "text/event-stream", signal: ctl.signal,
      });
      yield* events(resp, resp.headers.get("X-Moat-Run-Id") ?? "");
    } finally {
      // Leaving early (break, throw, return) disconnects: the run is cancelled.
      ctl.abort();
      opt.signal?.removeEventListener("abort", onAbort);
    }
  }

  /** The server's /healthz (no token needed). @returns {Promise<{status: string, version: string}>} */
  async health() {
    return this._json("GET", "/healthz");
  }

  /** The levels served. @returns {Promise<Array<{level: string, default: boolean, sessions: boolean, suspend: boolean, suspend_memory: boolean}>>} */
  async levels() {
    return (await this._json("GET", "/v1/levels")).levels;
  }

  /**
   * Run code once, in a fresh sandbox.
   * @param {string} code
   * @param {RunOptions} [opt]
   * @returns {Promise<RunResult>}
   */
  run(code, opt) {
    return this._run("/v1/runs", code, opt);
  }

  /**
   * Run code once, yielding events as the code writes, the result last.
   * Leaving the loop early disconnects, which cancels the run.
   * @param {string} code
   * @param {RunOptions} [opt]
   * @returns {AsyncGenerator<StreamEvent, void, undefined>}
   */
  stream(code, opt) {
    return this._stream("/v1/runs", code, opt);
  }

  /**
   * Create a session.
   * @param {SessionOptions} [opt]
   * @returns {Promise<Session>}
   */
  async createSession(opt = {}) {
    /** @type {Record<string, any>} */
    const body = opt.fromSnapshot ? { from_snapshot: opt.fromSnapshot } : { interpreter: !!opt.interpreter };
    if (opt.level) body.level = opt.level;
    if (opt.network) body.network = opt.network;
    if (opt.ttl) body.ttl = opt.ttl;
    if (opt.idleTimeout) body.idle_timeout = opt.idleTimeout;
    return new Session(this, toSession(await this._json("POST", "/v1/sessions", body)));
  }

  /** This token's sessions. @returns {Promise<SessionInfo[]>} */
  async sessions() {
    return (await this._json("GET", "/v1/sessions")).sessions.map(toSession);
  }

  /** @param {string} id @returns {Promise<Session>} */
  async getSession(id) {
    return new Session(this, toSession(await this._json("GET", `/v1/sessions/${seg(id)}`)));
  }

  /** This token's snapshots. @returns {Promise<Array<Record<string, any>>>} */
  async snapshots() {
    return (await this._json("GET", "/v1/snapshots")).snapshots;
  }

  /** @param {string} id */
  async deleteSnapshot(id) {
    await this._json("DELETE", `/v1/snapshots/${seg(id)}`);
  }
}

/** A session: files and, when asked for, a live interpreter, kept between runs. */
export class Session {
  /** @param {Client} client @param {SessionInfo} info */
  constructor(client, info) {
    this.client = client;
    this.info = info;
    this.id = info.id;
    this._base = `/v1/sessions/${seg(info.id)}`;
  }

  /** @returns {Promise<SessionInfo>} */
  async refresh() {
    return (this.info = toSession(await this.client._json("GET", this._base)));
  }

  /** @param {string} code @param {{signal?: AbortSignal}} [opt] @returns {Promise<RunResult>} */
  run(code, opt) {
    return this.client._run(this._base + "/runs", code, opt);
  }

  /** @param {string} code @param {{signal?: AbortSignal}} [opt] @returns {AsyncGenerator<StreamEvent, void, undefined>} */
  stream(code, opt) {
    return this.client._stream(this._base + "/runs", code, opt);
  }

  /** The session's files, recursively. @returns {Promise<FileInfo[]>} */
  async files() {
    return (await this.client._json("GET", this._base + "/files")).files.map(toFile);
  }

  /** One file, described (a link is not followed). @param {string} name @returns {Promise<FileInfo>} */
  async stat(name) {
    return toFile(await this.client._json("GET", `${this._base}/stat/${filePath(name)}`));
  }

  /**
   * Write name (its parents made as needed).
   * @param {string} name
   * @param {string|Uint8Array|ArrayBuffer|Blob} data a string is written as UTF-8
   */
  async upload(name, data) {
    await (await this.client._request("PUT", `${this._base}/files/${filePath(name)}`, { body: data })).arrayBuffer();
  }

  /** name's bytes; a directory is MoatError 409 is_a_directory. @param {string} name @returns {Promise<Uint8Array>} */
  async download(name) {
    const resp = await this.client._request("GET", `${this._base}/files/${filePath(name)}`);
    return new Uint8Array(await resp.arrayBuffer());
  }

  /** @param {string} name */
  async mkdir(name) {
    await this.client._json("POST", `${this._base}/dirs/${filePath(name)}`);
  }

  /** @param {string} from @param {string} to */
  async rename(from, to) {
    await this.client._json("POST", this._base + "/rename", { from, to });
  }

  /** @param {string} name */
  async remove(name) {
    await this.client._json("DELETE", `${this._base}/files/${filePath(name)}`);
  }

  /** Suspend: the state on disk, nothing running; the next use resumes it. @returns {Promise<SessionInfo>} */
  async suspend() {
    return (this.info = toSession(await this.client._json("POST", this._base + "/suspend")));
  }

  /** @returns {Promise<SessionInfo>} */
  async resume() {
    return (this.info = toSession(await this.client._json("POST", this._base + "/resume")));
  }

  /** A named snapshot; createSession({fromSnapshot}) forks it. @param {string} name @returns {Promise<Record<string, any>>} */
  snapshot(name) {
    return this.client._json("POST", this._base + "/snapshots", { name });
  }

  /** End the session: nothing of it is left. */
  async delete() {
    await this.client._json("DELETE", this._base);
  }

  /** `await using s = await c.createSession()` deletes it at the end of the block. */
  async [Symbol.asyncDispose ?? Symbol.for("Symbol.asyncDispose")]() {
    try {
      await this.delete();
    } catch (e) {
      if (!(e instanceof MoatError && e.status === 404)) throw e;
    }
  }
}

/** @param {string} code */
function runBody(code, opt = {}) {
  /** @type {Record<string, any>} */
  const body = { code };
  if (opt.level) body.level = opt.level;
  if (opt.network) body.network = opt.network;
  return body;
}

/**
 * Parse the server-sent events of resp. An error event is thrown as a
 * MoatError (status 200: the answer had begun).
 * @param {Response} resp
 * @param {string} runId
 * @returns {AsyncGenerator<StreamEvent, void, undefined>}
 */
async function* events(resp, runId) {
  const dec = new TextDecoder();
  let buf = "";
  let name = "", data = [];
  for await (const chunk of resp.body) {
    buf += dec.decode(chunk, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).replace(/\r$/, "");
      buf = buf.slice(nl + 1);
      if (line === "") {
        if (name) {
          const p = JSON.parse(data.join("\n"));
          if (name === "stdout" || name === "stderr") {
            yield { name, text: p.data, data: bytesOf(p, "data") };
          } else if (name === "result") {
            yield { name, result: toResult(p, runId) };
          } else if (name === "error") {
            throw new MoatError(200, p.error?.code ?? "unknown", p.error?.message ?? "");
          } else {
            yield { name, text: p.message ?? "" };
          }
        }
        name = "";
        data = [];
      } else if (line.startsWith("event: ")) {
        name = line.slice(7);
      } else if (line.startsWith("data: ")) {
        data.push(line.slice(6));
      }
    }
  }
}
