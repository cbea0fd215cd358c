package bench

import (
	"encoding/json"
	"fmt"
	"html/template"
	"io"
	"time"
)

// Machine is what a page says of where its figures were measured.
type Machine struct {
	// Host is a free description: cores, memory, kernel, the OS.
	Host string `json:"host"`
	// Versions are the components' versions, by name (moat, go, python3,
	// docker, runsc, qemu).
	Versions map[string]string `json:"versions"`
	// Notes are facts a reader needs to judge the figures, e.g. that the
	// microvm level ran under TCG, not KVM.
	Notes []string `json:"notes,omitempty"`
	// When is the time of the measurement.
	When time.Time `json:"when"`
}

// Page is what WriteHTML draws: a latency report (nil for none), the
// sustained rows (nil for none) and the machine.
type Page struct {
	Latency   *Report     `json:"latency,omitempty"`
	Sustained []Sustained `json:"sustained,omitempty"`
	Machine   Machine     `json:"machine"`
}

// WriteHTML writes p as one self-contained HTML page: nothing is fetched
// to view it (no script, style or font from elsewhere). The figures are
// in the page once, as JSON; its script draws from them the latency
// table, a chart of each row's runs (every measured run a dot, and the
// median), the sustained table and the machine, so that what the page
// shows is exactly what `moat bench --json` would print. Each cell of a
// figure carries data-row and data-col attributes, which the tests read
// back from a headless browser's rendering.
func WriteHTML(w io.Writer, p Page) error {
	data, err := json.Marshal(p)
	if err != nil {
		return fmt.Errorf("bench: html: %w", err)
	}
	if err := pageTemplate.Execute(w, map[string]any{"Data": template.JS(data)}); err != nil {
		return fmt.Errorf("bench: html: %w", err)
	}
	return nil
}

