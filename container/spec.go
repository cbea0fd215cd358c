package container

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/go-units"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/engine"
)

// Labels every container of moat carries. LabelOwner, LabelOwnerStart and
// LabelBoot name the moat process that made it, so that a later moat can
// tell whether that process is gone and remove what it left.
const (
	LabelSandbox    = "moat.sandbox"     // "1"
	LabelLevel      = "moat.level"       // "container"
	LabelOwner      = "moat.owner"       // the owner's pid
	LabelOwnerStart = "moat.owner.start" // the owner's start time, in clock ticks since boot
	LabelBoot       = "moat.boot"        // the boot id of the owner's machine
	LabelUID        = "moat.uid"         // the uid (and gid) the container runs as
	LabelSession    = "moat.session"     // "1" on a session's container
)

// The writable places of a run and their share of Limits.Disk: the
// working directory, /tmp and /dev/shm are separate tmpfs mounts whose sizes
// add up to the disk limit, so that the limit covers every writable place.
// The working directory, where a session's files live, gets most of it.
const (
	tmpShare = 16 // /tmp gets Disk/16
	shmShare = 32 // /dev/shm gets Disk/32; the working directory the rest
	// inodeBytes is the disk space each inode of a tmpfs stands for: a
	// mount of N bytes holds at most N/inodeBytes files.
	inodeBytes = 8 << 10
)

// spec is everything a run's container is made with, computed once per
// Sandbox from its Config. It renders as the Engine API's structures and as
// the docker CLI's flags, so that the API and the CLI run the same thing.
type spec struct {
	image   string
	runtime string
	python  string
	limits  moat.Limits
	cpus    float64
	labels  map[string]string
	mounts  []tmpfs
	seccomp *profile
	// caHost is the host file holding the egress proxy's CA bundle, bind
	// mounted read-only at caPath (and over the image's trust store), or
	// "" without an egress proxy.
	caHost string
	// egress: the containers reach moat's egress proxy (see network.go);
	// the seccomp profile then allows inet sockets.
	egress bool
}

// A tmpfs is one of a run's writable mounts. It belongs to the run's own
// uid and gid (see user), which differ from run to run.
type tmpfs struct {
	path string
	size int64
	mode string
}

// opts returns the mount options of m for a run as uid (and gid uid): size
// and inodes limited, nothing executable, owned by the run.
func (m tmpfs) opts(uid int) string {
	inodes := max(m.size/inodeBytes, 64)
	return fmt.Sprintf("rw,nosuid,nodev,noexec,size=%d,nr_inodes=%d,mode=%s,uid=%d,gid=%d", m.size, inodes, m.mode, uid, uid)
}

// user is the Config.User of a run as uid: the gid has the same number and
// the run has no supplementary groups.
func user(uid int) string { return strconv.Itoa(uid) + ":" + strconv.Itoa(uid) }

// cmd is the container's command. A shell is PID 1 and Python its child:
// the kernel ignores signals that a PID namespace's init sends itself, so
// Python as PID 1 could not die of its own SIGSEGV, and its exit status
// would hide a signal. The shell drops the HOSTNAME that Docker always sets
// and passes Python's status on (128+N for signal N).
func (s *spec) cmd() []string {
	return []string{"/bin/sh", "-c", "unset HOSTNAME; " + s.python + " -; exit $?"}
}

func (s *spec) env() []string {
	return []string{
		"PATH=/usr/local/bin:/usr/bin:/bin",
		"HOME=" + image.WorkDir,
		"LANG=C.UTF-8",
	}
}

