// Types of moat-client (index.js). test/types.test.js checks that every
// export of index.js is declared here.

/** What a run produced. The code failing (a non-zero exit, a timeout) is a result, not an error. */
export interface RunResult {
  level: string;
  exitCode: number;
  /** Why the run ended abnormally ("timeout", "memory", "pids", "filesize", "disk", "output", "signal", "canceled"), or "". */
  reason: string;
  truncated: boolean;
  /** The output as text; bytes that are not UTF-8 are U+FFFD. */
  stdout: string;
  stderr: string;
  /** The exact bytes (from the server's stdout_b64 when it sent one). */
  stdoutBytes: Uint8Array;
  stderrBytes: Uint8Array;
  durationMs: number;
  signal: string;
  notes: string[];
  /** The X-Moat-Run-Id header: the run's id in the server's log. */
  runId: string;
  /** The code exited 0 and nothing stopped it. */
  ok: boolean;
  /** The server's JSON. */
  raw: Record<string, any>;
}

/** One server-sent event of a streamed run; "result" is the last. */
export type StreamEvent =
  | { name: "stdout" | "stderr"; text: string; data: Uint8Array }
  | { name: "overflow"; text: string }
  | { name: "result"; result: RunResult };

export interface FileInfo {
  /** Slash-separated, relative to the session's directory. */
  name: string;
  type: "file" | "dir" | "symlink" | "other";
  /** The permissions in octal, e.g. "0644". */
  mode: string;
  /** mode as a number, e.g. 0o644. */
  perm: number;
  size: number;
  modTime: string;
  isDir: boolean;
  raw: Record<string, any>;
}

export interface SessionInfo {
  id: string;
  level: string;
  network: string;
  interpreter: boolean;
  state: "running" | "suspended" | "broken";
  /** Once suspended: whether the interpreter's variables come back. */
  memory?: boolean;
  createdAt: string;
  expiresAt: string;
  notes: string[];
  raw: Record<string, any>;
}

export interface Level {
  level: string;
  default: boolean;
  sessions: boolean;
  suspend: boolean;
  suspend_memory: boolean;
}

export interface RunOptions {
  /** One-shot runs: the level (default: the server's). */
  level?: string;
  /** The name of a network profile this token may use. */
  network?: string;
  /** Aborting it disconnects, which cancels the run. */
  signal?: AbortSignal;
}

export interface SessionOptions {
  level?: string;
  network?: string;
  /** e.g. "30m" */
  ttl?: string;
  /** e.g. "10m" */
  idleTimeout?: string;
  /** Keep a live interpreter: variables last between runs. */
  interpreter?: boolean;
  /** Start from a snapshot of this token's (a fork). */
  fromSnapshot?: string;
}

/** An error answered by the server. */
export class MoatError extends Error {
  constructor(status: number, code: string, message: string, retryAfter?: number);
  status: number;
  /** The server's stable code, e.g. "not_found", "is_a_directory", "busy". */
  code: string;
  serverMessage: string;
  /** Seconds, for 429 and 503. */
  retryAfter?: number;
}

/** A connection to one moat server with one bearer token. */
export class Client {
  constructor(url: string, token: string, options?: { fetch?: typeof fetch });
  url: string;
  token: string;
  health(): Promise<{ status: string; version: string }>;
  levels(): Promise<Level[]>;
  run(code: string, opt?: RunOptions): Promise<RunResult>;
  stream(code: string, opt?: RunOptions): AsyncGenerator<StreamEvent, void, undefined>;
  createSession(opt?: SessionOptions): Promise<Session>;
  sessions(): Promise<SessionInfo[]>;
  getSession(id: string): Promise<Session>;
  snapshots(): Promise<Array<Record<string, any>>>;
  deleteSnapshot(id: string): Promise<void>;
}

/** A session: files and, when asked for, a live interpreter, kept between runs. */
export class Session {
  constructor(client: Client, info: SessionInfo);
  client: Client;
  info: SessionInfo;
  id: string;
  refresh(): Promise<SessionInfo>;
  run(code: string, opt?: { signal?: AbortSignal }): Promise<RunResult>;
  stream(code: string, opt?: { signal?: AbortSignal }): AsyncGenerator<StreamEvent, void, undefined>;
  files(): Promise<FileInfo[]>;
  stat(name: string): Promise<FileInfo>;
  upload(name: string, data: string | Uint8Array | ArrayBuffer | Blob): Promise<void>;
  download(name: string): Promise<Uint8Array>;
  mkdir(name: string): Promise<void>;
  rename(from: string, to: string): Promise<void>;
  remove(name: string): Promise<void>;
  suspend(): Promise<SessionInfo>;
  resume(): Promise<SessionInfo>;
  snapshot(name: string): Promise<Record<string, any>>;
  delete(): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
}
