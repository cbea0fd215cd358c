package main

import (
	"bytes"
	"encoding"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"regexp"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/microvm"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// fileConfig is the operator's config file (--config), JSON: the level, the
// limits, a section per level and one each for moat serve, moat mcp and
// moat agent. Every setting has one
// name: its key's last part, with "-" for "_", is its flag where it has one
// (limits.wall_time is --wall-time). A flag given on the command line
// overrides the file. docs/config.md lists every setting; a test keeps it
// in step with this type and the flags.
type fileConfig struct {
	Level  moat.Level  `json:"level,omitempty"`
	Limits moat.Limits `json:"limits"`
	// Image is the shared image the container, gvisor and microvm levels
	// run (its packages, suite, mirror), which `moat image build` makes
	// from the same section. The subprocess level runs the host's python3
	// and its packages instead.
	Image      image.Config      `json:"image"`
	Subprocess subprocess.Config `json:"subprocess"`
	Container  container.Config  `json:"container"`
	GVisor     gvisor.Config     `json:"gvisor"`
	MicroVM    microvm.Config    `json:"microvm"`
	Server     serverSection     `json:"server"`
	MCP        toolSection       `json:"mcp"`
	Agent      toolSection       `json:"agent"`
	// Network is the egress policy of every level's sandboxes: the hosts
	// their code may reach through moat's egress proxy. Absent means no
	// network at all. --allow-host adds to its allow list.
	Network *moat.Network `json:"network,omitempty"`
	// Secrets are the credentials the code uses but never holds, keyed
	// by the variable the code sees. They need Network.
	Secrets map[string]moat.Secret `json:"secrets,omitempty"`
	// NetworkProfiles are named policies (each a network and its
	// secrets) that moat serve's sessions and runs ask for by name, and
	// that each token may use only when its network_profiles list it.
	NetworkProfiles map[string]moat.Egress `json:"network_profiles,omitempty"`

	// proxyConfig, when set, is the egress proxy of every sandbox opened
	// from this config, in place of Network and Secrets: the attack
	// harness's own policy. Not read from the file.
	proxyConfig *egress.Config
	// logger gets the egress proxy's decisions. Nil means discard.
	logger *slog.Logger
	// registerer gets the egress proxy's counters. Nil means none.
	registerer prometheus.Registerer
}

// toolSection is what moat mcp and moat agent read from their sections: how
// their tools keep state between calls.
type toolSection struct {
	// Sessions runs the tools in one moat session per MCP connection (mcp)
	// or per task (agent), with the file tools: see mcpserver.Config and
	// agent.Config.
	Sessions bool `json:"sessions,omitempty"`
	// Interpreter keeps a live interpreter in that session. It needs
	// Sessions.
	Interpreter bool `json:"interpreter,omitempty"`
}

// serverSection is what moat serve reads: the server's own Config and the
// settings of the command around it.
type serverSection struct {
	server.Config
	// TokensFile holds the bearer tokens (see readTokens). Required by
	// moat serve; the tokens themselves are never in the config file.
	TokensFile string `json:"tokens_file,omitempty"`
	// Levels are the levels served: comma-separated names, or "all".
	// Empty means the top-level level.
	Levels string `json:"levels,omitempty"`
	// ShutdownTimeout is how long SIGTERM waits for runs in progress
	// before cancelling them. Zero means 30s.
	ShutdownTimeout moat.Duration `json:"shutdown_timeout,omitempty"`
	// LogJSON logs JSON lines instead of text.
	LogJSON bool `json:"log_json,omitempty"`
	// E2BAddr is where the E2B-compatible API (package e2b) listens, both
	// its sides on one listener. Empty means it is not served.
	E2BAddr string `json:"e2b_addr,omitempty"`
	// E2BTemplates are the E2B template names a sandbox may be created
	// from, each a level and a network profile. Nil means e2b's
	// DefaultTemplates (base and code-interpreter-v1 at the default
	// level, no network).
	E2BTemplates map[string]e2b.Template `json:"e2b_templates,omitempty"`
}

// Defaults of the serve settings that are the command's, not the server's.
const (
	defaultAddr            = "127.0.0.1:8080"
	defaultShutdownTimeout = moat.Duration(30 * time.Second)
)

// notRead are keys that the section types have but the config file does
// not take, with what to use instead. A level's limits are the top-level
// ones: a second copy per level would be silently overwritten.
var notRead = map[string]string{
	"subprocess.limits":    `limits are set once, at the top level ("limits")`,
	"container.limits":     `limits are set once, at the top level ("limits")`,
	"gvisor.limits":        `limits are set once, at the top level ("limits")`,
	"microvm.limits":       `limits are set once, at the top level ("limits")`,
	"microvm.image":        `the shared image is set once, at the top level ("image")`,
	"server.tokens":        `tokens stay out of the config file: use "server.tokens_file"`,
	"server.default_level": `the default level is the top-level "level"`,
}

// decodeConfig reads a config file strictly: one JSON object, nothing after
// it, every key known (case included) and given once, every value of its
// setting's type. Errors name the setting by its path, e.g.
// `config: unknown key "limits.wal_time"`, and wrap moat.ErrInvalid.
func decodeConfig(data []byte) (fileConfig, error) {
	var fc fileConfig
	dec := json.NewDecoder(bytes.NewReader(data))
	var raw json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		if err == io.EOF {
			return fc, configErr("the file is empty: want a JSON object such as {\"level\": \"subprocess\"}")
		}
		return fc, configErr("%s", syntaxMessage(data, err))
	}
	off := dec.InputOffset() // the end of the object
	if _, err := dec.Token(); err != io.EOF {
		for off < int64(len(data)) && strings.ContainsRune(" \t\r\n", rune(data[off])) {
			off++
		}
		line, col := position(data, off)
		return fc, configErr("line %d, column %d: trailing data after the top-level object: a config file is one JSON object", line, col)
	}
	if raw[0] != '{' {
		return fc, configErr("the file is %s, not a JSON object", shown(raw))
	}
	if err := decodeValue("", raw, reflect.ValueOf(&fc).Elem()); err != nil {
		return fileConfig{}, err
	}
	if err := checkZeroLimitKeys(raw); err != nil {
		return fileConfig{}, err
	}
	return fc, nil
}

