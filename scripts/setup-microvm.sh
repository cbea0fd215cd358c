#!/usr/bin/env bash
# setup-microvm.sh: what moat's microvm level needs.
#
# Idempotent; run as root on Debian 12 (or a Debian-like system), as often as
# you like. It:
#   1. installs QEMU (qemu-system-x86, its microvm machine type), e2fsprogs
#      (mkfs.ext4 -d makes the root disk) and debootstrap (to build moat's
#      shared image);
#   2. downloads Debian's cloud kernel package (linux-image-cloud-amd64's
#      current dependency) with apt-get download and extracts it into
#      ${STATE}/microvm/kernels/RELEASE, without installing it as the host's
#      kernel;
#   3. builds the guest agent (static, CGO_ENABLED=0) into
#      ${STATE}/microvm/bin/moat-guest-agent, for moat binaries that run far
#      from their source (a moat run from this tree builds its own, cached);
#   4. makes sure the shared image is built (moat image build; cached).
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

# 1. Packages.
need=()
for p in qemu-system-x86 e2fsprogs debootstrap ca-certificates; do
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

# 3. The guest agent.
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

# 4. The shared image.
if [ -x "$GO" ]; then
	say "making sure the shared image is built (moat image build)"
	if "$GO" run ./cmd/moat help 2>&1 | grep -qw image; then
		"$GO" run ./cmd/moat image build
	else
		# This moat has no image command yet: build the root filesystem
		# with package image directly.
		"$GO" run ./microvm/internal/buildimage
	fi
else
	say "no go toolchain: run 'moat image build' yourself"
fi
say "ready: the first microvm sandbox makes the disk, the initramfs and the template (and probes KVM), each once"
