package attack

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// A setup is the harness's side of one run of an attack: the parameters its
// program gets, the host's secrets whose appearance in the output proves
// the attack, and what the harness watches on the host around the run.
type setup struct {
	name   Name
	p      params
	tokens []string // host-side secrets: any one in the output proves the attack
	end    ending   // what an end without proof means
	// watch, when not nil, is called just before the run; the function it
	// returns is called just after, and returns the host-side proof that
	// the attack got through: a How and a Detail, or "" and "".
	watch func() (end func() (how, detail string))
	// undo releases what prepare set up around the run; it may be nil.
	undo func()
}

// prepare returns the setup of one run of the attack name.
func prepare(name Name, env *Env) (*setup, error) {
	nonce := randomText(32)
	s := &setup{name: name, p: params{Nonce: nonce, Tag: "moat" + nonce[:11]}}
	if needsEnv(name) && env == nil {
		return nil, fmt.Errorf("attack: %s needs an Env from Plant", name)
	}
	switch name {
	case Loop:
		s.p.Linger = lingerSeconds
	case Memory:
		s.p.MiB = memoryMiB
	case ForkFlood:
		s.p.Procs, s.p.Linger = floodProcs, lingerSeconds
	case Disk:
		s.p.MiB = diskMiB
	case Credentials:
		s.p.Path = env.CredentialsPath
		s.tokens, s.end = []string{env.credToken}, ending{noProof: "no token"}
	case Network:
		s.p.Port = env.ServicePort
		s.tokens, s.end = []string{env.serviceToken}, ending{noProof: "no token"}
		s.watch = func() func() (string, string) {
			env.netTurn.Lock()
			before := env.conns.Load()
			return func() (string, string) {
				defer env.netTurn.Unlock()
				if n := env.conns.Load() - before; n > 0 {
					return "connected", fmt.Sprintf("the service accepted %d connection(s) during the run", n)
				}
				return "", ""
			}
		}
	case UnixPathStream, UnixPathDgram, AbstractUnix:
		switch name {
		case UnixPathStream:
			s.p.Path = env.StreamSocket
		case UnixPathDgram:
			s.p.Path = env.DgramSocket
		default:
			s.p.Name = env.AbstractName
		}
		s.end = ending{noProof: "not received", overErrs: true}
		s.watch = func() func() (string, string) {
			env.inbox.expect(nonce)
			return func() (string, string) {
				env.flush()
				if where := env.inbox.take(nonce); len(where) > 0 {
					return "received", "the run's greeting reached the harness's " + strings.Join(where, "; ")
				}
				return "", ""
			}
		}
	case AbstractBind:
		s.p.Name, s.p.Hold = "moat-attack-bind-"+randomText(16), bindHold
		s.end = ending{noProof: "not on the host", overErrs: true}
		s.watch = func() func() (string, string) {
			stop := watchAbstract(s.p.Name + "-")
			return func() (string, string) {
				if ways := stop(); len(ways) > 0 {
					return "bound on the host", "names the run bound appeared in the host's network namespace during the run: @" +
						s.p.Name + "-{" + strings.Join(ways, ",") + "}"
				}
				return "", ""
			}
		}
	case IOURing, Vsock:
	case HostProcs:
		token := "moat-host-" + randomText(32)
		kill, err := startHostProcess(token)
		if err != nil {
			return nil, err
		}
		s.tokens, s.end, s.undo = []string{token}, ending{noProof: "no token", overErrs: true}, kill
	case HostNet:
		macs, err := hostMACs()
		if err != nil {
			return nil, err
		}
		s.tokens, s.end = macs, ending{noProof: "no host address", overErrs: true}
	case DNSExfil, DirectIP, SNIFronting, SecretRead:
		if err := env.prepareEgress(s); err != nil {
			return nil, err
		}
	case UIDSharedLimit:
		return nil, fmt.Errorf("attack: %s is a pair of runs, not one", name)
	default:
		return nil, fmt.Errorf("attack: unknown attack %q", name)
	}
	return s, nil
}

func needsEnv(n Name) bool {
	switch n {
	case Credentials, Network, UnixPathStream, UnixPathDgram, AbstractUnix:
		return true
	case DNSExfil, DirectIP, SNIFronting, SecretRead:
		return true
	}
	return false
}

// The host-side parameters of the probes.
const (
	// bindHold is how long the abstract_bind program holds the name, in
	// seconds: long enough for abstractPoll to see it many times.
	bindHold     = 2
	abstractPoll = 20 * time.Millisecond
	// hostProcSeconds bounds the life of the host_procs process, should
	// the harness not be there to kill it.
	hostProcSeconds = 600
	// hogMax bounds the inotify instances the uid_shared_limit hog opens,
	// should its run's own limits not stop it first. A per-uid limit above
	// it cannot be shown exhausted.
	hogMax = 1 << 16
)

// watchAbstract polls the harness's network namespace (/proc/self/net/unix)
// for sockets bound to abstract names that start with prefix; the returned
// function stops the poll and returns what followed the prefix in the names
// it saw, sorted.
func watchAbstract(prefix string) (stop func() []string) {
	want := []byte("@" + prefix)
	done := make(chan struct{})
	seen := make(map[string]bool)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(abstractPoll)
		defer t.Stop()
		for {
			abstractBound(want, seen)
			select {
			case <-done:
				abstractBound(want, seen)
				return
			case <-t.C:
			}
		}
	}()
	return func() []string {
		close(done)
		wg.Wait()
		var out []string
		for s := range seen {
			out = append(out, s)
		}
		slices.Sort(out)
		return out
	}
}

// abstractBound adds to seen the rest of every path in /proc/self/net/unix
// that starts with want (an abstract name shows as "@name").
func abstractBound(want []byte, seen map[string]bool) {
	b, err := os.ReadFile("/proc/self/net/unix")
	if err != nil {
		return
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		f := bytes.Fields(line)
		if len(f) >= 8 && bytes.HasPrefix(f[7], want) {
			seen[clip(string(f[7][len(want):]), 40)] = true
		}
	}
}

// startHostProcess starts a sleeping process on the host whose command line
// (its argv[0]) is token, and returns the function that kills and reaps it.
func startHostProcess(token string) (kill func(), err error) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		return nil, fmt.Errorf("attack: host_procs needs sleep on the host: %w", err)
	}
	// No Pdeathsig: it would fire when the OS thread that started the
	// process exits, which a goroutine locked to it can make happen at any
	// time. hostProcSeconds bounds its life instead.
	cmd := &exec.Cmd{Path: sleep, Args: []string{token, fmt.Sprint(hostProcSeconds)}, Env: []string{}}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("attack: start the host process: %w", err)
	}
	return func() {
		cmd.Process.Kill()
		cmd.Wait()
	}, nil
}

// hostMACs returns the hardware addresses of the host's interfaces other
// than loopback, as sysfs spells them (lowercase, colon-separated).
func hostMACs() ([]string, error) {
	dirs, err := filepath.Glob("/sys/class/net/*/address")
	if err != nil {
		return nil, fmt.Errorf("attack: host_net: %w", err)
	}
	var macs []string
	for _, f := range dirs {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		mac := strings.ToLower(strings.TrimSpace(string(b)))
		if filepath.Base(filepath.Dir(f)) == "lo" || mac == "" || strings.Trim(mac, "0:") == "" {
			continue
		}
		if !slices.Contains(macs, mac) {
			macs = append(macs, mac)
		}
	}
	if len(macs) == 0 {
		return nil, fmt.Errorf("attack: host_net: the host has no network interface with a hardware address to look for")
	}
	return macs, nil
}