func configErr(format string, args ...any) error {
	return fmt.Errorf("config: "+format+": %w", append(args, moat.ErrInvalid)...)
}

// syntaxMessage says where JSON stopped parsing, as line and column.
func syntaxMessage(data []byte, err error) string {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		line, col := position(data, se.Offset-1) // Offset is past the bad byte
		return fmt.Sprintf("line %d, column %d: %v", line, col, se)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return "the file ends inside the JSON object"
	}
	return err.Error()
}

// position is the line and column, from 1, of the byte at off.
func position(data []byte, off int64) (line, col int) {
	line, col = 1, 1
	for _, c := range data[:min(int(off), len(data))] {
		col++
		if c == '\n' {
			line, col = line+1, 1
		}
	}
	return line, col
}

// shown is a JSON value as an error message quotes it: compact, and cut
// when long.
func shown(raw json.RawMessage) string {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		b.Reset()
		b.Write(raw)
	}
	s := b.String()
	if len(s) > 40 {
		s = s[:37] + "..."
	}
	return s
}

var (
	bytesType    = reflect.TypeFor[moat.Bytes]()
	durationType = reflect.TypeFor[moat.Duration]()
)

// decodeValue decodes raw into v (addressable), the setting at path.
func decodeValue(path string, raw json.RawMessage, v reflect.Value) error {
	raw = bytes.TrimSpace(raw)
	if string(raw) == "null" {
		return nil // as encoding/json: the setting keeps its value
	}
	isString := raw[0] == '"'
	switch v.Type() {
	case bytesType:
		var n int64
		if !isString {
			if json.Unmarshal(raw, &n) != nil {
				return configErr("%s: %s is not a size (use 256MiB, 1GiB)", path, shown(raw))
			}
			if n < 0 {
				return configErr("%s: %s is negative", path, shown(raw))
			}
			v.SetInt(n)
			return nil
		}
		var s string
		json.Unmarshal(raw, &s)
		if strings.HasPrefix(strings.TrimSpace(s), "-") {
			return configErr("%s: %s is negative", path, shown(raw))
		}
		b, err := moat.ParseBytes(s)
		if err != nil {
			return configErr("%s: %s is not a size (use 256MiB, 1GiB)", path, shown(raw))
		}
		v.SetInt(int64(b))
		return nil
	case durationType:
		var s string
		if !isString || json.Unmarshal(raw, &s) != nil {
			return configErr("%s: %s is not a duration (use \"10s\", \"500ms\", \"2m\")", path, shown(raw))
		}
		d, err := time.ParseDuration(strings.TrimSpace(s))
		if err != nil {
			return configErr("%s: %s is not a duration (use 10s, 500ms, 2m)", path, shown(raw))
		}
		if d < 0 {
			return configErr("%s: %s is negative", path, shown(raw))
		}
		v.SetInt(int64(d))
		return nil
	}
	p := v.Addr().Interface()
	switch p.(type) {
	case json.Unmarshaler, encoding.TextUnmarshaler:
		if err := json.Unmarshal(raw, p); err != nil {
			return configErr("%s: %s: %v", path, shown(raw), err)
		}
		return nil
	}
	switch v.Kind() {
	case reflect.Struct:
		if raw[0] != '{' {
			return configErr("%s: %s is not an object", path, shown(raw))
		}
		return decodeObject(path, raw, v)
	case reflect.String:
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return configErr("%s: %s is not a string", path, shown(raw))
		}
		v.SetString(s)
	case reflect.Bool:
		var b bool
		if json.Unmarshal(raw, &b) != nil {
			return configErr("%s: %s is not true or false", path, shown(raw))
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		var n int64
		if json.Unmarshal(raw, &n) != nil || v.OverflowInt(n) {
			return configErr("%s: %s is not a whole number", path, shown(raw))
		}
		v.SetInt(n)
	case reflect.Float32, reflect.Float64:
		var f float64
		if json.Unmarshal(raw, &f) != nil {
			return configErr("%s: %s is not a number", path, shown(raw))
		}
		v.SetFloat(f)
	case reflect.Pointer:
		if v.IsNil() {
			v.Set(reflect.New(v.Type().Elem()))
		}
		return decodeValue(path, raw, v.Elem())
	case reflect.Map:
		if v.Type().Key().Kind() != reflect.String {
			return fmt.Errorf("config: %s: a %v cannot be read from a config file", path, v.Type())
		}
		if raw[0] != '{' {
			return configErr("%s: %s is not an object", path, shown(raw))
		}
		m := reflect.MakeMap(v.Type())
		err := eachMember(path, raw, func(key string, val json.RawMessage) error {
			k := reflect.ValueOf(key).Convert(v.Type().Key())
			if m.MapIndex(k).IsValid() {
				return configErr("key %q is given twice", join(path, key))
			}
			e := reflect.New(v.Type().Elem()).Elem()
			if err := decodeValue(join(path, key), val, e); err != nil {
				return err
			}
			m.SetMapIndex(k, e)
			return nil
		})
		if err != nil {
			return err
		}
		v.Set(m)
	case reflect.Slice:
		var items []json.RawMessage
		if raw[0] != '[' || json.Unmarshal(raw, &items) != nil {
			return configErr("%s: %s is not a list", path, shown(raw))
		}
		s := reflect.MakeSlice(v.Type(), len(items), len(items))
		for i, item := range items {
			if err := decodeValue(fmt.Sprintf("%s[%d]", path, i), item, s.Index(i)); err != nil {
				return err
			}
		}
		v.Set(s)
	default:
		return fmt.Errorf("config: %s: a %v cannot be read from a config file", path, v.Type())
	}
	return nil
}

