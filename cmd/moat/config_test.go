package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func TestConfigBadFiles(t *testing.T) {
	cases := []struct{ file, want string }{
		// unknown keys, at each level of nesting
		{`{"levle":"subprocess"}`, `config: unknown key "levle"`},
		{`{"limits":{"wal_time":"5s"}}`, `config: unknown key "limits.wal_time"`},
		{`{"limits":{"WallTime":"5s"}}`, `config: unknown key "limits.WallTime"`},
		{`{"limits":{"Wall_Time":"5s"}}`, `config: unknown key "limits.Wall_Time"`},
		{`{"subprocess":{"pyhton":"/bin/python3"}}`, `config: unknown key "subprocess.pyhton"`},
		{`{"container":{"warm":1,"cold":true}}`, `config: unknown key "container.cold"`},
		{`{"gvisor":{"platfrom":"kvm"}}`, `config: unknown key "gvisor.platfrom"`},
		{`{"image":{"suit":"trixie"}}`, `config: unknown key "image.suit"`},
		{`{"server":{"max_code":"1MiB"}}`, `config: unknown key "server.max_code"`},
		{`{"server":{"Logger":null}}`, `config: unknown key "server.Logger"`},
		// keys the section types have that the file does not read
		{`{"subprocess":{"limits":{"memory":"1GiB"}}}`, `config: key "subprocess.limits" is not read: limits are set once, at the top level ("limits")`},
		{`{"microvm":{"limits":{}}}`, `config: key "microvm.limits" is not read: limits are set once, at the top level ("limits")`},
		{`{"microvm":{"image":{"packages":["python3-numpy"]}}}`, `config: key "microvm.image" is not read: the shared image is set once, at the top level ("image")`},
		{`{"server":{"tokens":[{"name":"a","token":"b"}]}}`, `config: key "server.tokens" is not read: tokens stay out of the config file: use "server.tokens_file"`},
		{`{"server":{"default_level":"gvisor"}}`, `config: key "server.default_level" is not read: the default level is the top-level "level"`},
		// a key twice
		{`{"limits":{"pids":3,"pids":4}}`, `config: key "limits.pids" is given twice`},
		// not one object
		{``, `config: the file is empty: want a JSON object such as {"level": "subprocess"}`},
		{`  `, `config: the file is empty: want a JSON object such as {"level": "subprocess"}`},
		{`[1]`, `config: the file is [1], not a JSON object`},
		{`{"level":"subprocess"} {"level":"gvisor"}`, `config: line 1, column 24: trailing data after the top-level object: a config file is one JSON object`},
		{`{"level":"subprocess"} x`, `config: line 1, column 24: trailing data after the top-level object: a config file is one JSON object`},
		{"{\"level\":\"subprocess\"}\n\n]", `config: line 3, column 1: trailing data after the top-level object: a config file is one JSON object`},
		{"{\n  \"level\": subprocess\n}", `config: line 2, column 12: invalid character 's' looking for beginning of value`},
		{`{"limits":{`, `config: the file ends inside the JSON object`},
		// wrong types
		{`{"level":1}`, `config: level: 1 is not a string`},
		{`{"limits":5}`, `config: limits: 5 is not an object`},
		{`{"limits":"big"}`, `config: limits: "big" is not an object`},
		{`{"limits":{"pids":"many"}}`, `config: limits.pids: "many" is not a whole number`},
		{`{"limits":{"pids":1.5}}`, `config: limits.pids: 1.5 is not a whole number`},
		{`{"limits":{"open_files":99999999999999999999}}`, `config: limits.open_files: 99999999999999999999 is not a whole number`},
		{`{"subprocess":{"python":["/bin/python3"]}}`, `config: subprocess.python: ["/bin/python3"] is not a string`},
		{`{"container":{"cpus":"two"}}`, `config: container.cpus: "two" is not a number`},
		{`{"container":{"allow_vulnerable_runtime":"yes"}}`, `config: container.allow_vulnerable_runtime: "yes" is not true or false`},
		{`{"image":{"packages":"python3"}}`, `config: image.packages: "python3" is not a list`},
		{`{"image":{"packages":["python3",7]}}`, `config: image.packages[1]: 7 is not a string`},
		{`{"server":{"log_json":1}}`, `config: server.log_json: 1 is not true or false`},
		// sizes
		{`{"limits":{"memory":"12XB"}}`, `config: limits.memory: "12XB" is not a size (use 256MiB, 1GiB)`},
		{`{"limits":{"memory":"MiB"}}`, `config: limits.memory: "MiB" is not a size (use 256MiB, 1GiB)`},
		{`{"limits":{"memory":"-1MiB"}}`, `config: limits.memory: "-1MiB" is negative`},
		{`{"limits":{"disk":-5}}`, `config: limits.disk: -5 is negative`},
		{`{"limits":{"disk":1.5}}`, `config: limits.disk: 1.5 is not a size (use 256MiB, 1GiB)`},
		{`{"limits":{"output":true}}`, `config: limits.output: true is not a size (use 256MiB, 1GiB)`},
		{`{"server":{"max_code_bytes":"lots"}}`, `config: server.max_code_bytes: "lots" is not a size (use 256MiB, 1GiB)`},
		// durations
		{`{"limits":{"wall_time":"10x"}}`, `config: limits.wall_time: "10x" is not a duration (use 10s, 500ms, 2m)`},
		{`{"limits":{"wall_time":10}}`, `config: limits.wall_time: 10 is not a duration (use "10s", "500ms", "2m")`},
		{`{"limits":{"cpu_time":"-3s"}}`, `config: limits.cpu_time: "-3s" is negative`},
		{`{"microvm":{"boot_timeout":"soon"}}`, `config: microvm.boot_timeout: "soon" is not a duration (use 10s, 500ms, 2m)`},
		// network sections (decoding only: the policy's checks are in resolve)
		{`{"network":{"allow":"pypi.org"}}`, `config: network.allow: "pypi.org" is not a list`},
		{`{"network":{"alow":["pypi.org"]}}`, `config: unknown key "network.alow"`},
		{`{"network":{"resolve":["a"]}}`, `config: network.resolve: ["a"] is not an object`},
		{`{"network":{"resolve":{"a.test":"1.2.3.4","a.test":"1.2.3.5"}}}`, `config: key "network.resolve.a.test" is given twice`},
		{`{"secrets":{"K":{"from_env":"K","host":["a.test"]}}}`, `config: unknown key "secrets.K.host"`},
		{`{"network_profiles":{"p":{"network":{"allow":[1]}}}}`, `config: network_profiles.p.network.allow[0]: 1 is not a string`},
		{`{"server":{"queue_wait":"a very long time indeed, more than forty bytes"}}`, `config: server.queue_wait: "a very long time indeed, more than f... is not a duration (use 10s, 500ms, 2m)`},
	}
	for _, c := range cases {
		_, err := decodeConfig([]byte(c.file))
		if err == nil {
			t.Errorf("%s: no error, want %q", c.file, c.want)
			continue
		}
		if got := strings.TrimSuffix(err.Error(), ": "+moat.ErrInvalid.Error()); got != c.want {
			t.Errorf("%s:\n got %q\nwant %q", c.file, got, c.want)
		}
		if !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("%s: %v does not wrap moat.ErrInvalid", c.file, err)
		}
	}
}