// template.JS: data is json.Marshal's output, which escapes <, > and &
// (so no "</script>" can close the element early) and is a valid script
// literal.
var pageTemplate = template.Must(template.New("page").Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>moat bench</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child, td.note { text-align: left; }
td.note { color: #666; font-size: 12px; max-width: 40em; }
svg text { font-size: 11px; fill: #333; }
.err { color: #b00; }
</style></head>
<body>
<h1>moat bench</h1>
<p id="when"></p>
<h2>Latency: one <code>print(1)</code> at a time</h2>
<div id="latency"><p>No latency table in this page.</p></div>
<div id="chart"></div>
<h2>Sustained load</h2>
<div id="sustained"><p>No sustained table in this page.</p></div>
<h2>Machine</h2>
<div id="machine"></div>
<script id="data" type="application/json">{{.Data}}</script>
<script>
"use strict";
const page = JSON.parse(document.getElementById("data").textContent);
function el(tag, attrs, text) {
  const e = document.createElementNS(tag === "svg" || attrs.svg ? "http://www.w3.org/2000/svg" : "http://www.w3.org/1999/xhtml", tag);
  for (const [k, v] of Object.entries(attrs)) if (k !== "svg") e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function table(rows, cols, id) {
  const t = el("table", {id: id});
  const head = el("tr", {});
  for (const c of cols) head.appendChild(el("th", {}, c.title));
  t.appendChild(head);
  for (const r of rows) {
    const tr = el("tr", {});
    for (const c of cols) {
      const v = c.get(r);
      tr.appendChild(el("td", {"data-row": r.name, "data-col": c.key, "class": c.cls || ""}, v === undefined || v === null ? "" : String(v)));
    }
    t.appendChild(tr);
  }
  return t;
}
const fix2 = (v) => (typeof v === "number" ? v.toFixed(2) : v);
document.getElementById("when").textContent = "Measured " + page.machine.when + ".";
if (page.latency) {
  const rows = page.latency.rows;
  const box = document.getElementById("latency");
  box.textContent = "";
  box.appendChild(table(rows, [
    {title: "row", key: "name", get: (r) => r.name},
    {title: "level", key: "level", get: (r) => r.level || "-"},
    {title: "runs", key: "runs", get: (r) => r.runs},
    {title: "min ms", key: "min_ms", get: (r) => fix2(r.min_ms)},
    {title: "median ms", key: "median_ms", get: (r) => fix2(r.median_ms)},
    {title: "p90 ms", key: "p90_ms", get: (r) => fix2(r.p90_ms)},
    {title: "max ms", key: "max_ms", get: (r) => fix2(r.max_ms)},
    {title: "ratio", key: "ratio", get: (r) => fix2(r.ratio) + "x"},
    {title: "pool", key: "pool", get: (r) => r.pool ? (r.pool.size === 0 ? "none" : r.pool.hits + "/" + (r.pool.hits + r.pool.misses) + " ready") : ""},
    {title: "note", key: "note", cls: "note", get: (r) => r.error ? "FAILED: " + r.error : r.note},
  ], "latency-table"));
  // The chart: one line per row, every measured run a dot on a log
  // scale of milliseconds, the median a bar.
  const all = rows.flatMap((r) => r.samples_ms || []);
  if (all.length > 0) {
    const lo = Math.max(0.1, Math.min(...all)), hi = Math.max(...all) * 1.1;
    const W = 900, L = 190, H = 24 * rows.length + 40;
    const x = (v) => L + (W - L - 20) * (Math.log(Math.max(v, lo)) - Math.log(lo)) / (Math.log(hi) - Math.log(lo));
    const svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, id: "latency-chart"});
    rows.forEach((r, i) => {
      const y = 20 + 24 * i;
      svg.appendChild(el("text", {svg: 1, x: 4, y: y + 4}, r.name));
      svg.appendChild(el("line", {svg: 1, x1: L, x2: W - 20, y1: y, y2: y, stroke: "#eee"}));
      for (const v of r.samples_ms || []) svg.appendChild(el("circle", {svg: 1, cx: x(v), cy: y, r: 3, fill: "#3572b0", "fill-opacity": 0.5, "data-row": r.name, "data-col": "sample"}));
      if (!r.error) svg.appendChild(el("rect", {svg: 1, x: x(r.median_ms) - 1, y: y - 8, width: 2, height: 16, fill: "#c33", "data-row": r.name, "data-col": "median_mark"}));
    });
    for (const t of [0.1, 1, 10, 100, 1000, 10000, 100000]) {
      if (t < lo || t > hi) continue;
      svg.appendChild(el("line", {svg: 1, x1: x(t), x2: x(t), y1: 8, y2: H - 24, stroke: "#ccc"}));
      svg.appendChild(el("text", {svg: 1, x: x(t) - 8, y: H - 8}, t + " ms"));
    }
    document.getElementById("chart").appendChild(svg);
  }
}
if (page.sustained) {
  const box = document.getElementById("sustained");
  box.textContent = "";
  box.appendChild(table(page.sustained, [
    {title: "row", key: "name", get: (r) => r.name},
    {title: "clients", key: "clients", get: (r) => r.clients},
    {title: "runs", key: "runs", get: (r) => r.runs},
    {title: "errors", key: "errors", get: (r) => r.errors},
    {title: "runs/s", key: "runs_per_sec", get: (r) => r.runs_per_sec.toFixed(1)},
    {title: "p50 ms", key: "p50_ms", get: (r) => (r.p50_ns / 1e6).toFixed(1)},
    {title: "p99 ms", key: "p99_ms", get: (r) => (r.p99_ns / 1e6).toFixed(1)},
    {title: "ratio", key: "ratio", get: (r) => r.ratio.toFixed(2) + "x"},
  ], "sustained-table"));
  box.appendChild(el("p", {}, "Each row loaded for " + (page.sustained[0].duration_ns / 1e9) + " s; ratio = runs/s over the bare python3 start's under the same clients."));
}
const m = document.getElementById("machine");
m.appendChild(el("p", {id: "host"}, page.machine.host));
const vs = Object.entries(page.machine.versions || {}).map(([k, v]) => ({name: k, version: v}));
m.appendChild(table(vs, [{title: "component", key: "name", get: (r) => r.name}, {title: "version", key: "version", get: (r) => r.version}], "versions"));
for (const n of page.machine.notes || []) m.appendChild(el("p", {"class": "note"}, n));
</script>
</body></html>
`))
