package container

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/moatsandbox/moat"
)

func TestRuncFixed(t *testing.T) {
	for v, want := range map[string]bool{
		"1.1.5": false, "1.1.15": false, "1.2.0": false, "1.2.7": false, "1.2.8": true, "1.2.9": true,
		"1.3.0": false, "1.3.2": false, "1.3.3": true, "1.3.6": true, "1.4.0": true, "1.10.0": true,
		"2.0.0": true, "0.9.9": false, "": false, "garbage": false,
	} {
		if got := runcFixed(v); got != want {
			t.Errorf("runcFixed(%q) = %v, want %v", v, got, want)
		}
	}
	for in, want := range map[string]string{
		"1.1.5+ds1-1+deb12u1": "1.1.5", "v1.3.6": "1.3.6", "1.4.0-rc.1": "1.4.0", " 1.2.8 ": "1.2.8", "abc": "",
	} {
		if got := parseRuncVersion(in); got != want {
			t.Errorf("parseRuncVersion(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestSeccompSupport checks that an engine counts as applying seccomp
// profiles when it lists seccomp, whatever its default profile (moat
// passes its own).
func TestSeccompSupport(t *testing.T) {
	for _, tc := range []struct {
		opts []string
		want bool
		def  string
	}{
		{[]string{"name=apparmor", "name=seccomp,profile=default", "name=cgroupns"}, true, "default"},
		{[]string{"name=seccomp,profile=builtin"}, true, "builtin"},
		{[]string{"name=seccomp,profile=/etc/docker/seccomp.json"}, true, "/etc/docker/seccomp.json"},
		{[]string{"name=seccomp,profile=unconfined"}, true, "unconfined"},
		{[]string{"name=apparmor", "name=rootless"}, false, ""},
		{nil, false, ""},
	} {
		if got, def := seccompSupport(tc.opts); got != tc.want || def != tc.def {
			t.Errorf("seccompSupport(%q) = %v, %q; want %v, %q", tc.opts, got, def, tc.want, tc.def)
		}
	}
}

// TestHostConfigHardening checks every hardening item of the level in what
// is sent to the engine.
func TestHostConfigHardening(t *testing.T) {
	cfg, err := Config{Limits: moat.Limits{Memory: 128 * moat.MiB, Pids: 32, Disk: 64 * moat.MiB, OpenFiles: 100, FileSize: 8 * moat.MiB}, Image: "img"}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	prof, err := newProfile(false)
	if err != nil {
		t.Fatal(err)
	}
	const uid = 2100065599
	sp := newSpec(cfg, "runc-moat", map[string]string{LabelOwner: "42"}, prof, "")
	hc, cc := sp.hostConfig(uid), sp.config(uid, nil)
	check := func(ok bool, what string, got any) {
		t.Helper()
		if !ok {
			t.Errorf("%s: got %v", what, got)
		}
	}
	check(hc.NetworkMode == "none" && cc.NetworkDisabled, "no network", hc.NetworkMode)
	check(hc.ReadonlyRootfs, "read-only root", hc.ReadonlyRootfs)
	check(len(hc.CapDrop) == 1 && hc.CapDrop[0] == "ALL" && len(hc.CapAdd) == 0, "all capabilities dropped", hc.CapDrop)
	check(len(hc.SecurityOpt) == 2 && hc.SecurityOpt[0] == "no-new-privileges:true" && hc.SecurityOpt[1] == "seccomp="+prof.json,
		"no-new-privileges and moat's seccomp profile", hc.SecurityOpt)
	var sent struct {
		DefaultAction string
		Syscalls      []struct{ Names []string }
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(hc.SecurityOpt[1], "seccomp=")), &sent); err != nil {
		t.Fatal(err)
	}
	check(sent.DefaultAction == "SCMP_ACT_ERRNO", "an allow-list profile", sent.DefaultAction)
	check(!hc.Privileged, "not privileged", hc.Privileged)
	check(cc.User == "2100065599:2100065599", "the run's own uid and gid", cc.User)
	check(hc.PidsLimit != nil && *hc.PidsLimit == 32, "pids limit", hc.PidsLimit)
	check(hc.Memory == int64(128*moat.MiB) && hc.MemorySwap == hc.Memory, "memory with swap equal", []int64{hc.Memory, hc.MemorySwap})
	check(hc.NanoCPUs == 1e9, "a CPU quota", hc.NanoCPUs)
	check(len(hc.Binds) == 0 && len(hc.Mounts) == 0 && len(hc.VolumesFrom) == 0 && len(cc.Volumes) == 0, "no host mounts", hc.Binds)
	check(hc.IpcMode == "private" && hc.PidMode == "" && hc.UTSMode == "" && hc.CgroupnsMode == "private", "private namespaces", hc.IpcMode)
	check(hc.LogConfig.Type == "none", "no log driver", hc.LogConfig)
	check(hc.Init != nil && !*hc.Init, "no docker-init from the host", hc.Init)
	check(hc.Runtime == "runc-moat", "the fixed runtime", hc.Runtime)
	check(!hc.AutoRemove, "removal by moat, after the exit state is read", hc.AutoRemove)
	check(cc.Labels[LabelSandbox] == "1" && cc.Labels[LabelOwner] == "42", "labels", cc.Labels)
	var total int64
	for _, m := range []string{"/work", "/tmp", "/dev/shm"} {
		opts, ok := hc.Tmpfs[m]
		check(ok && strings.Contains(opts, "noexec") && strings.Contains(opts, "nosuid") && strings.Contains(opts, "nr_inodes="), m+" a noexec, nosuid, inode-limited tmpfs", opts)
		check(strings.Contains(opts, ",uid=2100065599,gid=2100065599"), m+" owned by the run's uid", opts)
		for _, o := range strings.Split(opts, ",") {
			if v, ok := strings.CutPrefix(o, "size="); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				total += n
			}
		}
	}
	check(total > 0 && total <= int64(64*moat.MiB), "tmpfs sizes add up to at most the disk limit", total)
	check(hc.ShmSize > 0 && strings.Contains(hc.Tmpfs["/dev/shm"], "size="+strconv.FormatInt(hc.ShmSize, 10)), "/dev/shm sized", hc.ShmSize)
	ul := map[string][2]int64{}
	for _, u := range hc.Ulimits {
		ul[u.Name] = [2]int64{u.Soft, u.Hard}
	}
	check(ul["nofile"] == [2]int64{100, 100}, "nofile", ul["nofile"])
	check(ul["fsize"] == [2]int64{int64(8 * moat.MiB), int64(8 * moat.MiB)}, "fsize", ul["fsize"])
	check(ul["core"] == [2]int64{0, 0}, "core", ul["core"])
	check(ul["cpu"][0] == 10, "cpu", ul["cpu"])

	// The CLI runs the same thing.
	args := strings.Join(sp.cliArgs(uid, "/p.json"), " ")
	for _, want := range []string{"--network=none", "--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges:true",
		"--security-opt=seccomp=/p.json",
		"--pids-limit=32", "--memory-swap=134217728", "--runtime=runc-moat", "--log-driver=none", "--user=2100065599:2100065599",
		"--tmpfs=/work:", "--ulimit=fsize=8388608:8388608", "--label=moat.owner=42", " img /bin/sh -c"} {
		if !strings.Contains(args, want) {
			t.Errorf("the CLI arguments lack %q: %s", want, args)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	for _, c := range []Config{
		{UIDFirst: 999}, {UIDFirst: -1}, {UIDCount: -1}, {UIDFirst: 1<<31 - 10, UIDCount: 100}, {CPUs: 0.001},
		{Python: "python3"}, {Python: "/usr/bin/python3; rm -rf /"},
		{Limits: moat.Limits{Memory: 1}},
		{Warm: -2}, {Warm: 17}, {SessionCPUTime: -1},
	} {
		if _, err := c.withDefaults(); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Config %+v: %v, want ErrInvalid", c, err)
		}
	}
	c, err := Config{}.withDefaults()
	if err != nil || c.UIDFirst != 2100065536 || c.UIDCount != 65536 || c.CPUs != 1 || c.Warm != 0 || c.Python != "/usr/bin/python3" || !strings.HasPrefix(c.Image, "moat-sandbox:") {
		t.Errorf("the zero Config: %+v, %v", c, err)
	}
	if c, err := (Config{Warm: -1}).withDefaults(); err != nil || c.Warm != -1 {
		t.Errorf("Warm -1 gives %d, %v; want -1 (none) passed to the engine", c.Warm, err)
	}
}

func TestOwnerGone(t *testing.T) {
	boot, err := bootID()
	if err != nil {
		t.Fatal(err)
	}
	me, err := ownerLabels()
	if err != nil {
		t.Fatal(err)
	}
	if ownerGone(me, boot, "running") {
		t.Error("this live process is taken for gone")
	}
	reused := map[string]string{LabelOwner: me[LabelOwner], LabelOwnerStart: "1", LabelBoot: boot}
	if !ownerGone(reused, boot, "running") {
		t.Error("a pid with another start time (reused) is taken for the owner")
	}
	dead := map[string]string{LabelOwner: strconv.Itoa(1 << 30), LabelOwnerStart: "1", LabelBoot: boot}
	if !ownerGone(dead, boot, "running") {
		t.Error("a pid that does not exist is taken for alive")
	}
	elsewhere := map[string]string{LabelOwner: "1", LabelOwnerStart: "1", LabelBoot: "another-machine"}
	if ownerGone(elsewhere, boot, "running") || !ownerGone(elsewhere, boot, "exited") {
		t.Error("another machine's containers: running ones must stay, stopped ones go")
	}
	if st, err := procStart(os.Getpid()); err != nil || st == 0 {
		t.Errorf("procStart(self) = %d, %v", st, err)
	}
}

func TestKernelLogParsing(t *testing.T) {
	var p [2]int
	if err := syscall.Pipe2(p[:], syscall.O_NONBLOCK|syscall.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(p[1])
	k := &kmsgReader{fd: p[0], refused: map[string]bool{}}
	defer syscall.Close(p[0])
	id := strings.Repeat("ab", 32)
	syscall.Write(p[1], []byte("6,1234,5678,-;cgroup: fork rejected by pids controller in /docker/"+id+"\n SUBSYSTEM=cgroup\n"+
		"6,1235,5679,-;cgroup: fork rejected by pids controller in /system.slice/docker-"+strings.Repeat("cd", 32)+".scope\n"+
		"6,1236,5680,-;something else about /docker/"+strings.Repeat("ef", 32)+"\n"))
	if !k.forkRefused(id) {
		t.Error("a logged refusal under /docker/ID is not seen")
	}
	if k.forkRefused(id) {
		t.Error("a refusal is reported twice")
	}
	if !k.forkRefused(strings.Repeat("cd", 32)) {
		t.Error("a logged refusal under systemd's docker-ID.scope is not seen")
	}
	if k.forkRefused(strings.Repeat("ef", 32)) {
		t.Error("another message is taken for a refusal")
	}
	var nilReader *kmsgReader
	if nilReader.forkRefused(id) {
		t.Error("a nil reader (no /dev/kmsg) reports a refusal")
	}
}

// TestInitSeccompFailsClosed checks the per-run check on a process that
// runs without a seccomp filter (a child of the test, on the host): it must
// be refused, and a process that is gone too.
func TestInitSeccompFailsClosed(t *testing.T) {
	cmd := exec.Command("/bin/sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer cmd.Process.Kill()
	if n, err := initSeccomp(cmd.Process.Pid); err == nil {
		t.Errorf("initSeccomp of an unfiltered process: %d filters, no error", n)
	} else if !strings.Contains(err.Error(), "without a seccomp filter") {
		t.Errorf("initSeccomp of an unfiltered process: %v", err)
	}
	if _, err := initSeccomp(1 << 30); err == nil {
		t.Error("initSeccomp of a pid that does not exist: no error")
	}
}
