#!/bin/bash
# Prints the path of a clean Debian root file system as a tarball, building it
# with debootstrap (minbase: what `debootstrap --variant=minbase` installs and
# nothing else) the first time. Cached under /var/cache/rustnet-ci so reruns on
# the same machine skip the ~1 minute download; a fresh machine builds it.
#   RUSTNET_DEBIAN_SUITE   (default: this machine's codename, else bookworm)
#   RUSTNET_DEBIAN_MIRROR  (default http://deb.debian.org/debian)
#   RUSTNET_ROOTFS_CACHE   (default /var/cache/rustnet-ci)
set -euo pipefail
SUITE=${RUSTNET_DEBIAN_SUITE:-$(. /etc/os-release 2>/dev/null; [ "${ID:-}" = debian ] && echo "${VERSION_CODENAME:-}")}
SUITE=${SUITE:-bookworm}
MIRROR=${RUSTNET_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${RUSTNET_ROOTFS_CACHE:-/var/cache/rustnet-ci}
ARCH=$(dpkg --print-architecture)
TAR="$CACHE/debian-$SUITE-minbase-$ARCH.tar.gz"
if [ -s "$TAR" ]; then
  echo "[rootfs] cached: $TAR" >&2
  echo "$TAR"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "[rootfs] debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }
mkdir -p "$CACHE"
WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "[rootfs] debootstrap --variant=minbase $SUITE from $MIRROR (first run on this machine)" >&2
if ! nice -n 19 debootstrap --variant=minbase --arch="$ARCH" "$SUITE" "$WORK/root" "$MIRROR" > "$WORK/log" 2>&1; then
  tail -n 20 "$WORK/log" >&2
  echo "[rootfs] debootstrap failed" >&2
  exit 1
fi
rm -rf "$WORK/root/var/cache/apt/archives/"*.deb "$WORK/root/var/lib/apt/lists/"*
tar -C "$WORK/root" --numeric-owner -czf "$WORK/rootfs.tar.gz" .
mv "$WORK/rootfs.tar.gz" "$TAR"
echo "[rootfs] built $TAR ($(du -h "$TAR" | cut -f1))" >&2
echo "$TAR"
