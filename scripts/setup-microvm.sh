#!/usr/bin/env bash
# setup-microvm.sh: what moat's microvm level needs.
#
# Idempotent; run as root on Debian 12 (or a Debian-like system), as often as
# you like. It:
#   1. installs QEMU (qemu-system-x86, its microvm machine type; from
#      bookworm-backports on bookworm, MOAT_QEMU=debian keeps bookworm's
#      7.2, which copies the guest's memory per VM), e2fsprogs
#      (mkfs.ext4 -d makes the root disk) and debootstrap (to build moat's
#      shared image);
#   2. downloads Debian's cloud kernel package (linux-image-cloud-amd64's
#      current dependency) with apt-get download and extracts it into
#      ${STATE}/microvm/kernels/RELEASE, without installing it as the host's
#      kernel;
#   3. builds moat's minimal guest kernel from Debian's kernel source
#      (linux-source-6.1, configured by microvm/kernel/guest.config) into
#      ${STATE}/microvm/kernels/moat-6.1, unless it is there from the same
#      config and source; it boots faster than the cloud kernel, which the
#      level uses only when this one is missing (MOAT_GUEST_KERNEL=debian
#      skips the build; a failed build is reported, remembered in
#      ${STATE}/microvm/kernel-build.failed and not tried again for the same
#      config and source, and never fails the set-up);
#   4. builds the guest agent (static, CGO_ENABLED=0) into
#      ${STATE}/microvm/bin/moat-guest-agent, for moat binaries that run far
#      from their source (a moat run from this tree builds its own, cached);
#   5. makes sure the shared image is built (moat image build; cached).
# The first sandbox then makes the initramfs, the root disk and the template
# VM, and probes KVM, each once, cached in ${STATE}/microvm.
#
# Environment: STATE (default /var/lib/moat), KERNEL_PACKAGE (default: what
# linux-image-cloud-amd64 depends on), GO (go binary).
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${STATE:-/var/lib/moat}
say() { printf 'setup-microvm: %s\n' "$*"; }
die() { printf 'setup-microvm: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages; the level runs QEMU under uids of its own)"
[ "$(dpkg --print-architecture)" = amd64 ] || die "the microvm level is built for amd64 hosts only"
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}

# 1. Packages. QEMU comes from bookworm-backports (Debian's own QEMU 10,
# built against bookworm's libraries) where the host is bookworm: its
# memory-backend-file takes readonly=on, which lets every VM restored from
# one saved state map that state's RAM file copy-on-write, read-only, and
# share its pages (the level falls back to a copy per VM with QEMU 7.2).
export DEBIAN_FRONTEND=noninteractive
need=()
for p in e2fsprogs debootstrap ca-certificates; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
	say "installing ${need[*]}"
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
	say "packages already installed"
