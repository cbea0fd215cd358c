package gvisor

import (
	"fmt"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
)

// The parts of the OCI runtime specification (config.json, version 1.0)
// that a run's bundle uses. runsc reads nothing else from it.
type (
	ociSpec struct {
		Version  string     `json:"ociVersion"`
		Process  ociProcess `json:"process"`
		Root     ociRoot    `json:"root"`
		Hostname string     `json:"hostname"`
		Mounts   []ociMount `json:"mounts"`
		Linux    ociLinux   `json:"linux"`
	}
	ociProcess struct {
		Terminal        bool            `json:"terminal"`
		User            ociUser         `json:"user"`
		Args            []string        `json:"args"`
		Env             []string        `json:"env"`
		Cwd             string          `json:"cwd"`
		Capabilities    ociCapabilities `json:"capabilities"`
		Rlimits         []ociRlimit     `json:"rlimits"`
		NoNewPrivileges bool            `json:"noNewPrivileges"`
		OOMScoreAdj     int             `json:"oomScoreAdj"`
	}
	ociUser struct {
		UID            uint32   `json:"uid"`
		GID            uint32   `json:"gid"`
		AdditionalGids []uint32 `json:"additionalGids"`
	}
	// ociCapabilities lists each set explicitly empty: no capability in
	// any set, the bounding set included.
	ociCapabilities struct {
		Bounding    []string `json:"bounding"`
		Effective   []string `json:"effective"`
		Inheritable []string `json:"inheritable"`
		Permitted   []string `json:"permitted"`
		Ambient     []string `json:"ambient"`
	}
	ociRlimit struct {
		Type string `json:"type"`
		Hard uint64 `json:"hard"`
		Soft uint64 `json:"soft"`
	}
	ociRoot struct {
		Path     string `json:"path"`
		Readonly bool   `json:"readonly"`
	}
	ociMount struct {
		Destination string   `json:"destination"`
		Type        string   `json:"type"`
		Source      string   `json:"source"`
		Options     []string `json:"options,omitempty"`
	}
	ociLinux struct {
		Namespaces []ociNamespace `json:"namespaces"`
	}
	ociNamespace struct {
		Type string `json:"type"`
	}
)

// The sandbox user: nobody, as in the container level. It is alone in its
// kernel, so RLIMIT_NPROC counts this run's tasks and nothing else.
const (
	sandboxUID = 65534
	sandboxGID = 65534
)

// The writable places of a run and their share of Limits.Disk, as in the
// container level: the working directory, /tmp and /dev/shm are separate
// tmpfs mounts inside the sandbox's kernel whose sizes add up to the disk
// limit.
const (
	tmpShare = 4  // /tmp gets Disk/4
	shmShare = 16 // /dev/shm gets Disk/16; the working directory the rest
)

// tmpfsMount is one size-limited tmpfs of a run.
type tmpfsMount struct {
	path string
	size int64
	mode string
}

// writable returns the run's tmpfs mounts for the disk limit.
func writable(disk moat.Bytes) []tmpfsMount {
	d := int64(disk)
	shm := pageRound(d / shmShare)
	tmp := pageRound(d / tmpShare)
	work := pageRound(d - shm - tmp)
	return []tmpfsMount{
		{image.WorkDir, work, "0700"},
		{"/tmp", tmp, "1777"},
		{"/dev/shm", shm, "1777"},
	}
}

func pageRound(n int64) int64 {
	const page = 4096
	if n < page {
		return page
	}
	return n / page * page
}

// newSpec returns the OCI spec of one run: python3 reading the code from
// stdin, as nobody, with no capability and no_new_privs, over the read-only
// root filesystem, with a tmpfs for every writable place, the rlimits that
// gVisor's kernel enforces, and namespaces of its own. The network is
// runsc's business (--network=none: loopback only).
//
// Python is the container's init (PID 1). Unlike Linux, gVisor does not
// shield its init from the signals it sends itself, so a crash by signal
// shows as one, and when it exits gVisor kills every other task of the
// container.
func newSpec(rootfs, python string, l moat.Limits) *ociSpec {
	cpu := uint64(max(time.Duration(l.CPUTime).Seconds(), 1))
	rl := func(typ string, soft, hard uint64) ociRlimit { return ociRlimit{Type: typ, Soft: soft, Hard: hard} }
	mounts := []ociMount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"mode=0755"}},
	}
	for _, m := range writable(l.Disk) {
		mounts = append(mounts, ociMount{
			Destination: m.path, Type: "tmpfs", Source: "tmpfs",
			Options: []string{"rw", "noexec", fmt.Sprintf("size=%d", m.size), "mode=" + m.mode,
				fmt.Sprintf("uid=%d", sandboxUID), fmt.Sprintf("gid=%d", sandboxGID)},
		})
	}
	none := []string{}
	return &ociSpec{
		Version: "1.0.2",
		Process: ociProcess{
			User: ociUser{UID: sandboxUID, GID: sandboxGID, AdditionalGids: []uint32{}},
			Args: []string{python, "-"},
			Env:  []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + image.WorkDir, "LANG=C.UTF-8"},
			Cwd:  image.WorkDir,
			Capabilities: ociCapabilities{
				Bounding: none, Effective: none, Inheritable: none, Permitted: none, Ambient: none,
			},
			Rlimits: []ociRlimit{
				// SIGXCPU at the limit, SIGKILL a second later; the host
				// watches the whole sandbox's CPU time too.
				rl("RLIMIT_CPU", cpu, cpu+1),
				rl("RLIMIT_FSIZE", uint64(l.FileSize), uint64(l.FileSize)),
				rl("RLIMIT_NOFILE", uint64(l.OpenFiles), uint64(l.OpenFiles)),
				// Processes and threads of the sandbox user, who is alone
				// in this kernel: the run's task limit.
				rl("RLIMIT_NPROC", uint64(l.Pids), uint64(l.Pids)),
				rl("RLIMIT_CORE", 0, 0),
			},
			NoNewPrivileges: true,
			// The sandbox is the first to go when the host runs out of
			// memory.
			OOMScoreAdj: 1000,
		},
		Root:     ociRoot{Path: rootfs, Readonly: true},
		Hostname: "sandbox",
		Mounts:   mounts,
		Linux: ociLinux{
			Namespaces: []ociNamespace{{"pid"}, {"network"}, {"ipc"}, {"uts"}, {"mount"}},
		},
	}
}