// goodConfig sets every section, and in it settings of every type.
const goodConfig = `{
  "level": "gvisor",
  "limits": {"wall_time": "5s", "cpu_time": "4s", "memory": "128MiB", "pids": 32,
             "file_size": "1MiB", "disk": 33554432, "output": "64KiB", "open_files": 128},
  "subprocess": {"hardening": "tutorial", "python": "/usr/local/bin/python3", "run_dir": "/run/x",
                 "uid_first": 3000000000, "uid_count": 10, "session_cpu_time": "1m", "warm": 2, "warm_max": 5},
  "container": {"image": "img:1", "runtime": "runc", "allow_vulnerable_runtime": true, "python": "/p",
                "uid_first": 5000, "uid_count": 6, "cpus": 0.5, "warm": -1, "warm_max": 2, "session_cpu_time": "2m", "driver": "runc", "recycle": true},
  "gvisor": {"runsc": "/r", "platform": "ptrace", "state_dir": "/s", "rootfs": "/fs", "warm": 3, "warm_max": 4, "recycle": true, "session_cpu_time": "2m"},
  "image": {"state_dir": "/i", "suite": "trixie", "packages": ["python3-numpy", "python3-pandas"],
            "mirror": "http://127.0.0.1/debian", "repository": "repo"},
  "microvm": {"state_dir": "/m",
              "qemu": "/q", "kernel_dir": "/k", "agent": "/a", "vcpus": 2, "accel": "tcg", "require_kvm": true, "copy_memory": true,
              "cold": true, "warm": 2, "warm_max": 3, "max_vms": 4, "session_cpu_time": "2m", "boot_timeout": "1m30s", "uid_first": 7000, "uid_count": 8},
  "server": {"addr": "127.0.0.1:9999", "tokens_file": "/t", "levels": "subprocess,gvisor", "state_dir": "/st",
             "max_code_bytes": "2MiB", "max_body_bytes": "3MiB", "max_file_bytes": "4MiB",
             "max_sessions_per_token": 5, "max_concurrent_runs": 6, "queue_length": 7, "queue_wait": "8s",
             "max_runs_per_token": 3, "queue_per_token": 4, "stream_buffer": "1MiB",
             "read_header_timeout": "1s", "read_timeout": "2s", "write_timeout": "3s", "conn_idle_timeout": "4s",
             "max_connections": 9, "session_ttl": "5m", "max_session_ttl": "6h", "idle_timeout": "7m",
             "sweep_interval": "2s", "shutdown_timeout": "9s", "log_json": true,
             "on_idle": "suspend", "max_snapshot_bytes_per_token": "2GiB",
             "e2b_addr": "127.0.0.1:3000", "e2b_templates": {"base": {"level": "gvisor", "network": "pypi"}}},
  "mcp": {"sessions": true, "interpreter": true},
  "agent": {"sessions": true, "interpreter": true},
  "network": {"allow": ["pypi.test", "*.example.com:443"], "resolve": {"pypi.test": "127.0.0.1"}},
  "secrets": {"API_KEY": {"from_env": "REAL_KEY", "hosts": ["api.example.com:443"], "in_url": true}},
  "network_profiles": {"pypi": {"network": {"allow": ["pypi.org"]}}}
}`