// decodeObject decodes the JSON object raw into the struct v, key by key.
func decodeObject(path string, raw json.RawMessage, v reflect.Value) error {
	fields := jsonFields(v.Type())
	seen := map[string]bool{}
	return eachMember(path, raw, func(key string, val json.RawMessage) error {
		full := join(path, key)
		if why, ok := notRead[full]; ok {
			return configErr("key %q is not read: %s", full, why)
		}
		idx, ok := fields[key]
		if !ok {
			return configErr("unknown key %q", full)
		}
		if seen[key] {
			return configErr("key %q is given twice", full)
		}
		seen[key] = true
		return decodeValue(full, val, v.FieldByIndex(idx))
	})
}

// eachMember calls fn with each member of the JSON object raw, in order,
// and stops at the first error.
func eachMember(path string, raw json.RawMessage, fn func(key string, val json.RawMessage) error) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.Token() // {
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return configErr("%s: %v", path, err)
		}
		var val json.RawMessage
		if err := dec.Decode(&val); err != nil {
			return configErr("%s: %v", path, err)
		}
		if err := fn(tok.(string), val); err != nil {
			return err
		}
	}
	return nil
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// jsonFields maps the JSON names of t's fields, embedded structs' fields
// included, to their index. Fields tagged "-" and unexported fields have
// none; an outer field hides an embedded one of the same name.
func jsonFields(t reflect.Type) map[string][]int {
	out := map[string][]int{}
	var walk func(t reflect.Type, index []int)
	walk = func(t reflect.Type, index []int) {
		var embedded [][]int
		for i := range t.NumField() {
			f := t.Field(i)
			idx := append(append([]int(nil), index...), i)
			tag := f.Tag.Get("json")
			if f.Anonymous && tag == "" && f.Type.Kind() == reflect.Struct {
				embedded = append(embedded, idx)
				continue
			}
			if !f.IsExported() || tag == "-" {
				continue
			}
			name, _, _ := strings.Cut(tag, ",")
			if name == "" {
				name = f.Name
			}
			if _, ok := out[name]; !ok {
				out[name] = idx
			}
		}
		for _, idx := range embedded {
			walk(t.FieldByIndex(idx).Type, idx)
		}
	}
	walk(t, nil)
	return out
}

