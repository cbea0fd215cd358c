package container

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/client"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
)

// daemon is what probe found out about the Docker engine.
type daemon struct {
	host         string
	version      string // the engine's version
	apiVersion   string // the API version negotiated
	seccomp      bool   // the engine applies seccomp profiles
	seccompDef   string // the engine's default profile ("builtin", "default", a path, "unconfined")
	runtimes     []string
	runtime      string // the runtime runs will use
	runtimePath  string
	runtimeVer   string // e.g. "1.3.6", "" when unknown
	runtimeFixed bool
	defaultRunc  string // the version of the engine's default runc, if known
	imagePresent bool
	imageCreated time.Time
	imageSize    int64
}

func (e *daemon) runtimeVersionText() string {
	if e.runtimeVer == "" {
		return "of an unknown version"
	}
	return "runc " + e.runtimeVer
}

// probe asks the engine what the level needs to know. It fails (with an
// unavailable error) only when the engine does not answer or lacks the
// runtime asked for.
func probe(ctx context.Context, cli *client.Client, cfg Config) (*daemon, error) {
	e := &daemon{host: cli.DaemonHost()}
	if _, err := cli.Ping(ctx); err != nil {
		return nil, engineUnreachable(e.host, err)
	}
	cli.NegotiateAPIVersion(ctx)
	e.apiVersion = cli.ClientVersion()
	info, err := cli.Info(ctx)
	if err != nil {
		return nil, unavailable("the Docker engine does not say what it is", "check dockerd's log", err)
	}
	e.version = info.ServerVersion
	e.seccomp, e.seccompDef = seccompSupport(info.SecurityOptions)
	for name := range info.Runtimes {
		e.runtimes = append(e.runtimes, name)
	}
	e.runtime = cfg.Runtime
	if e.runtime == "" {
		e.runtime = info.DefaultRuntime
		if _, ok := info.Runtimes[FixedRuntime]; ok {
			e.runtime = FixedRuntime
		}
	}
	rt, ok := info.Runtimes[e.runtime]
	if !ok {
		return nil, unavailable(fmt.Sprintf("the Docker engine has no runtime %q (it has %s)", e.runtime, strings.Join(e.runtimes, ", ")),
			"run scripts/setup-docker.sh to register runc-moat, or name a runtime the engine has", nil)
	}
	e.runtimePath = rt.Path
	if e.runtimePath == "" && e.runtime == "runc" {
		e.runtimePath = "runc"
	}
	e.runtimeVer = runcVersion(ctx, e.runtimePath)
	if e.runtimeVer == "" && e.runtime == info.DefaultRuntime && info.RuncCommit.ID != "" {
		e.runtimeVer = parseRuncVersion(info.RuncCommit.ID)
	}
	e.runtimeFixed = runcFixed(e.runtimeVer)
	if e.runtime != "runc" {
		e.defaultRunc = runcVersion(ctx, firstNonEmpty(info.Runtimes["runc"].Path, "runc"))
	}
	ins, err := cli.ImageInspect(ctx, cfg.Image)
	switch {
	case err == nil:
		e.imagePresent = true
		e.imageCreated, _ = time.Parse(time.RFC3339Nano, ins.Created)
		e.imageSize = ins.Size
	case !cerrdefs.IsNotFound(err):
		return nil, unavailable("the Docker engine cannot inspect image "+cfg.Image, "check dockerd's log", err)
	}
	return e, nil
}

// seccompSupport reports whether the engine's security options (e.g.
// "name=seccomp,profile=builtin") say that it applies seccomp profiles, and
// which profile it gives the containers that name none. moat's containers
// all name moat's own, so the engine's default does not matter, even
// "unconfined"; whether the engine really applies moat's is what the
// probe (probeSeccomp) checks.
func seccompSupport(opts []string) (supported bool, defaultProfile string) {
	for _, o := range opts {
		fields := map[string]string{}
		for _, kv := range strings.Split(o, ",") {
			k, v, _ := strings.Cut(kv, "=")
			fields[k] = v
		}
		if fields["name"] == "seccomp" {
			return true, fields["profile"]
		}
	}
	return false, ""
}