func TestConfigGoodFileRoundTrips(t *testing.T) {
	fc, err := decodeConfig([]byte(goodConfig))
	if err != nil {
		t.Fatal(err)
	}
	// Every key of the file must have landed in a field: none is zero.
	walkKeys("", reflect.ValueOf(&fc).Elem(), func(path string, v reflect.Value) {
		if v.IsZero() {
			t.Errorf("%s: the good file sets it, but it is zero after decoding", path)
		}
	})
	if fc.Limits.Memory != 128*moat.MiB || fc.Limits.Disk != 32*moat.MiB || time.Duration(fc.MicroVM.BootTimeout) != 90*time.Second ||
		fc.Server.MaxCodeBytes != 2*moat.MiB || fc.Container.CPUs != 0.5 || fc.Subprocess.UIDFirst != 3000000000 {
		t.Errorf("decoded wrong: %+v", fc)
	}
	// Back to JSON, less the keys the file does not read, and in again.
	out, err := json.Marshal(fc)
	if err != nil {
		t.Fatal(err)
	}
	var tree map[string]any
	json.Unmarshal(out, &tree)
	for key := range notRead {
		section, name, _ := strings.Cut(key, ".")
		delete(tree[section].(map[string]any), name)
	}
	out, _ = json.Marshal(tree)
	again, err := decodeConfig(out)
	if err != nil {
		t.Fatalf("the file moat writes back does not read: %v\n%s", err, out)
	}
	if !reflect.DeepEqual(fc, again) {
		t.Errorf("round trip changed the config:\n%+v\n%+v", fc, again)
	}
}

func TestConfigNullKeepsDefault(t *testing.T) {
	fc, err := decodeConfig([]byte(`{"level":null,"limits":{"memory":null},"server":null}`))
	if err != nil || !reflect.DeepEqual(fc, fileConfig{}) {
		t.Errorf("%+v, %v: null must leave the setting unset", fc, err)
	}
}

func writeConfig(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "moat.json")
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The CLI's error names the file, and is one line with exit status 2.
func TestConfigErrorFromTheCLI(t *testing.T) {
	p := writeConfig(t, `{"limits":{"wal_time":"5s"}}`)
	_, stderr, code := runMoat(t, "", "run", "--config", p, "-c", "print(1)")
	want := `moat: config: unknown key "limits.wal_time" (in ` + p + "): invalid input\n"
	if code != exitUsage || stderr != want {
		t.Errorf("exit %d, stderr %q; want 2, %q", code, stderr, want)
	}
}

