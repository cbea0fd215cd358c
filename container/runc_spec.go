package container

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/oci"
)

// The OCI spec types of package oci, under the names this package uses.
type (
	ociSpec         = oci.Spec
	ociProcess      = oci.Process
	ociUser         = oci.User
	ociCapabilities = oci.Capabilities
	ociRlimit       = oci.Rlimit
	ociRoot         = oci.Root
	ociMount        = oci.Mount
	ociLinux        = oci.Linux
	ociNamespace    = oci.Namespace
	ociResources    = oci.Resources
	ociDevice       = oci.Device
	ociMemory       = oci.Memory
	ociCPU          = oci.CPU
	ociPids         = oci.Pids
	ociSeccomp      = oci.Seccomp
	ociSyscallRule  = oci.SyscallRule
	ociSeccompArg   = oci.SeccompArg
)

// Docker's default masked and read-only paths (moby's
// oci.DefaultSpec, which the Docker path keeps), so that the runc driver's
// /proc shows no more of the host than a Docker container's does.
var (
	maskedPaths = []string{
		"/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
		"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
		"/sys/firmware", "/sys/devices/virtual/powercap",
	}
	readonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
)

// runcNamespaces are the namespaces of every runc-driven container: all
// new, the network one holding only a loopback that stays down.
var runcNamespaces = []string{"pid", "ipc", "uts", "mount", "network", "cgroup"}

// ociSeccompOf converts moat's Docker-format profile (what the Docker
// path passes in HostConfig.SecurityOpt) into linux.seccomp: the same
// default action and errno, architectures and rules. A field the OCI form
// lacks fails the conversion rather than being dropped.
func ociSeccompOf(p *profile) (*ociSeccomp, error) {
	dec := json.NewDecoder(strings.NewReader(p.json))
	var in struct {
		ociSeccomp
		Syscalls []struct {
			ociSyscallRule
			Comment string `json:"comment"`
		} `json:"syscalls"`
	}
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		return nil, fmt.Errorf("container: convert moat's seccomp profile to the OCI form: %w", err)
	}
	out := in.ociSeccomp
	out.Syscalls = make([]ociSyscallRule, len(in.Syscalls))
	for i, r := range in.Syscalls {
		out.Syscalls[i] = r.ociSyscallRule
	}
	if out.DefaultAction == "" || len(out.Architectures) == 0 || len(out.Syscalls) == 0 {
		return nil, fmt.Errorf("container: moat's seccomp profile converts to an empty OCI filter")
	}
	return &out, nil
}

// runcCmd is the init of a runc-driven container: a shell, as in the
// Docker path (spec.cmd), that first makes the pipes moat passed through
// runc as fds 3, 4 and 5 its stdin, stdout and stderr, says on fd 6 that
// it runs (runc's init has exec'd it: moat then checks it from the host,
// once, instead of polling /proc while runc works) and closes fds 3 to 6,
// so that the code gets only its three; then runs Python and passes its
// status on (128+N for a death by signal N). The byte on fd 6 is only a
// cue to look: what decides is what the host sees in /proc.
func (s *spec) runcCmd() []string {
	return []string{"/bin/sh", "-c", "exec 0<&3 1>&4 2>&5 3<&- 4>&- 5>&-; echo >&6; exec 6>&-; " + s.python + " -; exit $?"}
}

// runcSpec is the OCI spec of one run of the runc driver as uid, in
// cgroup cgroupsPath, over the read-only rootfs: every protection of the
// Docker path (spec.hostConfig), written out for runc, with nothing to turn
// off. The init is the shell of spec.cmd, Python its child, as in the
// Docker path: runc reports a death by signal N of the init as 128+N, and
// the shell reports Python's so.
func (s *spec) runcSpec(rootfs, cgroupsPath string, uid int, sc *ociSeccomp) *ociSpec {
	l := s.limits
	none := []string{}
	rl := func(typ string, soft, hard uint64) ociRlimit { return ociRlimit{Type: typ, Soft: soft, Hard: hard} }
	var rlimits []ociRlimit
	for _, u := range s.ulimits() {
		rlimits = append(rlimits, rl("RLIMIT_"+strings.ToUpper(u.Name), uint64(u.Soft), uint64(u.Hard)))
	}
	mounts := []ociMount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		// runc's default /dev: a small tmpfs in which runc makes only its
		// default devices (null, zero, full, random, urandom, tty) and
		// links; the device cgroup allows those and nothing else.
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts",
			Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
	}
	for _, m := range s.mounts {
		mounts = append(mounts, ociMount{Destination: m.path, Type: "tmpfs", Source: "tmpfs", Options: strings.Split(m.opts(uid), ",")})
	}
	quota := int64(s.cpus * 100000)
	return &ociSpec{
		Version: "1.0.2",
		Process: ociProcess{
			User: ociUser{UID: uint32(uid), GID: uint32(uid), AdditionalGids: []uint32{}},
			Args: s.runcCmd(),
			Env:  s.env(),
			Cwd:  image.WorkDir,
			Capabilities: ociCapabilities{
				Bounding: none, Effective: none, Inheritable: none, Permitted: none, Ambient: none,
			},
			Rlimits:         rlimits,
			NoNewPrivileges: true,
			OOMScoreAdj:     1000,
		},
		Root:     ociRoot{Path: rootfs, Readonly: true},
		Hostname: "sandbox",
		Mounts:   mounts,
		Linux: ociLinux{
			Namespaces: func() []ociNamespace {
				ns := make([]ociNamespace, len(runcNamespaces))
				for i, t := range runcNamespaces {
					ns[i] = ociNamespace{Type: t}
				}
				return ns
			}(),
			Resources: ociResources{
				Devices: []ociDevice{{Allow: false, Access: "rwm"}},
				Memory:  ociMemory{Limit: int64(l.Memory), Swap: int64(l.Memory)},
				CPU:     ociCPU{Quota: max(quota, 1000), Period: 100000},
				Pids:    ociPids{Limit: int64(l.Pids)},
			},
			CgroupsPath:   cgroupsPath,
			Seccomp:       sc,
			MaskedPaths:   maskedPaths,
			ReadonlyPaths: readonlyPaths,
		},
	}
}