func firstNonEmpty(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// runcVersion runs `PATH --version` on this machine and returns the version
// it prints, or "" when it cannot tell (a remote engine, a runtime that is
// not runc).
func runcVersion(ctx context.Context, path string) string {
	if path == "" {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, "--version")
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	out, err := cmd.Output()
	if err != nil {
		return ""
	}
	first, _, _ := strings.Cut(string(out), "\n")
	if !strings.HasPrefix(first, "runc version ") {
		return ""
	}
	return parseRuncVersion(strings.TrimPrefix(first, "runc version "))
}

var versionRE = regexp.MustCompile(`^v?(\d+)\.(\d+)\.(\d+)`)

// parseRuncVersion returns the x.y.z at the start of s ("1.1.5+ds1" gives
// "1.1.5"), or "".
func parseRuncVersion(s string) string {
	m := versionRE.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return ""
	}
	return m[1] + "." + m[2] + "." + m[3]
}

// runcFixed reports whether runc version v has the fixes for the November
// 2025 escapes (CVE-2025-31133, CVE-2025-52565, CVE-2025-52881): 1.2.8 and
// later 1.2.x, 1.3.3 and later 1.3.x, 1.4.0 and later. An unknown version is
// not fixed.
func runcFixed(v string) bool {
	m := versionRE.FindStringSubmatch(v)
	if m == nil {
		return false
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	patch, _ := strconv.Atoi(m[3])
	switch {
	case major != 1:
		return major > 1
	case minor < 2:
		return false
	case minor == 2:
		return patch >= 8
	case minor == 3:
		return patch >= 3
	}
	return true
}

// Check says whether the container level can run here, for `moat doctor`:
// whether the engine answers and its version, the runtime and whether its
// runc predates the November 2025 fixes, seccomp, and the image with its
// age; and whether the runc driver (Config.Driver) could run. With the
// runc driver the level is available when runc is, and the engine's
// details say whether sessions are. It never fails; what it cannot find
// is in the Availability.
func Check(ctx context.Context, cfg Config) moat.Availability {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return moat.Availability{Level: moat.LevelContainer, Reason: err.Error(), Remedy: "fix the configuration"}
	}
	d := checkDocker(ctx, cfg)
	rline := "driver runc (container.driver \"runc\"): "
	f, rerr := findRuncDriver(cfg)
	if rerr == nil {
		rline += fmt.Sprintf("could run one-shot runs with runc-moat %s at %s over %s", f.version, f.path, f.rootfs)
	} else {
		rline += "unavailable: " + moat.Unavailable(moat.LevelContainer, rerr).Reason
	}
	if cfg.Driver != DriverRunc {
		d.Details = append(d.Details, "driver: docker (one-shot runs and sessions through the Engine API)", rline)
		return d
	}
	a := moat.Availability{Level: moat.LevelContainer, Available: rerr == nil}
	a.Details = append(a.Details, "driver: runc (one-shot runs with runc directly; sessions through the Docker engine)", rline)
	if rerr != nil {
		u := moat.Unavailable(moat.LevelContainer, rerr)
		a.Reason, a.Remedy = u.Reason, u.Remedy
	} else if !d.Available {
		a.Reason = "one-shot runs only: sessions need the Docker engine, which is unavailable: " + d.Reason
	}
	for _, l := range d.Details {
		a.Details = append(a.Details, "sessions: "+l)
	}
	return a
}

