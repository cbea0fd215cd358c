// Package oci holds the parts of the OCI runtime specification that moat
// writes into its bundles' config.json, shared by the levels that drive an
// OCI runtime themselves (gvisor: runsc; container's runc driver: runc).
package oci

// The parts of the OCI runtime specification (config.json) that moat's
// bundles use: the gvisor level's for runsc, the container level's runc
// driver's for runc. Fields only runc's bundles set (resources, cgroups
// path, masked and read-only paths) are left out of the JSON when zero.
type (
	Spec struct {
		Version  string  `json:"ociVersion"`
		Process  Process `json:"process"`
		Root     Root    `json:"root"`
		Hostname string  `json:"hostname"`
		Mounts   []Mount `json:"mounts"`
		Linux    Linux   `json:"linux"`
	}
	Process struct {
		Terminal        bool         `json:"terminal"`
		User            User         `json:"user"`
		Args            []string     `json:"args"`
		Env             []string     `json:"env"`
		Cwd             string       `json:"cwd"`
		Capabilities    Capabilities `json:"capabilities"`
		Rlimits         []Rlimit     `json:"rlimits"`
		NoNewPrivileges bool         `json:"noNewPrivileges"`
		OOMScoreAdj     int          `json:"oomScoreAdj"`
	}
	User struct {
		UID            uint32   `json:"uid"`
		GID            uint32   `json:"gid"`
		AdditionalGids []uint32 `json:"additionalGids"`
	}
	// Capabilities lists each set explicitly empty: no capability in
	// any set, the bounding set included.
	Capabilities struct {
		Bounding    []string `json:"bounding"`
		Effective   []string `json:"effective"`
		Inheritable []string `json:"inheritable"`
		Permitted   []string `json:"permitted"`
		Ambient     []string `json:"ambient"`
	}
	Rlimit struct {
		Type string `json:"type"`
		Hard uint64 `json:"hard"`
		Soft uint64 `json:"soft"`
	}
	Root struct {
		Path     string `json:"path"`
		Readonly bool   `json:"readonly"`
	}
	Mount struct {
		Destination string   `json:"destination"`
		Type        string   `json:"type"`
		Source      string   `json:"source"`
		Options     []string `json:"options,omitempty"`
	}
	Linux struct {
		Namespaces    []Namespace `json:"namespaces"`
		Resources     Resources   `json:"resources,omitzero"`
		CgroupsPath   string      `json:"cgroupsPath,omitempty"`
		Seccomp       *Seccomp    `json:"seccomp,omitempty"`
		MaskedPaths   []string    `json:"maskedPaths,omitempty"`
		ReadonlyPaths []string    `json:"readonlyPaths,omitempty"`
	}
	Namespace struct {
		Type string `json:"type"`
	}
	Resources struct {
		Devices []Device `json:"devices"`
		Memory  Memory   `json:"memory"`
		CPU     CPU      `json:"cpu"`
		Pids    Pids     `json:"pids"`
	}
	Device struct {
		Allow  bool   `json:"allow"`
		Access string `json:"access"`
	}
	Memory struct {
		Limit int64 `json:"limit"`
		Swap  int64 `json:"swap"` // memory plus swap
	}
	CPU struct {
		Quota  int64  `json:"quota"`
		Period uint64 `json:"period"`
	}
	Pids struct {
		Limit int64 `json:"limit"`
	}
	// Seccomp is linux.seccomp: the same fields, with the same
	// meaning, as the Docker profile moat passes to the engine (runc
	// compiles both with libseccomp), so that the profile converts field
	// for field.
	Seccomp struct {
		DefaultAction   string        `json:"defaultAction"`
		DefaultErrnoRet *uint         `json:"defaultErrnoRet,omitempty"`
		Architectures   []string      `json:"architectures"`
		Syscalls        []SyscallRule `json:"syscalls"`
	}
	SyscallRule struct {
		Names    []string     `json:"names"`
		Action   string       `json:"action"`
		ErrnoRet *uint        `json:"errnoRet,omitempty"`
		Args     []SeccompArg `json:"args,omitempty"`
	}
	SeccompArg struct {
		Index    uint   `json:"index"`
		Value    uint64 `json:"value"`
		ValueTwo uint64 `json:"valueTwo"`
		Op       string `json:"op"`
	}
)
