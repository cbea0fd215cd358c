//go:build linux

package seccomp

import (
	"encoding/json"
	"fmt"
	"slices"
)

// A DockerProfile is a seccomp profile in the JSON form that the Docker
// Engine takes in HostConfig.SecurityOpt ("seccomp=<json>") and that runc
// compiles with libseccomp. Only the fields moat uses are here; they are
// understood by every engine since Docker 20.10.
type DockerProfile struct {
	DefaultAction   string          `json:"defaultAction"`
	DefaultErrnoRet *uint           `json:"defaultErrnoRet,omitempty"`
	Architectures   []string        `json:"architectures"`
	Syscalls        []DockerSyscall `json:"syscalls"`
}

// A DockerSyscall is one rule: Action for the syscalls Names when every
// comparison in Args holds.
type DockerSyscall struct {
	Names    []string    `json:"names"`
	Action   string      `json:"action"`
	ErrnoRet *uint       `json:"errnoRet,omitempty"`
	Args     []DockerArg `json:"args,omitempty"`
	Comment  string      `json:"comment,omitempty"`
}

// A DockerArg compares syscall argument Index (all 64 bits of it) with
// Value: for SCMP_CMP_MASKED_EQ, Value is the mask and ValueTwo what the
// masked argument must equal.
type DockerArg struct {
	Index    uint   `json:"index"`
	Value    uint64 `json:"value"`
	ValueTwo uint64 `json:"valueTwo"`
	Op       string `json:"op"`
}

// The actions and operators of the profile format.
const (
	scmpAllow    = "SCMP_ACT_ALLOW"
	scmpErrno    = "SCMP_ACT_ERRNO"
	scmpEq       = "SCMP_CMP_EQ"
	scmpNe       = "SCMP_CMP_NE"
	scmpMaskedEq = "SCMP_CMP_MASKED_EQ"
)

// JSON returns the profile as the engine takes it.
func (p *DockerProfile) JSON() ([]byte, error) {
	b, err := json.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w", err)
	}
	return b, nil
}

// Allowed returns the names of the syscalls the profile allows, with or
// without conditions on their arguments, sorted.
func (p *DockerProfile) Allowed() []string {
	var out []string
	for _, r := range p.Syscalls {
		if r.Action == scmpAllow {
			out = append(out, r.Names...)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}