// newSpec is the spec of cfg's containers. caHost is the host file of the
// egress proxy's CA bundle, "" when cfg has no proxy.
func newSpec(cfg Config, runtime string, owner map[string]string, prof *profile, caHost string) *spec {
	l := cfg.Limits.WithDefaults()
	s := &spec{
		image:   cfg.Image,
		runtime: runtime,
		seccomp: prof,
		python:  cfg.Python,
		limits:  l,
		cpus:    cfg.CPUs,
		labels:  map[string]string{LabelSandbox: "1", LabelLevel: string(moat.LevelContainer)},
		caHost:  caHost,
		egress:  cfg.Egress != nil,
	}
	for k, v := range owner {
		s.labels[k] = v
	}
	disk := int64(l.Disk)
	shm := pageRound(disk / shmShare)
	tmp := pageRound(disk / tmpShare)
	work := pageRound(disk - shm - tmp)
	s.mounts = []tmpfs{
		{image.WorkDir, work, "0700"},
		{"/tmp", tmp, "1777"},
		{"/dev/shm", shm, "1777"},
	}
	return s
}

func pageRound(n int64) int64 {
	const page = 4096
	if n < page {
		return page
	}
	return n / page * page
}

// config is the configuration of a container for a run as uid: the
// command, the user, the environment (with netEnv, the egress proxy's, if
// any, after moat's own), no network, stdin open for the code.
func (s *spec) config(uid int, netEnv []string) *container.Config {
	return &container.Config{
		Image:           s.image,
		Cmd:             s.cmd(),
		Env:             slices.Concat(s.env(), netEnv),
		User:            user(uid),
		WorkingDir:      image.WorkDir,
		Hostname:        "sandbox",
		Labels:          s.labelsFor(uid),
		NetworkDisabled: true,
		AttachStdin:     true,
		AttachStdout:    true,
		AttachStderr:    true,
		OpenStdin:       true,
		StdinOnce:       true,
		Tty:             false,
		StopSignal:      "SIGKILL",
	}
}

// sessionInit is the program of a session container's init: it does
// nothing but reap the processes the runs leave to it (they are killed at
// each run's end, and the init must reap them or they would count against
// the pids limit), and it makes itself undumpable, so that the code, which
// runs as the same uid, cannot write into its memory through /proc/1/mem.
const sessionInit = `import ctypes, os, signal
ctypes.CDLL(None).prctl(4, 0)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
`

// sessionConfig is the configuration of a session's container as uid:
// as a run's, but its command is the idle init and nothing is attached;
// each run is an exec in it (runCmd).
func (s *spec) sessionConfig(uid int, netEnv []string) *container.Config {
	c := s.config(uid, netEnv)
	c.Cmd = []string{s.python, "-I", "-S", "-c", sessionInit}
	c.AttachStdin, c.AttachStdout, c.AttachStderr = false, false, false
	c.OpenStdin, c.StdinOnce = false, false
	c.Labels[LabelSession] = "1"
	return c
}

// runCmd is the command of a session's run, an exec in its container:
// Python reading the code on stdin, with the environment of a one-shot run
// (the exec's process is not PID 1, so it can die of its own signals, and
// the runtime reports such a death as 128+N).
func (s *spec) runCmd() []string {
	return []string{"/bin/sh", "-c", "unset HOSTNAME; exec " + s.python + " -"}
}

// labelsFor is the labels of a container running as uid.
func (s *spec) labelsFor(uid int) map[string]string {
	l := make(map[string]string, len(s.labels)+1)
	for k, v := range s.labels {
		l[k] = v
	}
	l[LabelUID] = strconv.Itoa(uid)
	return l
}