func TestDeprecatedFlags(t *testing.T) {
	for _, c := range []struct {
		cmd, old, name, value string
		get                   func(fileConfig) string
	}{
		{"run", "timeout", "wall-time", "3s", func(fc fileConfig) string { return fc.Limits.WallTime.String() }},
		{"run", "cpu", "cpu-time", "2s", func(fc fileConfig) string { return fc.Limits.CPUTime.String() }},
		{"serve", "max-code", "max-code-bytes", "2MiB", func(fc fileConfig) string { return fc.Server.MaxCodeBytes.String() }},
		{"serve", "max-body", "max-body-bytes", "3MiB", func(fc fileConfig) string { return fc.Server.MaxBodyBytes.String() }},
		{"serve", "max-file", "max-file-bytes", "4MiB", func(fc fileConfig) string { return fc.Server.MaxFileBytes.String() }},
		{"serve", "max-sessions", "max-sessions-per-token", "5", func(fc fileConfig) string { return itoa(fc.Server.MaxSessionsPerToken) }},
		{"serve", "max-runs", "max-concurrent-runs", "6", func(fc fileConfig) string { return itoa(fc.Server.MaxConcurrentRuns) }},
		{"serve", "queue", "queue-length", "7", func(fc fileConfig) string { return itoa(fc.Server.QueueLength) }},
	} {
		// The old spelling sets the setting, overrides the file, and warns.
		file := writeConfig(t, `{"limits":{"wall_time":"9s","cpu_time":"9s"},"server":{"max_code_bytes":"9MiB","max_body_bytes":"9MiB","max_file_bytes":"9MiB","max_sessions_per_token":9,"max_concurrent_runs":9,"queue_length":9}}`)
		var stderr strings.Builder
		fs, sf := flagsOf(c.cmd)
		code, ok := parseFlags(fs, []string{"--config", file, "--" + c.old, c.value}, Stdio{Out: io.Discard, Err: &stderr})
		if !ok {
			t.Fatalf("--%s: exit %d: %s", c.old, code, stderr.String())
		}
		if want := "moat: --" + c.old + " is deprecated: use --" + c.name + "\n"; stderr.String() != want {
			t.Errorf("--%s: stderr %q, want %q", c.old, stderr.String(), want)
		}
		fc, err := sf.resolve()
		if err != nil {
			t.Fatal(err)
		}
		if got := c.get(fc); got != c.value {
			t.Errorf("--%s %s gave %s", c.old, c.value, got)
		}
		// The new one does not warn; both at once is refused.
		stderr.Reset()
		fs, _ = flagsOf(c.cmd)
		if _, ok := parseFlags(fs, []string{"--" + c.name, c.value}, Stdio{Out: io.Discard, Err: &stderr}); !ok || stderr.Len() != 0 {
			t.Errorf("--%s: ok %v, stderr %q", c.name, ok, stderr.String())
		}
		stderr.Reset()
		fs, _ = flagsOf(c.cmd)
		code, ok = parseFlags(fs, []string{"--" + c.name, c.value, "--" + c.old, c.value}, Stdio{Out: io.Discard, Err: &stderr})
		if ok || code != exitUsage || !strings.Contains(stderr.String(), " are the same setting: give one") || !strings.Contains(stderr.String(), "--"+c.name) {
			t.Errorf("--%s and --%s together: ok %v, exit %d, stderr %q", c.name, c.old, ok, code, stderr.String())
		}
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

// flagsOf returns the shared flags of a command, and for serve its own.
func flagsOf(cmd string) (*flag.FlagSet, *sandboxFlags) {
	fs := newFlagSet(cmd)
	sf := addSandboxFlags(fs)
	switch cmd {
	case "serve":
		addServerFlags(fs, &sf.flags.Server)
	case "mcp":
		addToolFlags(fs, &sf.flags.MCP, "connection")
	case "agent":
		addToolFlags(fs, &sf.flags.Agent, "task")
	}
	return fs, sf
}

func TestServeReadsTheServerSection(t *testing.T) {
	file := writeConfig(t, `{"server":{"addr":"127.0.0.1:9","max_concurrent_runs":3,"queue_length":4,"log_json":true,"tokens_file":"/x"}}`)
	fs, sf := flagsOf("serve")
	if err := fs.Parse([]string{"--config", file, "--queue-length", "5"}); err != nil {
		t.Fatal(err)
	}
	fc, err := sf.resolve()
	if err != nil {
		t.Fatal(err)
	}
	s := fc.Server
	if s.Addr != "127.0.0.1:9" || s.MaxConcurrentRuns != 3 || s.QueueLength != 5 || !s.LogJSON || s.TokensFile != "/x" {
		t.Errorf("server section %+v: want the file's settings, --queue-length over the file's", s)
	}
	// End to end: the tokens file named by the config is the one read.
	_, stderr, code := runMoat(t, "", "serve", "--config", writeConfig(t, `{"server":{"tokens_file":"/nonexistent/moat-tokens"}}`))
	if code != exitUsage || !strings.Contains(stderr, "/nonexistent/moat-tokens") {
		t.Errorf("exit %d, stderr %q: want the config's tokens file refused", code, stderr)
	}
}

func TestHelpSaysFlagsOverrideTheFile(t *testing.T) {
	for _, cmd := range []string{"run", "serve", "mcp", "agent", "bench", "attack"} {
		stdout, _, code := runMoat(t, "", cmd, "-h")
		if code != 0 || !strings.Contains(stdout, "A flag given overrides the same setting of the --config file") {
			t.Errorf("%s -h: exit %d, no word of flags overriding the file:\n%s", cmd, code, stdout)
		}
	}
}

// docRow is one row of a table in docs/config.md.
type docRow struct {
	key   string   // "" for a flag without a key
	flags []string // without dashes; the first is the setting's name
}

func readConfigDoc(t *testing.T) []docRow {
	t.Helper()
	f, err := os.Open("../../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []docRow
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "| ") || strings.HasPrefix(line, "| key ") {
			continue
		}
		cols := strings.Split(line, " | ")
		if len(cols) < 5 {
			t.Fatalf("docs/config.md: a row of %d columns, want key, flag, type, default, meaning: %s", len(cols), line)
		}
		var r docRow
		if k := strings.TrimPrefix(cols[0], "| "); k != "—" {
			r.key = strings.Trim(k, "`")
		}
		for _, part := range strings.Split(cols[1], "`") {
			if strings.HasPrefix(part, "-") {
				r.flags = append(r.flags, strings.TrimLeft(part, "-"))
			}
		}
		if r.key == "" && len(r.flags) == 0 {
			t.Errorf("docs/config.md: a row with neither key nor flag: %s", line)
		}
		rows = append(rows, r)
	}
	return rows
}

// docs/config.md lists every flag of every command that runs code and every
// key of the config file, and nothing else, and pairs each flag with its
// key. Adding a flag or a key without its row fails here.
func TestConfigDocMatchesFlagsAndKeys(t *testing.T) {
	rows := readConfigDoc(t)
	documented := map[string]bool{}     // flags, with dashes stripped
	keysOfFlag := map[string][]string{} // one flag may set a key of each command's section
	for _, r := range rows {
		for _, f := range r.flags {
			documented[f] = true
			if r.key != "" {
				keysOfFlag[f] = append(keysOfFlag[f], r.key)
			}
		}
	}
	keys := configKeys()
	allFlags := map[string]bool{}
	for _, cmd := range []string{"run", "serve", "mcp", "agent", "bench", "attack"} {
		stdout, _, code := runMoat(t, "", cmd, "-h")
		if code != 0 {
			t.Fatalf("%s -h: exit %d", cmd, code)
		}
		for _, line := range strings.Split(stdout, "\n") {
			if !strings.HasPrefix(line, "  -") {
				continue
			}
			name := strings.Fields(line)[0][1:]
			allFlags[name] = true
			if !documented[name] {
				t.Errorf("%s --%s has no row in docs/config.md", cmd, name)
			}
		}
		// Each flag that sets a key is documented with that key, and is
		// named for it.
		fs, sf := flagsOf(cmd)
		for flagName, key := range flagKeys(fs, &sf.flags) {
			for section, reader := range map[string]string{"server.": "serve", "mcp.": "mcp", "agent.": "agent"} {
				if cmd != reader && strings.HasPrefix(key, section) {
					t.Errorf("%s --%s sets %s, which only %s reads", cmd, flagName, key, reader)
				}
			}
			if got := keysOfFlag[flagName]; !slices.Contains(got, key) {
				t.Errorf("%s --%s sets %s, but docs/config.md pairs it with %q", cmd, flagName, key, got)
			}
			parts := strings.Split(key, ".")
			if want := strings.ReplaceAll(parts[len(parts)-1], "_", "-"); flagName != want {
				t.Errorf("--%s sets %s: its name must be --%s", flagName, key, want)
			}
		}
	}
	// moat image reads the config file's image section alone; its flags
	// that set a key are named for it.
	imageKeys := map[string]string{"packages": "image.packages", "state-dir": "image.state_dir"}
	for _, sub := range []string{"build", "status"} {
		stdout, _, code := runMoat(t, "", "image", sub, "-h")
		if code != 0 {
			t.Fatalf("image %s -h: exit %d", sub, code)
		}
		for _, line := range strings.Split(stdout, "\n") {
			if !strings.HasPrefix(line, "  -") {
				continue
			}
			name := strings.Fields(line)[0][1:]
			allFlags[name] = true
			if !documented[name] {
				t.Errorf("image %s --%s has no row in docs/config.md", sub, name)
			}
			if key, ok := imageKeys[name]; ok && !slices.Contains(keysOfFlag[name], key) {
				t.Errorf("image %s --%s sets %s, but docs/config.md pairs it with %q", sub, name, key, keysOfFlag[name])
			}
		}
	}
	for _, r := range rows {
		for _, f := range r.flags {
			if !allFlags[f] {
				t.Errorf("docs/config.md lists --%s, which no command has", f)
			}
		}
		if r.key != "" && !slices.Contains(keys, r.key) {
			t.Errorf("docs/config.md lists key %s, which the config file does not have", r.key)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !slices.ContainsFunc(rows, func(r docRow) bool { return r.key == k }) {
			t.Errorf("config key %s has no row in docs/config.md", k)
		}
	}
}

// The policy is checked when the flags and the file are resolved, and
// --allow-host adds to the file's list.
func TestNetworkFromFileAndFlags(t *testing.T) {
	resolve := func(file string, args ...string) (fileConfig, error) {
		t.Helper()
		fs := newFlagSet("run")
		fs.SetOutput(io.Discard)
		sf := addSandboxFlags(fs)
		if file != "" {
			path := filepath.Join(t.TempDir(), "moat.json")
			if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
				t.Fatal(err)
			}
			args = append([]string{"--config", path}, args...)
		}
		if err := fs.Parse(args); err != nil {
			return fileConfig{}, err
		}
		return sf.resolve()
	}
	fc, err := resolve("")
	if err != nil || fc.Network != nil {
		t.Fatalf("no file, no flag: network %+v, %v; want none", fc.Network, err)
	}
	fc, err = resolve("", "--allow-host", "pypi.org", "--allow-host", "*.example.com:443")
	if err != nil || fc.Network == nil || strings.Join(fc.Network.Allow, ",") != "pypi.org,*.example.com:443" {
		t.Fatalf("--allow-host twice: %+v, %v", fc.Network, err)
	}
	fc, err = resolve(`{"network":{"allow":["a.test"],"resolve":{"a.test":"127.0.0.1"}}}`, "--allow-host", "b.test")
	if err != nil || strings.Join(fc.Network.Allow, ",") != "a.test,b.test" || fc.Network.Resolve["a.test"] != "127.0.0.1" {
		t.Fatalf("file and flag: %+v, %v", fc.Network, err)
	}
	for _, c := range []struct {
		file string
		args []string
		want string
	}{
		{"", []string{"--allow-host", "10.0.0.1"}, "IP address"},
		{"", []string{"--allow-host", "a.test:99999"}, "port"},
		{`{"network":{"allow":["169.254.169.254"]}}`, nil, "IP address"},
		{`{"secrets":{"K":{"from_env":"K","hosts":["a.test"]}}}`, nil, "need a network"},
		{`{"network":{"allow":["a.test"]},"secrets":{"K":{"from_env":"K","hosts":["b.test"]}}}`, nil, "not allowed"},
		{`{"network_profiles":{"Bad Name":{"network":{"allow":["a.test"]}}}}`, nil, "not a profile name"},
		{`{"network_profiles":{"p":{}}}`, nil, "needs a network"},
		{`{"network_profiles":{"p":{"network":{"allow":["*"]}}}}`, nil, "network_profiles.p"},
	} {
		_, err := resolve(c.file, c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s %v: %v, want an error saying %q", c.file, c.args, err, c.want)
		}
	}
}
