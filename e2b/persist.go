// What this API keeps of a sandbox beside its session, so that sandboxes
// outlive a restart of moat serve exactly as their sessions do.

package e2b

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"

	"github.com/moatsandbox/moat/server"
)

// frontKind marks the server's front records that are this API's.
const frontKind = "e2b/1"

// sandboxRecord is what this API keeps of a sandbox in its session's
// record (server.SessionSpec.Front): in the server's database, for as
// long as the session lasts, through a suspend and a restart.
//
// It holds no token. The sandbox's access and traffic tokens are derived
// from the owner's e2b key (in the tokens file, never in the database)
// and Nonce: the database alone gives neither, and the owner's key,
// which the control plane is called with, gives them back after a
// restart. A key changed in the tokens file changes its sandboxes'
// tokens: the old ones stop working, and connect gives the new ones.
type sandboxRecord struct {
	Kind     string            `json:"kind"`
	Template string            `json:"template"`
	Metadata map[string]string `json:"metadata,omitempty"`
	// Envs are the sandbox's envVars, the default environment of its
	// commands and cells: the user's, and kept as the session's files
	// are, in the state directory only moat may read.
	Envs        map[string]string `json:"envs,omitempty"`
	Interpreter bool              `json:"interpreter,omitempty"`
	Nonce       string            `json:"nonce"`
	StartedAt   time.Time         `json:"started_at"`
	// Contexts are the code interpreter's contexts (their names live in
	// the interpreter, kept where the level keeps memory).
	Contexts []codeContext `json:"contexts,omitempty"`
}

func newNonce() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// deriveToken returns the sandbox token of kind ("envd" or "traffic") of
// sandbox id with nonce, for the owner whose e2b key is key.
func deriveToken(key, kind, id, nonce string) string {
	m := hmac.New(sha256.New, []byte(key))
	fmt.Fprintf(m, "moat e2b %s token\x00%s\x00%s", kind, id, nonce)
	prefix := "ea_"
	if kind == "traffic" {
		prefix = "et_"
	}
	return prefix + hex.EncodeToString(m.Sum(nil)[:20])
}

// record returns what is kept of sb.
func (sb *sandbox) record() sandboxRecord {
	return sandboxRecord{Kind: frontKind, Template: sb.template, Metadata: sb.metadata, Envs: sb.envs,
		Interpreter: sb.interpreter, Nonce: sb.nonce, StartedAt: sb.started, Contexts: sb.contexts}
}

// newSandbox returns the sandbox of session info that rec describes, with
// its tokens derived from the owner's key; false if rec is not this API's
// or its owner has no key now.
func (s *Server) newSandbox(info server.SessionInfo, rec sandboxRecord) (*sandbox, bool) {
	key, ok := s.secrets[info.Owner]
	if !ok || rec.Kind != frontKind || rec.Nonce == "" {
		return nil, false
	}
	sb := &sandbox{id: info.ID, owner: info.Owner, template: rec.Template, metadata: rec.Metadata, envs: rec.Envs,
		started: rec.StartedAt, interpreter: rec.Interpreter, nonce: rec.Nonce, contexts: rec.Contexts}
	sb.access = deriveToken(key, "envd", sb.id, sb.nonce)
	sb.traffic = deriveToken(key, "traffic", sb.id, sb.nonce)
	sb.accessSum = sha256.Sum256([]byte(sb.access))
	sb.trafficSum = sha256.Sum256([]byte(sb.traffic))
	return sb, true
}

// load takes back the sandboxes whose sessions the server kept (from
// before a restart: suspended ones, or any of a server that was not
// restarted). A record that is unreadable, or whose owner has no key in
// the tokens now, is left alone: its session stays reachable through
// moat's own API, and ends as any session does.
func (s *Server) load() {
	for _, info := range s.cfg.Sessions.FrontSessions() {
		var rec sandboxRecord
		if err := json.Unmarshal(info.Front, &rec); err != nil {
			s.log.Warn("e2b: a sandbox record that does not decode: its session is left to moat's own API", "session", info.ID, "err", err)
			continue
		}
		sb, ok := s.newSandbox(info, rec)
		if !ok {
			if rec.Kind == frontKind {
				s.log.Warn("e2b: a sandbox whose owner has no e2b key now: its session is left to moat's own API", "sandbox", info.ID, "owner", info.Owner)
			}
			continue
		}
		s.sandboxes[sb.id] = sb
		s.log.Info("e2b: a sandbox kept from before", "sandbox", sb.id, "owner", sb.owner, "template", sb.template, "state", info.State)
	}
}