fi
backports=/etc/apt/sources.list.d/moat-backports.sources
qemu_from=()
if [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" = bookworm ] && [ "${MOAT_QEMU:-backports}" = backports ]; then
	if [ ! -f "$backports" ]; then
		cat >"$backports.tmp" <<-'SRC'
			Types: deb
			URIs: http://deb.debian.org/debian
			Suites: bookworm-backports
			Components: main
			Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
		SRC
		mv "$backports.tmp" "$backports"
		apt-get update -qq
	fi
	qemu_from=(-t bookworm-backports)
fi
qemu_want=$(apt-cache policy "${qemu_from[@]}" qemu-system-x86 2>/dev/null | awk '/Candidate:/ {print $2}')
if [ -z "$qemu_want" ] || [ "$qemu_want" = "(none)" ]; then
	apt-get update -qq
	qemu_want=$(apt-cache policy "${qemu_from[@]}" qemu-system-x86 | awk '/Candidate:/ {print $2}')
fi
if [ "$(dpkg-query -W -f='${Status} ${Version}' qemu-system-x86 2>/dev/null)" = "install ok installed $qemu_want" ]; then
	say "qemu-system-x86 $qemu_want already installed"
else
	say "installing qemu-system-x86 $qemu_want ${qemu_from[*]}"
	apt-get install -y -qq --no-install-recommends "${qemu_from[@]}" qemu-system-x86 >/dev/null
fi
say "qemu: $(qemu-system-x86_64 --version | head -1)"

# 2. The guest kernel, extracted into the state directory.
if [ -z "${KERNEL_PACKAGE:-}" ]; then
	KERNEL_PACKAGE=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
	if [ -z "$KERNEL_PACKAGE" ]; then
		apt-get update -qq
		KERNEL_PACKAGE=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
	fi
fi
[ -n "$KERNEL_PACKAGE" ] || die "cannot tell which package linux-image-cloud-amd64 depends on"
release=${KERNEL_PACKAGE#linux-image-}
kdir=$STATE/microvm/kernels/$release
if [ -f "$kdir/boot/vmlinuz-$release" ] && [ -f "$kdir/lib/modules/$release/kernel/drivers/virtio/virtio_mmio.ko" ]; then
	say "guest kernel $release already in $kdir"
else
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	say "downloading $KERNEL_PACKAGE"
	chown _apt "$tmp" 2>/dev/null || true
	(cd "$tmp" && apt-get download -qq "$KERNEL_PACKAGE" >/dev/null 2>&1) ||
		(apt-get update -qq && cd "$tmp" && apt-get download -qq "$KERNEL_PACKAGE" >/dev/null)
	deb=$(ls "$tmp"/*.deb)
	mkdir -p "$STATE/microvm/kernels"
	rm -rf "$kdir.tmp"
	dpkg-deb -x "$deb" "$kdir.tmp"
	[ -f "$kdir.tmp/boot/vmlinuz-$release" ] || die "$deb holds no boot/vmlinuz-$release"
	chmod -R a+rX "$kdir.tmp"
	rm -rf "$kdir"
	mv "$kdir.tmp" "$kdir"
	say "guest kernel $release extracted into $kdir (not installed as the host's kernel)"
fi

# 3. moat's minimal guest kernel.
if [ "${MOAT_GUEST_KERNEL:-minimal}" = debian ]; then
	say "MOAT_GUEST_KERNEL=debian: not building the minimal kernel"
	rm -rf "$STATE/microvm/kernels/moat-6.1" "$STATE/microvm/kernel-build.failed"
else
	mdir=$STATE/microvm/kernels/moat-6.1
	srcver=$(dpkg-query -W -f='${Version}' linux-source-6.1 2>/dev/null || apt-cache policy linux-source-6.1 | awk '/Candidate:/ {print $2}')
	stamp=$( (cat microvm/kernel/guest.config microvm/kernel/build.sh; echo "$srcver") | sha256sum | cut -c1-16)
	# A build that failed is not tried again for the same stamp: it would
	# cost every later set-up (every CI run) its minutes again. Remove
	# $failed to try again.
	failed=$STATE/microvm/kernel-build.failed
	if [ -f "$mdir/moat-build" ] && [ "$(cat "$mdir/moat-build")" = "$stamp" ]; then
		say "minimal guest kernel already built in $mdir"
	elif [ -f "$failed" ] && [ "$(cat "$failed")" = "$stamp" ]; then
		say "warning: the minimal kernel failed to build from this config and source before (rm $failed to retry); the level uses ${mdir##*/} from an older config if present, else Debian's cloud kernel"
	else
		say "building the minimal guest kernel (linux-source-6.1 $srcver, a few minutes)"
		rm -rf "$mdir.tmp"
		if timeout 1800 bash microvm/kernel/build.sh "$mdir.tmp" >/tmp/moat-kernel-build.log 2>&1; then
			echo "$stamp" >"$mdir.tmp/moat-build"
			rm -rf "$mdir" "$failed"
			mv "$mdir.tmp" "$mdir"
			say "minimal guest kernel built into $mdir"
		else
			rm -rf "$mdir.tmp"
			echo "$stamp" >"$failed"
			tail -5 /tmp/moat-kernel-build.log >&2 || true
			say "warning: the minimal kernel did not build (log: /tmp/moat-kernel-build.log); the level uses ${mdir##*/} from an older config if present, else Debian's cloud kernel"
		fi
	fi
fi

# 4. The guest agent.
if [ -x "$GO" ]; then
	out=$STATE/microvm/bin/moat-guest-agent
	mkdir -p "$(dirname "$out")"
	CGO_ENABLED=0 GOFLAGS=-buildvcs=false "$GO" build -trimpath -ldflags='-s -w' -o "$out.tmp" ./microvm/agent
	chmod 0755 "$out.tmp"
	mv "$out.tmp" "$out"
	say "guest agent built into $out"
else
	say "no go toolchain: the guest agent is built by moat itself where its source is"
fi

# 5. The shared image.
if [ -x "$GO" ]; then
	say "making sure the shared image is built (moat image build)"
	# moat image build also imports the image into Docker; where no Docker
	# engine answers, build the root filesystem alone, which is all this
	# level reads.
	# setup.sh passes the moat it built as MOAT; go run would link another.
	moat=("$GO" run ./cmd/moat)
	[ -x "${MOAT:-}" ] && moat=("$MOAT")
	if ! "${moat[@]}" image build --state-dir "$STATE"; then
		say "moat image build failed (no Docker engine?); building the root filesystem only"
		STATE=$STATE "$GO" run ./microvm/internal/buildimage
	fi
else
	say "no go toolchain: run 'moat image build' yourself"
fi
say "ready: the first microvm sandbox makes the disk, the initramfs and the template (and probes KVM), each once"
