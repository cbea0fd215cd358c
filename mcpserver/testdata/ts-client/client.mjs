// Drives moat's MCP server with the official TypeScript SDK's client, a
// client that moat did not write. Run by mcpserver's Go tests
// (TestTypeScriptClient); it can be run by hand too:
//
//   npm ci
//   node client.mjs -- moat mcp            # spawn a server over stdio
//   node client.mjs --url http://127.0.0.1:8765/   # streamable HTTP
//
// It lists the tools, calls run_python with print(6*7) and checks 42, sends
// bad input and checks the tool errors, and checks the server still answers.
// It prints one JSON line on success and exits 0; it exits 1 on any failure.

import assert from "node:assert/strict";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

function usage() {
  console.error("usage: node client.mjs -- COMMAND [ARG...] | --url URL");
  process.exit(2);
}

function transportFromArgs(argv) {
  if (argv[0] === "--url" && argv.length === 2) {
    return new StreamableHTTPClientTransport(new URL(argv[1]));
  }
  if (argv[0] === "--" && argv.length >= 2) {
    return new StdioClientTransport({
      command: argv[1],
      args: argv.slice(2),
      env: { ...process.env },
      stderr: "inherit",
    });
  }
  usage();
}

// textOf returns the one text item of a tool result.
function textOf(res) {
  assert.equal(res.content.length, 1, "one content item");
  assert.equal(res.content[0].type, "text", "text content");
  return res.content[0].text;
}

async function runPython(client, args) {
  return client.callTool({ name: "run_python", arguments: args });
}

async function main() {
  const client = new Client({ name: "moat-ts-client-test", version: "1.0.0" });
  await client.connect(transportFromArgs(process.argv.slice(2)));

  const server = client.getServerVersion();
  assert.equal(server.name, "moat", "server name");

  const { tools } = await client.listTools();
  assert.deepEqual(tools.map((t) => t.name), ["run_python"], "exactly one tool");
  const schema = tools[0].inputSchema;
  assert.equal(schema.type, "object");
  assert.deepEqual(Object.keys(schema.properties), ["code"], "code is the only property");
  assert.equal(schema.properties.code.type, "string");
  assert.deepEqual(schema.required, ["code"]);
  assert.equal(schema.additionalProperties, false);

  const ok = await runPython(client, { code: "print(6*7)" });
  const okText = textOf(ok);
  assert.notEqual(ok.isError, true, `print(6*7) is not an error: ${okText}`);
  assert.match(okText, /^stdout:\n42$/m, "stdout is 42");
  assert.match(okText, /^exit code: 0$/m);

  const bad = [
    [{ code: 42 }, /"code" must be a string/],
    [{ code: "print(1)", level: "none" }, /unknown field "level"/],
    [{}, /missing the required field "code"/],
  ];
  for (const [args, want] of bad) {
    const res = await runPython(client, args);
    const text = textOf(res);
    assert.equal(res.isError, true, `${JSON.stringify(args)} is a tool error: ${text}`);
    assert.match(text, want);
  }

  const fail = await runPython(client, { code: "1/0" });
  assert.notEqual(fail.isError, true, "a traceback is a result, not a tool error");
  assert.match(textOf(fail), /ZeroDivisionError/);
  assert.match(textOf(fail), /^exit code: 1$/m);

  const again = await runPython(client, { code: "print(6*7)" });
  assert.match(textOf(again), /^stdout:\n42$/m, "the server still answers");

  await client.close();
  console.log(JSON.stringify({ ok: true, server, tools: tools.map((t) => t.name), result: okText }));
}

main().catch((err) => {
  console.error("ts-client:", err);
  process.exit(1);
});