// walkKeys calls fn for every setting a config file may set in the
// struct v: its path ("limits.wall_time") and its value.
func walkKeys(path string, v reflect.Value, fn func(path string, v reflect.Value)) {
	t := v.Type()
	if t.Kind() == reflect.Pointer && t.Elem().Kind() == reflect.Struct {
		// A section that is absent unless given (network): its keys are
		// those of a fresh value.
		if v.IsNil() {
			v = reflect.New(t.Elem())
		}
		v, t = v.Elem(), t.Elem()
	}
	if t.Kind() != reflect.Struct || t == bytesType || t == durationType {
		fn(path, v)
		return
	}
	for name, idx := range jsonFields(t) {
		full := join(path, name)
		if _, ok := notRead[full]; !ok {
			walkKeys(full, v.FieldByIndex(idx), fn)
		}
	}
}

// configKeys lists every key a config file may set, as paths
// ("limits.wall_time").
func configKeys() []string {
	var out []string
	walkKeys("", reflect.ValueOf(&fileConfig{}).Elem(), func(path string, _ reflect.Value) { out = append(out, path) })
	return out
}

// flagKeys maps each flag of fs that sets a setting of the config file
// held at fc to that setting's key: the flag's value is the setting's
// field.
func flagKeys(fs *flag.FlagSet, fc *fileConfig) map[string]string {
	byAddr := map[uintptr]string{}
	walkKeys("", reflect.ValueOf(fc).Elem(), func(path string, v reflect.Value) {
		byAddr[v.Addr().Pointer()] = path
	})
	out := map[string]string{}
	fs.VisitAll(func(f *flag.Flag) {
		if p := reflect.ValueOf(f.Value); p.Kind() == reflect.Pointer {
			if key, ok := byAddr[p.Pointer()]; ok && canonical(f) == f.Name {
				out[f.Name] = key
			}
		}
	})
	return out
}

// setKey copies the setting at key from src to dst.
func setKey(dst, src *fileConfig, key string) {
	d, s := reflect.ValueOf(dst).Elem(), reflect.ValueOf(src).Elem()
	for _, name := range strings.Split(key, ".") {
		idx := jsonFields(d.Type())[name]
		d, s = d.FieldByIndex(idx), s.FieldByIndex(idx)
	}
	d.Set(s)
}

// profileName is what a network profile may be called.
var profileName = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`)

// egress is the top-level network policy and secrets.
func (fc fileConfig) egress() moat.Egress {
	return moat.Egress{Network: fc.Network, Secrets: fc.Secrets}
}

// validateEgress checks the top-level policy and every profile.
func (fc fileConfig) validateEgress() error {
	if err := fc.egress().Validate(); err != nil {
		return configErr("%s", strings.TrimSuffix(strings.TrimPrefix(err.Error(), "moat: "), ": "+moat.ErrInvalid.Error()))
	}
	for name, p := range fc.NetworkProfiles {
		if !profileName.MatchString(name) {
			return configErr("network_profiles: %q is not a profile name (lower-case letters, digits, - and _)", name)
		}
		if p.Network == nil {
			return configErr("network_profiles.%s: a profile needs a network section", name)
		}
		if err := p.Validate(); err != nil {
			return configErr("network_profiles.%s: %s", name, strings.TrimSuffix(strings.TrimPrefix(err.Error(), "moat: "), ": "+moat.ErrInvalid.Error()))
		}
	}
	return nil
}