// hostConfig is every hardening item of the level for a run as uid; see
// the package doc.
func (s *spec) hostConfig(uid int) *container.HostConfig {
	l := s.limits
	pids := int64(l.Pids)
	tmpfs := map[string]string{}
	for _, m := range s.mounts {
		tmpfs[m.path] = m.opts(uid)
	}
	var mounts []mount.Mount
	if s.caHost != "" {
		// The egress proxy's CA bundle, read-only: a file moat wrote as
		// root before any container existed, whose content is public.
		for _, target := range []string{caPath, trustStore} {
			mounts = append(mounts, mount.Mount{Type: mount.TypeBind, Source: s.caHost, Target: target, ReadOnly: true,
				BindOptions: &mount.BindOptions{Propagation: mount.PropagationRPrivate}})
		}
	}
	return &container.HostConfig{
		Mounts:         mounts,
		NetworkMode:    "none",
		ReadonlyRootfs: true,
		Tmpfs:          tmpfs,
		IpcMode:        "private",
		ShmSize:        s.mounts[2].size,
		CapDrop:        []string{"ALL"},
		SecurityOpt:    []string{"no-new-privileges:true", "seccomp=" + s.seccomp.json}, // moat's allow-list, not the engine's default
		Privileged:     false,
		PidMode:        "",                                // a PID namespace of its own
		UTSMode:        "",                                // a hostname of its own
		CgroupnsMode:   "private",                         // its own view of its cgroups
		UsernsMode:     "",                                // the daemon's default
		Runtime:        s.runtime,                         // a runc with the November 2025 fixes
		LogConfig:      container.LogConfig{Type: "none"}, // the output goes to moat only, never to the host's disk
		AutoRemove:     false,                             // removed by moat after it read the exit state
		OomScoreAdj:    1000,                              // the first to go if the host runs out of memory
		Init:           new(bool),                         // no docker-init bind-mounted from the host
		Resources: container.Resources{
			Memory:     int64(l.Memory),
			MemorySwap: int64(l.Memory), // swap equal to memory: no swap
			PidsLimit:  &pids,
			NanoCPUs:   int64(s.cpus * 1e9),
			Ulimits:    s.ulimits(),
		},
	}
}

func (s *spec) ulimits() []*units.Ulimit {
	l := s.limits
	// Never below the limit: see engine.RlimitCPU.
	cpu := int64(engine.RlimitCPU(time.Duration(l.CPUTime)) / time.Second)
	return []*units.Ulimit{
		{Name: "nofile", Soft: int64(l.OpenFiles), Hard: int64(l.OpenFiles)},
		{Name: "fsize", Soft: int64(l.FileSize), Hard: int64(l.FileSize)},
		{Name: "core", Soft: 0, Hard: 0},
		// Per process; the cgroup's CPU usage, watched from the host, covers
		// the whole tree.
		{Name: "cpu", Soft: cpu, Hard: cpu + 1},
	}
}

// cliArgs renders the spec, for a run as uid, as `docker run` flags, the
// image and the command; the CLI's --rm stands for moat's explicit removal.
// The CLI reads the seccomp profile from profilePath (see profile.file).
func (s *spec) cliArgs(uid int, profilePath string) []string {
	hc := s.hostConfig(uid)
	a := []string{"run", "--rm", "-i",
		"--network=none", "--read-only",
		"--ipc=private", "--shm-size=" + strconv.FormatInt(hc.ShmSize, 10),
		"--cap-drop=ALL", "--security-opt=no-new-privileges:true",
		"--security-opt=seccomp=" + profilePath,
		"--cgroupns=private", "--log-driver=none",
		"--oom-score-adj=1000",
		"--user=" + user(uid), "--workdir=" + image.WorkDir, "--hostname=sandbox",
		"--memory=" + strconv.FormatInt(hc.Memory, 10),
		"--memory-swap=" + strconv.FormatInt(hc.MemorySwap, 10),
		"--pids-limit=" + strconv.FormatInt(*hc.PidsLimit, 10),
		"--cpus=" + strconv.FormatFloat(s.cpus, 'f', -1, 64),
	}
	if s.runtime != "" {
		a = append(a, "--runtime="+s.runtime)
	}
	for _, m := range s.mounts {
		a = append(a, "--tmpfs="+m.path+":"+m.opts(uid))
	}
	for _, u := range hc.Ulimits {
		a = append(a, fmt.Sprintf("--ulimit=%s=%d:%d", u.Name, u.Soft, u.Hard))
	}
	for _, e := range s.env() {
		a = append(a, "--env="+e)
	}
	for _, k := range slices.Sorted(maps.Keys(s.labels)) {
		a = append(a, "--label="+k+"="+s.labels[k])
	}
	a = append(a, s.image)
	return append(a, s.cmd()...)
}
