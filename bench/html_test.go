package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// testPage is a page with every kind of row: the baseline, a pooled
// level, a failed row, and a sustained table.
func testPage() Page {
	rep := &Report{Rows: []Row{
		{Name: "python3", Runs: 3, Min: 15 * time.Millisecond, Median: 17250 * time.Microsecond, P90: 19 * time.Millisecond, Max: 19 * time.Millisecond, Ratio: 1, Note: "direct exec", Samples: msList(15, 19, 17)},
		{Name: "subprocess", Level: moat.LevelSubprocess, Runs: 3, Min: 8 * time.Millisecond, Median: 9 * time.Millisecond, P90: 12 * time.Millisecond, Max: 12 * time.Millisecond, Ratio: 9 / 17.25, Samples: msList(8, 9, 12),
			Pool: &PoolUse{Size: 1, Hits: 2, Misses: 1}, MinGap: 40 * time.Millisecond},
		{Name: "gvisor", Level: moat.LevelGVisor, Runs: 1, Err: "bench: gvisor: <script>alert(1)</script>", Samples: msList(300)},
	}}
	return Page{
		Latency: rep,
		Sustained: []Sustained{
			{Name: "python3", Clients: 8, Duration: 3 * time.Second, Runs: 120, RunsPerSec: 40.04, P50: 180 * time.Millisecond, P99: 400 * time.Millisecond, Ratio: 1},
			{Name: "subprocess", Level: moat.LevelSubprocess, Clients: 8, Duration: 3 * time.Second, Runs: 60, Errors: 1, RunsPerSec: 20.5, P50: 360 * time.Millisecond, P99: 812 * time.Millisecond, Ratio: 0.512},
		},
		Machine: Machine{Host: "2 cores, Debian 12", Versions: map[string]string{"moat": "test", "python3": "3.11.2"}, Notes: []string{"microvm: TCG"}, When: time.Date(2026, 12, 1, 21, 0, 0, 0, time.UTC)},
	}
}

// cell matches a rendered figure: <td data-row="R" data-col="C" ...>V</td>.
var cell = regexp.MustCompile(`<td data-row="([^"]*)" data-col="([^"]*)"[^>]*>([^<]*)</td>`)

// TestHTMLRendersTheJSON renders the page in headless Chromium (Debian's
// package, which setup installs) and checks that every figure the page
// shows is the one the JSON holds: the page's script draws them, so the
// rendered DOM, not the page's source, is what is read.
func TestHTMLRendersTheJSON(t *testing.T) {
	browser := ""
	for _, b := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(b); err == nil {
			browser = p
			break
		}
	}
	if browser == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("no chromium: scripts/setup.sh installs Debian's")
		}
		t.Skip("no chromium (scripts/setup.sh installs it)")
	}
	p := testPage()
	var page bytes.Buffer
	if err := WriteHTML(&page, p); err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(page.Bytes(), []byte("<script>alert")) {
		t.Fatal("a row's text reached the page as markup")
	}
	for _, ref := range []string{`src="http`, `href="http`, "@import", "url("} {
		if bytes.Contains(page.Bytes(), []byte(ref)) {
			t.Errorf("the page refers to something outside it: %s", ref)
		}
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "bench.html")
	if err := os.WriteFile(file, page.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
		"--user-data-dir="+filepath.Join(dir, "profile"), "--dump-dom", "file://"+file)
	cmd.Env = []string{"HOME=" + dir, "PATH=/usr/bin:/bin"}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	dom, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium: %v\n%s", err, stderr.Bytes())
	}
	// The latency table's cells, then the sustained table's, each from
	// its own part of the DOM (their rows have the same names).
	lat, sus, ok := bytes.Cut(dom, []byte(`id="sustained-table"`))
	if !ok {
		t.Fatalf("no sustained table in the rendered page:\n%s", dom)
	}
	got := map[string]string{}
	for _, m := range cell.FindAllSubmatch(lat, -1) {
		got[string(m[1])+"."+string(m[2])] = string(m[3])
	}
	for _, m := range cell.FindAllSubmatch(sus, -1) {
		got["s:"+string(m[1])+"."+string(m[2])] = string(m[3])
	}
	// What the JSON says, as the page should print it.
	var js struct {
		Latency struct {
			Rows []map[string]any `json:"rows"`
		} `json:"latency"`
		Sustained []map[string]any `json:"sustained"`
	}
	b, _ := json.Marshal(p)
	if err := json.Unmarshal(b, &js); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{}
	for _, r := range js.Latency.Rows {
		name := r["name"].(string)
		want[name+".runs"] = fmt.Sprint(r["runs"])
		for _, k := range []string{"min_ms", "median_ms", "p90_ms", "max_ms"} {
			want[name+"."+k] = fmt.Sprintf("%.2f", r[k].(float64))
		}
		want[name+".ratio"] = fmt.Sprintf("%.2fx", r["ratio"].(float64))
	}
	want["subprocess.pool"] = "2/3 ready"
	want["gvisor.note"] = "FAILED: bench: gvisor: &lt;script&gt;alert(1)&lt;/script&gt;"
	for _, r := range js.Sustained {
		name := r["name"].(string)
		want["s:"+name+".runs_per_sec"] = fmt.Sprintf("%.1f", r["runs_per_sec"].(float64))
		want["s:"+name+".p99_ms"] = fmt.Sprintf("%.1f", r["p99_ns"].(float64)/1e6)
		want["s:"+name+".ratio"] = fmt.Sprintf("%.2fx", r["ratio"].(float64))
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: the page shows %q, the JSON says %q", k, got[k], v)
		}
	}
	// The chart: a dot per measured run, a median mark per row that has one.
	if n := strings.Count(string(dom), `data-col="sample"`); n != 7 {
		t.Errorf("the chart has %d dots, want 7 (one per measured run)", n)
	}
	if n := strings.Count(string(dom), `data-col="median_mark"`); n != 2 {
		t.Errorf("the chart has %d median marks, want 2", n)
	}
	if !strings.Contains(string(dom), "microvm: TCG") || !strings.Contains(string(dom), "3.11.2") {
		t.Error("the machine and versions are not on the page")
	}
}
