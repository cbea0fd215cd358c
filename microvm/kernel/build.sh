#!/usr/bin/env bash
# build.sh: build moat's minimal guest kernel from Debian's kernel source.
#
#   microvm/kernel/build.sh OUTDIR
#
# Takes the source from Debian's linux-source-6.1 package (the same source
# as linux-image-cloud-amd64), configures it as `make tinyconfig` plus
# guest.config (beside this script), builds bzImage and installs
#   OUTDIR/boot/vmlinuz-REL and OUTDIR/boot/config-REL
# which is the layout the microvm level's Config.KernelDir expects. Nothing
# is installed as the host's kernel. Needs root for apt-get when the
# packages are missing; takes a few minutes on two cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTDIR}
say() { printf 'kernel/build.sh: %s\n' "$*"; }

need=()
for p in linux-source-6.1 build-essential bc flex bison libelf-dev xz-utils; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
	say "installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
tarball=$(ls /usr/src/linux-source-6.1.tar.xz)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say "unpacking $tarball"
tar -C "$work" -xf "$tarball"
src=$(ls -d "$work"/linux-source-*)
cd "$src"
make -s tinyconfig >/dev/null
./scripts/kconfig/merge_config.sh -m .config "$here/guest.config" >/dev/null
make -s olddefconfig
# Every option of guest.config must have survived olddefconfig.
missing=0
while read -r line; do
	case "$line" in
	CONFIG_*=n) opt=${line%=n}; grep -q "^$opt=" .config && { say "not off: $opt"; missing=1; } ;;
	CONFIG_*=*) grep -qx "$line" .config || { say "not set: $line"; missing=1; } ;;
	esac
done < <(grep -E '^CONFIG_' "$here/guest.config")
[ "$missing" = 0 ] || { say "guest.config does not apply to this source"; exit 1; }
say "building bzImage with $(nproc) jobs"
make -s -j"$(nproc)" bzImage
rel=$(make -s kernelrelease)
mkdir -p "$out/boot"
cp arch/x86/boot/bzImage "$out/boot/vmlinuz-$rel"
cp .config "$out/boot/config-$rel"
chmod -R a+rX "$out"
say "installed $out/boot/vmlinuz-$rel"
