// index.d.ts declares every export of index.js, and package.json points at
// files that exist.

import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, existsSync } from "node:fs";
import * as moat from "../index.js";

const dir = new URL("..", import.meta.url);
const dts = readFileSync(new URL("index.d.ts", dir), "utf8");

test("every export is declared in index.d.ts", () => {
  for (const name of Object.keys(moat)) {
    assert.match(dts, new RegExp(`export (class|function|const) ${name}\\b`), `${name} is not declared`);
  }
  for (const [, name] of dts.matchAll(/^export (?:class|function|const) (\w+)/gm)) {
    assert.ok(name in moat, `index.d.ts declares ${name}, which index.js does not export`);
  }
});

test("every method of the classes is declared", () => {
  for (const cls of [moat.Client, moat.Session]) {
    const body = dts.slice(dts.indexOf(`export class ${cls.name} `));
    const decl = body.slice(0, body.indexOf("\n}\n"));
    for (const m of Object.getOwnPropertyNames(cls.prototype)) {
      if (m === "constructor" || m.startsWith("_")) continue;
      assert.match(decl, new RegExp(`\\n  ${m}\\(`), `${cls.name}.${m} is not declared`);
    }
  }
});

test("package.json", () => {
  const pkg = JSON.parse(readFileSync(new URL("package.json", dir), "utf8"));
  assert.equal(pkg.type, "module");
  assert.deepEqual(pkg.dependencies ?? {}, {});
  for (const f of [pkg.main, pkg.types, pkg.exports["."].default, pkg.exports["."].types, ...pkg.files]) {
    assert.ok(existsSync(new URL(f, dir)), `${f} is missing`);
  }
});
