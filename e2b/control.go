// The control plane: E2B's REST API for making, listing, pausing,
// resuming and killing sandboxes, keyed by X-API-KEY.

package e2b

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
)

// defaultTimeout is a sandbox's time to live when the create names none,
// as E2B's.
const defaultTimeout = 300 * time.Second

func (s *Server) controlRoutes() http.Handler {
	mux := http.NewServeMux()
	handle := func(pattern string, h func(w http.ResponseWriter, r *http.Request, owner string) error) {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			owner, ok := s.owner(r)
			if !ok {
				s.writeError(w, r, errorf(http.StatusUnauthorized, "missing or unknown X-API-KEY"))
				return
			}
			if err := h(w, r, owner); err != nil {
				s.writeError(w, r, err)
			}
		})
	}
	handle("POST /sandboxes", s.handleCreate)
	handle("POST /v2/sandboxes", s.handleCreate)
	handle("GET /sandboxes", s.handleListV1)
	handle("GET /v2/sandboxes", s.handleList)
	handle("GET /sandboxes/{id}", s.handleGet)
	handle("DELETE /sandboxes/{id}", s.handleKill)
	handle("POST /sandboxes/{id}/timeout", s.handleTimeout)
	handle("POST /sandboxes/{id}/pause", s.handlePause)
	handle("POST /v2/sandboxes/{id}/connect", s.handleConnect)
	handle("POST /sandboxes/{id}/connect", s.handleConnect)
	handle("POST /sandboxes/{id}/resume", s.handleConnect)
	// The rest of E2B's API (snapshots, forks, templates, volumes, logs)
	// is not implemented: 501, which the SDKs show with its message, not
	// a 404 they would take for a missing sandbox.
	handle("/", func(w http.ResponseWriter, r *http.Request, _ string) error {
		return errorf(http.StatusNotImplemented, "%s %s is not served by moat (see docs/e2b.md)", r.Method, r.URL.Path)
	})
	return mux
}

// createBody is what the SDKs send to POST /v2/sandboxes. Fields moat does
// not map are refused when set, never ignored.
type createBody struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Secure              *bool             `json:"secure"`
	AutoPause           *bool             `json:"autoPause"`
	// Network is E2B's egress rules, mapped onto the template's network
	// profile by checkNetwork.
	Network json.RawMessage `json:"network"`
	// Not mapped: refused when present and not null.
	MCP          json.RawMessage `json:"mcp"`
	IAM          json.RawMessage `json:"iam"`
	VolumeMounts json.RawMessage `json:"volumeMounts"`
	AutoResume   json.RawMessage `json:"autoResume"`
}

