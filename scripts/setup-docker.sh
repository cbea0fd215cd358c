#!/usr/bin/env bash
# setup-docker.sh: make the Docker engine that moat's container level needs.
#
# Idempotent; run as root on Debian 12 (or a Debian-like system), as often as
# you like, with or without a dockerd already running. It:
#   1. installs Debian's docker.io, debootstrap (to build moat's image) and
#      what building runc needs (libseccomp-dev, gcc, pkg-config);
#   2. builds runc ${RUNC_VERSION} (fixed for the November 2025 escapes
#      CVE-2025-31133, CVE-2025-52565, CVE-2025-52881; Debian 12's runc 1.1.5
#      is not) into ${MOAT_LIBEXEC}/runc, unless it is already there;
#   3. registers it with dockerd as the runtime "runc-moat" in
#      /etc/docker/daemon.json (merged into what is there);
#   4. starts dockerd in the background when none answers, without the default
#      bridge and without touching iptables (sandboxes never get a network),
#      logging to /var/log/moat-dockerd.log; when one runs already, asks it to
#      reload its configuration (SIGHUP) so that it learns the runtime;
#   5. waits (bounded) until the engine answers and the runtime is known.
#
# Environment: RUNC_VERSION (default v1.3.6), MOAT_LIBEXEC (default
# /usr/local/lib/moat), DOCKERD_WAIT (seconds, default 60), GO (go binary).
set -euo pipefail

RUNC_VERSION=${RUNC_VERSION:-v1.3.6}
MOAT_LIBEXEC=${MOAT_LIBEXEC:-/usr/local/lib/moat}
DOCKERD_WAIT=${DOCKERD_WAIT:-60}
RUNTIME_NAME=runc-moat
DAEMON_JSON=/etc/docker/daemon.json
LOG=/var/log/moat-dockerd.log

say() { printf 'setup-docker: %s\n' "$*"; }
die() { printf 'setup-docker: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts dockerd)"

# 1. Packages.
need=()
for p in docker.io debootstrap libseccomp-dev gcc libc6-dev pkg-config jq ca-certificates; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
	say "installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
	say "packages already installed"
fi

# 2. A fixed runc.
RUNC=$MOAT_LIBEXEC/runc
want=${RUNC_VERSION#v}
have=$("$RUNC" --version 2>/dev/null | awk 'NR==1 {print $3}' || true)
if [ "$have" = "$want" ]; then
	say "runc $have already at $RUNC"
else
	GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
	[ -x "$GO" ] || die "go is needed to build runc ($GO not found)"
	say "building runc $RUNC_VERSION into $MOAT_LIBEXEC (with seccomp)"
	mkdir -p "$MOAT_LIBEXEC"
	GOBIN=$MOAT_LIBEXEC CGO_ENABLED=1 GOFLAGS=-buildvcs=false \
		"$GO" install -tags seccomp -trimpath -ldflags='-s -w' "github.com/opencontainers/runc@$RUNC_VERSION"
	have=$("$RUNC" --version | awk 'NR==1 {print $3}')
	[ "$have" = "$want" ] || die "built runc says version '$have', want $want"
	"$RUNC" features | jq -e '.linux.seccomp.enabled == true' >/dev/null ||
		die "built runc has no seccomp support"
fi
say "runc: $("$RUNC" --version | head -1)"

# 3. Register it with dockerd.
mkdir -p /etc/docker
[ -s "$DAEMON_JSON" ] || echo '{}' >"$DAEMON_JSON"
jq -e . "$DAEMON_JSON" >/dev/null || die "$DAEMON_JSON is not valid JSON; fix it by hand"
if jq -e --arg n "$RUNTIME_NAME" --arg p "$RUNC" '.runtimes[$n].path == $p' "$DAEMON_JSON" >/dev/null; then
	say "runtime $RUNTIME_NAME already in $DAEMON_JSON"
	changed=no
else
	tmp=$(mktemp "$DAEMON_JSON.XXXXXX")
	jq --arg n "$RUNTIME_NAME" --arg p "$RUNC" '.runtimes[$n] = {path: $p}' "$DAEMON_JSON" >"$tmp"
	chmod 0644 "$tmp"
	mv "$tmp" "$DAEMON_JSON"
	say "registered runtime $RUNTIME_NAME in $DAEMON_JSON"
	changed=yes
fi

# 4. A running dockerd.
engine_up() { timeout 5 docker info --format '{{.ServerVersion}}' >/dev/null 2>&1; }
has_runtime() {
	timeout 5 docker info --format '{{json .Runtimes}}' 2>/dev/null | jq -e --arg n "$RUNTIME_NAME" 'has($n)' >/dev/null
}
wait_for() { # wait_for WHAT CHECK
	local i
	for ((i = 0; i < DOCKERD_WAIT * 2; i++)); do
		if "$2"; then return 0; fi
		sleep 0.5
	done
	return 1
}

# alive PID: the process runs (a zombie does not).
alive() {
	local state
	state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
	[ -n "$state" ] && [ "$state" != Z ]
}
# stale_pid FILE: FILE exists and names no live process.
stale_pid() {
	local pid
	[ -f "$1" ] || return 1
	pid=$(tr -dc 0-9 <"$1")
	[ -z "$pid" ] || ! alive "$pid"
}
running_dockerd() { # the pids of live dockerd processes
	local p
	for p in $(pidof dockerd || true); do
		if alive "$p"; then echo "$p"; fi
	done
}

if engine_up; then
	say "dockerd already answers ($(docker info --format '{{.ServerVersion}}'))"
	if ! has_runtime; then
		pid=$(running_dockerd)
		[ -n "$pid" ] || die "the engine answers but no local dockerd runs to reload; add runtime $RUNTIME_NAME=$RUNC to it by hand"
		say "asking dockerd ($pid) to reload its configuration"
		kill -HUP $pid
		wait_for "the runtime" has_runtime || die "dockerd did not pick up runtime $RUNTIME_NAME; restart it"
	fi
else
	if [ -n "$(running_dockerd)" ]; then
		die "a dockerd runs (pid $(running_dockerd)) but does not answer; see $LOG or stop it"
	fi
	# A dockerd or containerd killed without clean-up leaves its pid file,
	# and a new dockerd refuses to start while it names a process.
	for f in /var/run/docker.pid /var/run/docker/containerd/containerd.pid; do
		if stale_pid "$f"; then
			say "removing stale pid file $f"
			rm -f "$f"
		fi
	done
	# containerd is started by dockerd itself when none is running.
	say "starting dockerd (no bridge, no iptables), log in $LOG"
	setsid nohup dockerd --bridge=none --iptables=false --ip6tables=false \
		</dev/null >>"$LOG" 2>&1 &
	dpid=$!
	up_or_dead() { engine_up || ! alive "$dpid"; }
	if ! wait_for "dockerd" up_or_dead || ! engine_up; then
		tail -20 "$LOG" >&2 || true
		die "dockerd did not come up within ${DOCKERD_WAIT}s (log: $LOG)"
	fi
	say "dockerd $(docker info --format '{{.ServerVersion}}') is up (pid $dpid)"
fi
has_runtime || die "dockerd does not know runtime $RUNTIME_NAME"

# 5. The engine answers and knows the runtime (checked above).
say "ready: engine $(docker info --format '{{.ServerVersion}}'), runtimes $(docker info --format '{{json .Runtimes}}' | jq -c 'keys')"
