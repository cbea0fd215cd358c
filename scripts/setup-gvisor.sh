#!/usr/bin/env bash
# setup-gvisor.sh: make what moat's gvisor level needs: a current runsc and
# the shared sandbox root filesystem.
#
# Idempotent; run as root on Debian 12 (or a Debian-like system), as often as
# you like. It:
#   1. installs runsc from Debian ${RUNSC_SUITE}'s package, unless a runsc
#      with the systrap platform is already installed. Debian 12's own runsc
#      (2022) predates systrap; the newer package is a static binary with no
#      dependencies. It is fetched with a private apt configuration (its own
#      sources list and package lists, from the mirror this machine's apt
#      already uses, checked against Debian's archive keyring), so the
#      system's apt sources never name the newer suite and nothing else can
#      be upgraded from it; the .deb is then installed with dpkg;
#   2. checks that runsc runs a program here under systrap, with no network;
#   3. installs debootstrap and builds moat's sandbox root filesystem (moat
#      image build; cached: a second run does nothing and says so).
#
# Environment: RUNSC_SUITE (default trixie), MIRROR (default: the mirror apt
# uses for this machine's Debian release), MOAT (the moat binary; default: go
# run ./cmd/moat in MOAT_REPO), GO (go binary), MOAT_REPO (the moat source
# tree, default: this script's parent directory).
set -euo pipefail

RUNSC_SUITE=${RUNSC_SUITE:-trixie}
MOAT_REPO=${MOAT_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

say() { printf 'setup-gvisor: %s\n' "$*"; }
die() { printf 'setup-gvisor: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and builds the root filesystem)"
export DEBIAN_FRONTEND=noninteractive

# has_systrap RUNSC: the binary knows the systrap platform (its flags list
# the platforms it was built with).
has_systrap() {
	local flags
	flags=$("$1" flags 2>&1) || return 1
	grep -A1 -- '-platform string' <<<"$flags" | grep -q systrap
}

# find_runsc: the runsc moat will use, found as moat finds it (the first of
# these; never PATH), so that the checks below are of that binary.
find_runsc() {
	local c
	for c in /usr/local/bin/runsc /usr/bin/runsc /usr/sbin/runsc; do
		if [ -f "$c" ] && [ -x "$c" ]; then echo "$c"; return; fi
	done
}

# 1. runsc.
RUNSC=$(find_runsc)
if [ -n "$RUNSC" ] && has_systrap "$RUNSC"; then
	say "runsc with systrap already installed at $RUNSC"
else
	[ -n "$RUNSC" ] && say "$RUNSC ($("$RUNSC" --version 2>/dev/null | head -1)) lacks systrap; replacing it"
	[ -r "$KEYRING" ] || apt-get install -y -qq debian-archive-keyring >/dev/null
	if [ -z "${MIRROR:-}" ]; then
		codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
		MIRROR=$(apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 'Created-By: Packages' 2>/dev/null |
			awk -v s="$codename" '$1 == s {print $2; exit}')
		MIRROR=${MIRROR:-http://deb.debian.org/debian/}
	fi
	work=$(mktemp -d /tmp/moat-setup-gvisor.XXXXXX)
	trap 'rm -rf "$work"' EXIT
	mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/sources.list.d" "$work/preferences.d" "$work/deb"
	cat >"$work/sources.list.d/runsc.sources" <<-EOF
		Types: deb
		URIs: $MIRROR
		Suites: $RUNSC_SUITE
		Components: main
		Signed-By: $KEYRING
	EOF
	# Only the private lists and sources: the system's apt state is neither
	# read for sources nor changed.
	apt_private=(
		-o "Dir::Etc::SourceList=/dev/null"
		-o "Dir::Etc::SourceParts=$work/sources.list.d"
		-o "Dir::Etc::Preferences=/dev/null"
		-o "Dir::Etc::PreferencesParts=$work/preferences.d"
		-o "Dir::State::Lists=$work/lists"
		-o "Dir::Cache=$work/cache"
		-o "Dir::State::status=/dev/null"
		-o "APT::Get::List-Cleanup=false"
		-o "APT::Sandbox::User=root"
	)
	say "fetching Debian $RUNSC_SUITE's package lists from $MIRROR (private apt configuration)"
	apt-get "${apt_private[@]}" update -qq
	version=$(apt-cache "${apt_private[@]}" show runsc 2>/dev/null | awk '/^Version:/ {print $2; exit}')
	[ -n "$version" ] || die "Debian $RUNSC_SUITE has no runsc package for $(dpkg --print-architecture)"
	say "downloading runsc $version from Debian $RUNSC_SUITE"
	(cd "$work/deb" && apt-get "${apt_private[@]}" download -qq "runsc=$version")
	deb=$(ls "$work"/deb/runsc_*.deb)
	deps=$(dpkg-deb -f "$deb" Depends Pre-Depends)
	[ -z "$deps" ] || die "runsc $version has dependencies ($deps); this script installs only a dependency-free runsc"
	say "installing $(basename "$deb") with dpkg"
	dpkg -i "$deb" >/dev/null
	RUNSC=$(find_runsc)
	[ -n "$RUNSC" ] || die "no runsc in /usr/local/bin, /usr/bin or /usr/sbin after installing $deb"
	has_systrap "$RUNSC" || die "$RUNSC, the runsc moat uses, lacks the systrap platform (an older one in /usr/local/bin shadows the package's?)"
fi
say "runsc: $RUNSC: $("$RUNSC" --version | head -1)"

# 2. A real run: systrap, no network, nothing but the host's root read-only.
check_root=$(mktemp -d /tmp/moat-runsc-check.XXXXXX)
if out=$(timeout 60 "$RUNSC" --root="$check_root" --platform=systrap --network=none \
	do /bin/sh -c 'echo moat-runsc-ok' 2>&1) && [[ "$out" == *moat-runsc-ok* ]]; then
	say "runsc runs programs here with the systrap platform"
else
	rm -rf "$check_root"
	printf '%s\n' "$out" | tail -20 >&2
	die "runsc could not run a program under systrap here (see above)"
fi
rm -rf "$check_root"

# 3. The shared sandbox root filesystem.
if ! command -v debootstrap >/dev/null; then
	say "installing debootstrap"
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
# The moat binary setup.sh built, or moat from this source tree.
if [ -n "${MOAT:-}" ]; then
	moat=("$MOAT")
else
	GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
	[ -x "$GO" ] || die "go is needed to build moat's root filesystem ($GO not found)"
	moat=("$GO" run ./cmd/moat)
fi
cd "$MOAT_REPO"
say "building the sandbox image: moat image build"
"${moat[@]}" image build
say "ready: $("$RUNSC" --version | head -1), platform systrap"