// sandboxJSON is a sandbox as E2B's API shows it.
type sandboxJSON struct {
	TemplateID         string            `json:"templateID"`
	SandboxID          string            `json:"sandboxID"`
	ClientID           string            `json:"clientID"`
	EnvdVersion        string            `json:"envdVersion"`
	EnvdAccessToken    string            `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string           `json:"trafficAccessToken"`
	Domain             *string           `json:"domain"`
	StartedAt          *time.Time        `json:"startedAt,omitempty"`
	EndAt              *time.Time        `json:"endAt,omitempty"`
	Metadata           map[string]string `json:"metadata,omitempty"`
	State              string            `json:"state,omitempty"`
	CPUCount           int               `json:"cpuCount"`
	MemoryMB           int               `json:"memoryMB"`
	DiskSizeMB         int               `json:"diskSizeMB"`
	VolumeMounts       []any             `json:"volumeMounts"`
}

func (s *Server) view(sb *sandbox, info server.SessionInfo, withAccess bool) sandboxJSON {
	v := sandboxJSON{
		TemplateID: sb.template, SandboxID: sb.id, ClientID: "moat", EnvdVersion: EnvdVersion,
		StartedAt: &sb.started, EndAt: &info.ExpiresAt, Metadata: sb.metadata, VolumeMounts: []any{},
		State: "running",
	}
	if info.State != "running" {
		v.State = "paused"
	}
	if withAccess {
		v.EnvdAccessToken = sb.access
		v.TrafficAccessToken = &sb.traffic
	}
	if v.Metadata == nil {
		v.Metadata = map[string]string{}
	}
	return v
}

func decodeBody(r *http.Request, v any) error {
	if r.ContentLength == 0 {
		return nil
	}
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	if err := dec.Decode(v); err != nil && !errors.Is(err, io.EOF) {
		return errorf(http.StatusBadRequest, "body: %v", err)
	}
	return nil
}

// networkBody is E2B's network settings of a create (the SDK's
// `network`). Fields moat does not map are refused when set; an unknown
// field is refused too.
type networkBody struct {
	AllowOut           []string `json:"allowOut"`
	DenyOut            []string `json:"denyOut"`
	AllowPublicTraffic *bool    `json:"allowPublicTraffic"`

	Rules           json.RawMessage `json:"rules"`
	EgressProxy     json.RawMessage `json:"egressProxy"`
	MaskRequestHost json.RawMessage `json:"maskRequestHost"`
	HTTPSPorts      json.RawMessage `json:"httpsPorts"`
}

// allTraffic are the addresses E2B's ALL_TRAFFIC (and its IPv6 twin) name
// in denyOut: nothing but allowOut is reached.
var allTraffic = map[string]bool{"0.0.0.0/0": true, "::/0": true}

// checkNetwork maps what a create asks of the network onto the template's
// network policy (its profile's, or Config.Policy for a template without
// one), which is all a sandbox ever gets: the request chooses no policy.
// It may ask for less than the policy allows only where moat can give
// that, and never gets more than it asked:
//
//   - A policy without network satisfies any request: the code reaches
//     nothing, less than any rule allows.
//   - allowInternetAccess false, or denyOut with ALL_TRAFFIC, asks that
//     nothing but allowOut be reached: every host of the policy must be
//     one that allowOut allows (a host name, "*.domain", with a port or
//     not), else 400, naming the host.
//   - denyOut of other addresses, with the rest allowed, cannot be kept by
//     a proxy that reaches hosts by name: 400 where the template has
//     network.
//   - allowPublicTraffic (inbound traffic without the token) is moot:
//     moat serves no sandbox port but envd's and the interpreter's, and
//     both always want the token.
func (s *Server) checkNetwork(b createBody, tpl Template) error {
	denyAll := b.AllowInternetAccess != nil && !*b.AllowInternetAccess
	var nb networkBody
	if present(b.Network) {
		dec := json.NewDecoder(bytes.NewReader(b.Network))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&nb); err != nil {
			return errorf(http.StatusBadRequest, "network: %v", err)
		}
		for name, m := range map[string]json.RawMessage{"rules": nb.Rules, "egressProxy": nb.EgressProxy, "maskRequestHost": nb.MaskRequestHost, "httpsPorts": nb.HTTPSPorts} {
			if present(m) {
				return errorf(http.StatusBadRequest, "network.%s is not supported by moat: the network is the operator's profile's (template %q)", name, b.TemplateID)
			}
		}
	}
	var deny []string
	for _, d := range nb.DenyOut {
		if allTraffic[d] {
			denyAll = true
		} else {
			deny = append(deny, d)
		}
	}
	// What the template's sandboxes reach: the policy of its profile, or
	// the one of the sandboxes without a profile.
	pol, known, what := s.cfg.Policy, true, "the server's network (no profile)"
	if tpl.Network != "" {
		pol, known = s.cfg.Sessions.ProfilePolicy(tpl.Network)
		what = fmt.Sprintf("network profile %q", tpl.Network)
	}
	if known && !pol.Enabled() {
		return nil
	}
	if !denyAll {
		if len(deny) > 0 {
			return errorf(http.StatusBadRequest, "network.denyOut %v: template %q reaches hosts by name through moat's proxy (%s), which cannot deny addresses and allow the rest: deny ALL_TRAFFIC and allow the hosts you want", deny, b.TemplateID, what)
		}
		return nil
	}
	if !known {
		return errorf(http.StatusBadRequest, "network: template %q's %s has no policy to compare with allowOut: use a template without network", b.TemplateID, what)
	}
	asked := &moat.Network{Allow: nb.AllowOut}
	for _, h := range pol.Network.Allow {
		if !asked.AllowsAll(h) {
			return errorf(http.StatusBadRequest, "network: template %q's %s reaches %s, which allowOut %v does not allow: moat gives a template's network whole: allow that host too, or use a template with less network", b.TemplateID, what, h, nb.AllowOut)
		}
	}
	return nil
}

func present(m json.RawMessage) bool { return len(m) > 0 && string(m) != "null" }

// jsonNames are the JSON names of the fields of the struct type t.
func jsonNames(t reflect.Type) []string {
	var out []string
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		out = append(out, name)
	}
	return out
}

var (
	createFields  = jsonNames(reflect.TypeFor[createBody]())
	networkFields = jsonNames(reflect.TypeFor[networkBody]())
)

// nearName folds a JSON name to what its spellings share: lower case,
// without '_' and '-' ("allowInternetAccess", "allow_internet_access").
func nearName(s string) string {
	return strings.NewReplacer("_", "", "-", "").Replace(strings.ToLower(s))
}

// checkKeys refuses a JSON object (a create's body, or its network) that
// names one of fields twice, as encoding/json matches a name (case aside:
// it keeps the last, where another reader may keep the first), or in a
// spelling that encoding/json does not match and so would ignore:
// "allowInternetAccess" for "allow_internet_access" would give the
// template's network to a create that asked for none. Names unknown in
// every spelling are let through, as the SDKs send some moat has no use
// for. What is not an object is left to the decoder's word.
func checkKeys(raw []byte, where string, fields []string) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		k, _ := tok.(string)
		var v json.RawMessage
		if dec.Decode(&v) != nil {
			return nil
		}
		for _, f := range fields {
			switch {
			case strings.EqualFold(k, f):
				if seen[f] {
					return errorf(http.StatusBadRequest, "%s: %q given twice", where, f)
				}
				seen[f] = true
				if f == "network" && where == "body" {
					if err := checkKeys(v, "network", networkFields); err != nil {
						return err
					}
				}
			case nearName(k) == nearName(f):
				return errorf(http.StatusBadRequest, "%s: %q is not a field moat reads: did you mean %q?", where, k, f)
			}
		}
	}
	return nil
}

func (s *Server) handleCreate(w http.ResponseWriter, r *http.Request, owner string) error {
	var b createBody
	raw, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		return errorf(http.StatusBadRequest, "body: %v", err)
	}
	if err := checkKeys(raw, "body", createFields); err != nil {
		return err
	}
	r.Body = io.NopCloser(bytes.NewReader(raw))
	if err := decodeBody(r, &b); err != nil {
		return err
	}
	if b.TemplateID == "" {
		b.TemplateID = "base"
	}
	tpl, ok := s.cfg.Templates[b.TemplateID]
	if !ok {
		names := slices.Sorted(func(yield func(string) bool) {
			for n := range s.cfg.Templates {
				if !yield(n) {
					return
				}
			}
		})
		return errorf(http.StatusBadRequest, "template %q is not one this moat serves (%s)", b.TemplateID, strings.Join(names, ", "))
	}
	for name, m := range map[string]json.RawMessage{"mcp": b.MCP, "iam": b.IAM, "volumeMounts": b.VolumeMounts, "autoResume": b.AutoResume} {
		if present(m) {
			return errorf(http.StatusBadRequest, "%s is not supported by moat (template %q)", name, b.TemplateID)
		}
	}
	if err := checkKV("metadata", b.Metadata, maxMetadataBytes); err != nil {
		return err
	}
	if err := checkKV("envVars", b.EnvVars, maxEnvBytes); err != nil {
		return err
	}
	if b.AutoPause != nil && *b.AutoPause {
		return errorf(http.StatusBadRequest, "onTimeout pause is not supported by moat: a sandbox ends at its timeout; pause it before")
	}
	// The grant first: what checkNetwork says of a profile's hosts is for
	// those who may use it (GET /v1/network_profiles shows them to no one
	// else).
	if tpl.Network != "" && !s.cfg.Sessions.Granted(owner, tpl.Network) {
		return errorf(http.StatusForbidden, "template %q: its network profile is not one this key's token may use", b.TemplateID)
	}
	if err := s.checkNetwork(b, tpl); err != nil {
		return err
	}
	ttl := defaultTimeout
	if b.Timeout != nil {
		var err error
		if ttl, err = s.timeout(*b.Timeout); err != nil {
			return err
		}
	}
	rec := sandboxRecord{Kind: frontKind, Template: b.TemplateID, Metadata: b.Metadata, Envs: b.EnvVars,
		Interpreter: tpl.Interpreter, Nonce: newNonce(), StartedAt: time.Now().UTC()}
	front, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("e2b: %w", err)
	}
	if len(front) > server.MaxFrontBytes {
		return errorf(http.StatusBadRequest, "metadata and envVars of %d bytes: at most %d", len(front), server.MaxFrontBytes)
	}
	info, err := s.cfg.Sessions.CreateSession(r.Context(), owner, server.SessionSpec{
		Level: tpl.Level, Network: tpl.Network, TTL: moat.Duration(ttl), IdleTimeout: moat.Duration(ttl), Interpreter: tpl.Interpreter,
		Front: front,
	})
	if err != nil {
		return err
	}
	sb, ok := s.newSandbox(info, rec)
	if !ok { // the owner's key is known: it was just checked
		s.cfg.Sessions.EndSession(owner, info.ID)
		return fmt.Errorf("e2b: no key for %s", owner)
	}
	s.prune(owner)
	s.mu.Lock()
	s.sandboxes[sb.id] = sb
	s.mu.Unlock()
	s.log.Info("e2b: sandbox created", "sandbox", sb.id, "owner", owner, "template", b.TemplateID, "level", info.Level, "network", info.Network, "timeout", ttl)
	writeJSON(w, http.StatusCreated, s.view(sb, info, true))
	return nil
}

// Caps on what a create keeps for the sandbox's life: its metadata, which
// every get and list answers (where JSON's escapes can make a byte six),
// and its envVars, which every command's code carries. Keys and values
// together.
const (
	maxMetadataBytes = 16 << 10
	maxEnvBytes      = 64 << 10
)

// checkKV refuses a map of more than max bytes of keys and values, and
// names or values that no environment (for envVars) or header could hold:
// empty names, "=" in a name, NUL anywhere.
func checkKV(field string, m map[string]string, max int) error {
	n := 0
	for k, v := range m {
		n += len(k) + len(v)
		if k == "" || strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0) || (field == "envVars" && strings.ContainsRune(k, '=')) {
			return errorf(http.StatusBadRequest, "%s: the name %.64q or its value is not one moat keeps (empty, NUL, or \"=\" in a variable's name)", field, k)
		}
	}
	if n > max {
		return errorf(http.StatusBadRequest, "%s: %d bytes of names and values, over moat's cap of %d", field, n, max)
	}
	return nil
}

// timeout returns a request's timeout in seconds as a duration: above
// zero and at most the server's maximum TTL, or a 400. The bound is
// checked on the seconds, before they are multiplied, so that no huge
// number wraps around to a small one.
func (s *Server) timeout(secs int64) (time.Duration, error) {
	max := s.cfg.Sessions.MaxSessionTTL()
	if secs <= 0 || secs > int64(max/time.Second) {
		return 0, errorf(http.StatusBadRequest, "timeout %ds must be above zero and at most %v", secs, max)
	}
	return time.Duration(secs) * time.Second, nil
}

// prune forgets owner's sandboxes whose sessions have ended (expired, or
// deleted through moat's own API), so that what this API keeps stays
// bounded by the token's session cap.
func (s *Server) prune(owner string) {
	s.mu.Lock()
	var mine []*sandbox
	for _, sb := range s.sandboxes {
		if sb.owner == owner {
			mine = append(mine, sb)
		}
	}
	s.mu.Unlock()
	for _, sb := range mine {
		s.lookupSandbox(sb.id) // forgets it if its session is gone
	}
}

// mine returns owner's sandbox named in the path: another owner's is not
// found, as a missing one.
func (s *Server) mine(r *http.Request, owner string) (*sandbox, server.SessionInfo, error) {
	id := r.PathValue("id")
	sb, info, ok := s.lookupSandbox(id)
	if !ok || sb.owner != owner {
		return nil, server.SessionInfo{}, errorf(http.StatusNotFound, "sandbox %q not found", id)
	}
	return sb, info, nil
}

func (s *Server) handleGet(w http.ResponseWriter, r *http.Request, owner string) error {
	sb, info, err := s.mine(r, owner)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, s.view(sb, info, true))
	return nil
}

func (s *Server) handleKill(w http.ResponseWriter, r *http.Request, owner string) error {
	sb, _, err := s.mine(r, owner)
	if err != nil {
		return err
	}
	s.forget(sb)
	if err := s.cfg.Sessions.EndSession(owner, sb.id); err != nil {
		return err
	}
	s.log.Info("e2b: sandbox killed", "sandbox", sb.id, "owner", owner)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

type timeoutBody struct {
	Timeout *int64 `json:"timeout"`
}

func (s *Server) handleTimeout(w http.ResponseWriter, r *http.Request, owner string) error {
	sb, _, err := s.mine(r, owner)
	if err != nil {
		return err
	}
	var b timeoutBody
	if err := decodeBody(r, &b); err != nil {
		return err
	}
	if b.Timeout == nil {
		return errorf(http.StatusBadRequest, "timeout is missing")
	}
	ttl, err := s.timeout(*b.Timeout)
	if err != nil {
		return err
	}
	if _, err := s.cfg.Sessions.ExtendSession(owner, sb.id, ttl); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) handlePause(w http.ResponseWriter, r *http.Request, owner string) error {
	sb, info, err := s.mine(r, owner)
	if err != nil {
		return err
	}
	if info.State != "running" {
		return errorf(http.StatusConflict, "sandbox %s is already paused", sb.id)
	}
	if n := sb.procs.count(); n > 0 {
		return errorf(http.StatusConflict, "sandbox %s has %d commands running: moat pauses a sandbox between commands", sb.id, n)
	}
	if err := s.cfg.Sessions.SuspendSession(r.Context(), owner, sb.id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) handleConnect(w http.ResponseWriter, r *http.Request, owner string) error {
	sb, info, err := s.mine(r, owner)
	if err != nil {
		return err
	}
	var b timeoutBody
	if err := decodeBody(r, &b); err != nil {
		return err
	}
	var ttl time.Duration
	if b.Timeout != nil {
		if ttl, err = s.timeout(*b.Timeout); err != nil {
			return err
		}
	}
	status := http.StatusOK
	if info.State != "running" {
		if err := s.cfg.Sessions.ResumeSession(r.Context(), owner, sb.id); err != nil {
			return err
		}
		status = http.StatusCreated
	}
	if b.Timeout != nil {
		// E2B's connect never shortens a sandbox's life; moat's never
		// lengthens it past its creation plus the maximum TTL, which
		// ExtendSession refuses: connect extends it to a second before
		// that at most (the second for the time the call takes).
		ttl = min(ttl, time.Until(info.CreatedAt.Add(s.cfg.Sessions.MaxSessionTTL()))-time.Second)
		if ttl > 0 && time.Now().Add(ttl).After(info.ExpiresAt) {
			if _, err := s.cfg.Sessions.ExtendSession(owner, sb.id, ttl); err != nil {
				return err
			}
		}
	}
	info, err = s.cfg.Sessions.Session(owner, sb.id)
	if err != nil {
		return err
	}
	writeJSON(w, status, s.view(sb, info, true))
	return nil
}

// listed returns owner's sandboxes that match the query's metadata and
// state filters, oldest first (ties by id).
func (s *Server) listed(r *http.Request, owner string) ([]sandboxJSON, error) {
	q := r.URL.Query()
	want := map[string]string{}
	if m := q.Get("metadata"); m != "" {
		vals, err := url.ParseQuery(m)
		if err != nil {
			return nil, errorf(http.StatusBadRequest, "metadata filter %q: %v", m, err)
		}
		for k, v := range vals {
			want[k] = v[0]
		}
	}
	states := map[string]bool{}
	for _, v := range q["state"] {
		for _, st := range strings.Split(v, ",") {
			if st != "running" && st != "paused" {
				return nil, errorf(http.StatusBadRequest, "state %q: want running or paused", st)
			}
			states[st] = true
		}
	}
	s.mu.Lock()
	var mine []*sandbox
	for _, sb := range s.sandboxes {
		if sb.owner == owner {
			mine = append(mine, sb)
		}
	}
	s.mu.Unlock()
	out := []sandboxJSON{}
	for _, sb := range mine {
		sb, info, ok := s.lookupSandbox(sb.id)
		if !ok {
			continue
		}
		v := s.view(sb, info, false)
		if len(states) > 0 && !states[v.State] {
			continue
		}
		match := true
		for k, val := range want {
			if sb.metadata[k] != val {
				match = false
			}
		}
		if match {
			out = append(out, v)
		}
	}
	slices.SortFunc(out, func(a, b sandboxJSON) int {
		if c := a.StartedAt.Compare(*b.StartedAt); c != 0 {
			return c
		}
		return strings.Compare(a.SandboxID, b.SandboxID)
	})
	return out, nil
}

func (s *Server) handleListV1(w http.ResponseWriter, r *http.Request, owner string) error {
	out, err := s.listed(r, owner)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// parseCursor reads a nextToken: the start time and id of the last
// sandbox of the page before.
func parseCursor(tok string) (time.Time, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	var ns int64
	var id string
	if err == nil {
		_, err = fmt.Sscanf(string(b), "%d %s", &ns, &id)
	}
	if err != nil {
		return time.Time{}, "", errorf(http.StatusBadRequest, "nextToken %q is not one this API gave", tok)
	}
	return time.Unix(0, ns), id, nil
}

// handleList is GET /v2/sandboxes, paged: at most limit (default 100)
// sandboxes, oldest first, after the one nextToken names (which may have
// ended since), and X-Next-Token when more follow.
func (s *Server) handleList(w http.ResponseWriter, r *http.Request, owner string) error {
	out, err := s.listed(r, owner)
	if err != nil {
		return err
	}
	limit := 100
	if l := r.URL.Query().Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > 100 {
			return errorf(http.StatusBadRequest, "limit %q: want 1 to 100", l)
		}
		limit = n
	}
	if next := r.URL.Query().Get("nextToken"); next != "" {
		at, id, err := parseCursor(next)
		if err != nil {
			return err
		}
		// The first sandbox after the cursor, which may be gone itself.
		i, _ := slices.BinarySearchFunc(out, next, func(v sandboxJSON, _ string) int {
			if c := v.StartedAt.Compare(at); c != 0 {
				return c
			}
			if c := strings.Compare(v.SandboxID, id); c != 0 {
				return c
			}
			return 0
		})
		for i < len(out) && out[i].SandboxID == id {
			i++
		}
		out = out[i:]
	}
	if len(out) > limit {
		out = out[:limit]
		last := out[limit-1]
		w.Header().Set("X-Next-Token", base64.RawURLEncoding.EncodeToString(
			fmt.Appendf(nil, "%d %s", last.StartedAt.UnixNano(), last.SandboxID)))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}