// checkDocker is Check for the Docker path; cfg has its defaults.
func checkDocker(ctx context.Context, cfg Config) moat.Availability {
	a := moat.Availability{Level: moat.LevelContainer}
	cli, err := newClient()
	if err != nil {
		a.Reason, a.Remedy = "no Docker client: "+err.Error(), "set DOCKER_HOST or run scripts/setup-docker.sh"
		return a
	}
	defer cli.Close()
	e, err := probe(ctx, cli, cfg)
	if err != nil {
		if u, ok := err.(*moat.UnavailableError); ok {
			a.Reason, a.Remedy = u.Reason, u.Remedy
			if u.Err != nil {
				a.Details = append(a.Details, "error: "+u.Err.Error())
			}
		} else {
			a.Reason = err.Error()
		}
		return a
	}
	a.Details = append(a.Details, fmt.Sprintf("engine: Docker %s at %s (API %s)", e.version, e.host, e.apiVersion))
	fix := func(v string) string {
		switch {
		case v == "":
			return "version unknown: cannot tell whether it has the November 2025 fixes"
		case runcFixed(v):
			return "has the November 2025 fixes"
		}
		return "OLDER than the November 2025 fixes (CVE-2025-31133, CVE-2025-52565, CVE-2025-52881; fixed in 1.2.8, 1.3.3, 1.4.0)"
	}
	a.Details = append(a.Details, fmt.Sprintf("runtime: %s (%s), runc %s: %s", e.runtime, e.runtimePath, firstNonEmpty(e.runtimeVer, "?"), fix(e.runtimeVer)))
	if e.runtime != "runc" {
		a.Details = append(a.Details, fmt.Sprintf("the engine's own runc: %s: %s (moat does not use it)", firstNonEmpty(e.defaultRunc, "?"), fix(e.defaultRunc)))
	}
	if e.seccomp {
		a.Details = append(a.Details, fmt.Sprintf("seccomp: the engine applies profiles (its default: %s, which moat does not use)", firstNonEmpty(e.seccompDef, "?")))
	} else {
		a.Details = append(a.Details, "seccomp: MISSING in the engine")
	}
	if prof, err := newProfile(cfg.Egress != nil); err == nil {
		a.Details = append(a.Details, fmt.Sprintf("seccomp profile: %s, passed with every container (%s)", prof, prof.digest))
	}
	a.Details = append(a.Details, (&backend{egress: cfg.Egress}).netDescribe())
	a.Details = append(a.Details, fmt.Sprintf("uids: %d-%d, one per container, leased in %s", cfg.UIDFirst, cfg.UIDFirst+cfg.UIDCount-1, uidLockDir()))
	st := image.GetStatus(cfg.SharedImage)
	if st.Exists {
		a.Details = append(a.Details, fmt.Sprintf("rootfs: %s, built %s ago (%s), %.1f MiB", st.Path, st.Age, st.BuiltAt.Format(time.RFC3339), float64(st.Size)/(1<<20)))
	} else {
		a.Details = append(a.Details, "rootfs: not built ("+cfg.SharedImage.BuildCommand()+")")
	}
	if e.imagePresent {
		a.Details = append(a.Details, fmt.Sprintf("image: %s, created %s ago, %.1f MiB", cfg.Image, time.Since(e.imageCreated).Round(time.Second), float64(e.imageSize)/(1<<20)))
	} else {
		a.Details = append(a.Details, fmt.Sprintf("image: %s is not in the engine", cfg.Image))
	}

	if err := e.refusal(cfg); err != nil {
		u := err.(*moat.UnavailableError)
		a.Reason, a.Remedy = u.Reason, u.Remedy
		return a
	}
	// The probe, fresh: a container made like every run's must refuse what
	// moat's profile refuses.
	r, err := probeOnce(ctx, cfg, cli, e)
	if err != nil {
		u := moat.Unavailable(moat.LevelContainer, err)
		a.Reason, a.Remedy = u.Reason, u.Remedy
		a.Details = append(a.Details, "seccomp probe: FAILED: "+u.Reason)
		return a
	}
	a.Details = append(a.Details, fmt.Sprintf("seccomp probe: in a container, %s; its init ran under %d filter(s)", r, r.filters))
	a.Available = true
	if os.Geteuid() != 0 {
		a.Reason = "moat is not root: the CPU time of a whole process tree is not watched and the pids, filesize and disk reasons are not reported"
	}
	if !e.runtimeFixed {
		a.Reason = fmt.Sprintf("runs on %s, older than the November 2025 fixes, because the operator allowed it", e.runtimeVersionText())
	}
	return a
}

// probeOnce runs the seccomp probe on a backend that no engine uses.
func probeOnce(ctx context.Context, cfg Config, cli *client.Client, e *daemon) (*probeResult, error) {
	b, err := newBackend(cfg, cli, e)
	if err != nil {
		return nil, err
	}
	return b.probeSeccomp(ctx)
}

// refusal returns the unavailable error that keeps a Sandbox with cfg from
// running on this engine, or nil: no seccomp support, a
// runc without the November 2025 fixes that the operator did not allow, or
// no image. New, CLIArgs and Check refuse alike.
func (e *daemon) refusal(cfg Config) error {
	switch {
	case !e.seccomp:
		return unavailable("the Docker engine has no seccomp support, so it cannot apply moat's seccomp profile",
			"use a dockerd built with seccomp (Debian's docker.io is)", nil)
	case !e.runtimeFixed && !cfg.AllowVulnerableRuntime:
		return unavailable(fmt.Sprintf("runtime %q is %s, older than the fixes for the November 2025 container escapes", e.runtime, e.runtimeVersionText()),
			"run scripts/setup-docker.sh (as root) to build and register runc-moat, or set AllowVulnerableRuntime", nil)
	case !e.imagePresent:
		remedy := "run '" + cfg.SharedImage.BuildCommand() + "' (as root)"
		if cfg.Image != cfg.SharedImage.Tag() {
			remedy = "pull or build " + cfg.Image + ", or leave container.image empty to run the one 'moat image build' makes"
		}
		return unavailable(fmt.Sprintf("image %s is not in the Docker engine", cfg.Image), remedy, nil)
	}
	return nil
}
