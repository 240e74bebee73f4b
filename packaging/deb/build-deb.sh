#!/bin/bash
# Builds the Debian package of librustnet with dpkg-deb (no cargo-deb needed:
# installing cargo-deb on a fresh CI machine means compiling it first).
#   packaging/deb/build-deb.sh [OUTDIR]      (default out/pkg; cargo build --release first)
# Layout (Debian multiarch, e.g. amd64):
#   /usr/lib/x86_64-linux-gnu/librustnet.so            the plugin (stripped)
#   /usr/lib/x86_64-linux-gnu/libnccl-net-rustnet.so   -> librustnet.so  (NCCL_NET_PLUGIN=rustnet, every NCCL 2.18+)
#   /usr/lib/x86_64-linux-gnu/libnccl-net-librustnet.so -> librustnet.so (NCCL_NET_PLUGIN=librustnet, 2.21+)
#   /usr/bin/rustnet                                    the operator tool (finds the plugin in ../lib/<multiarch>)
#   /usr/share/doc/rustnet/                             README, docs/*.md, copyright, changelog
# Depends is what dpkg-shlibdeps computes from the ELF files: libc6 and
# libgcc-s1 (Rust's unwinder; libc6 itself depends on it, so in practice
# "only libc"). libibverbs1 is Recommends: the plugin dlopens it at run time
# and serves TCP without it. Timestamps come from the last commit
# (SOURCE_DATE_EPOCH), so two builds of one commit give the same bytes.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-out/pkg}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for t in dpkg-deb dpkg-shlibdeps dpkg-architecture strip; do
  command -v "$t" >/dev/null || { echo "build-deb: $t is missing (apt-get install dpkg-dev binutils)" >&2; exit 1; }
done
SO=target/release/librustnet.so BIN=target/release/rustnet
[ -f "$SO" ] && [ -f "$BIN" ] || { echo "build-deb: $SO or $BIN missing: run cargo build --release first" >&2; exit 1; }
VERSION=$(awk -F'"' '/^version *=/{print $2; exit}' Cargo.toml)
DEBVER="${VERSION}-1"
ARCH=$(dpkg-architecture -qDEB_HOST_ARCH)
MA=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
R="$STAGE/root"
install -d "$R/DEBIAN" "$R/usr/bin" "$R/usr/lib/$MA" "$R/usr/share/doc/rustnet/docs"
install -m 644 "$SO" "$R/usr/lib/$MA/librustnet.so"
install -m 755 "$BIN" "$R/usr/bin/rustnet"
# What Debian's dh_strip does for a shared library and a program.
strip --remove-section=.comment --remove-section=.note --strip-unneeded "$R/usr/lib/$MA/librustnet.so"
strip --remove-section=.comment --remove-section=.note "$R/usr/bin/rustnet"
ln -s librustnet.so "$R/usr/lib/$MA/libnccl-net-rustnet.so"
ln -s librustnet.so "$R/usr/lib/$MA/libnccl-net-librustnet.so"
install -m 644 README.md "$R/usr/share/doc/rustnet/README.md"
for f in docs/*.md docs/*.svg; do install -m 644 "$f" "$R/usr/share/doc/rustnet/docs/"; done
cat > "$R/usr/share/doc/rustnet/copyright" <<C
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: librustnet
Source: this repository (built from commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))

Files: *
Copyright: the librustnet authors
License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 can be found in
 /usr/share/common-licenses/Apache-2.0.
C
{
  echo "rustnet ($DEBVER) unstable; urgency=medium"
  echo
  echo "  * Built from commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
  echo
  echo " -- librustnet builders <noreply@localhost>  $(date -u -R -d "@$SOURCE_DATE_EPOCH")"
} | gzip -9n > "$R/usr/share/doc/rustnet/changelog.Debian.gz"

# Dependencies from the ELF files themselves.
mkdir -p "$STAGE/src/debian"
printf 'Source: rustnet\n\nPackage: rustnet\nArchitecture: any\n' > "$STAGE/src/debian/control"
DEPS=$(cd "$STAGE/src" && dpkg-shlibdeps -O "$R/usr/lib/$MA/librustnet.so" "$R/usr/bin/rustnet" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$DEPS" ] || { echo "build-deb: dpkg-shlibdeps found no dependencies" >&2; exit 1; }
SIZE_KB=$(du -sk --exclude=DEBIAN "$R" | cut -f1)
cat > "$R/DEBIAN/control" <<C
Package: rustnet
Version: $DEBVER
Architecture: $ARCH
Maintainer: librustnet builders <noreply@localhost>
Installed-Size: $SIZE_KB
Depends: $DEPS
Recommends: libibverbs1, ibverbs-providers
Section: net
Priority: optional
Multi-Arch: foreign
Description: NCCL network plugin over ibverbs and TCP, and its operator tool
 librustnet is an NCCL network plugin (net ABI v6-v12, NCCL 2.18 and later)
 that carries collective traffic over InfiniBand/RoCE verbs where an active
 RDMA port exists and over TCP elsewhere. Set NCCL_NET_PLUGIN=rustnet; the
 plugin is installed under NCCL's file names in the multiarch library
 directory, so no LD_LIBRARY_PATH is needed.
 .
 The rustnet tool checks the fabric (rustnet doctor), benchmarks the plugin
 (rustnet bench) and finds slow nodes (rustnet agent, rustnet bisect).
C
# The plugin lives in a directory of the dynamic linker's cache.
echo "activate-noawait ldconfig" > "$R/DEBIAN/triggers"
(cd "$R" && find usr -type f -print0 | sort -z | xargs -0 md5sum) > "$R/DEBIAN/md5sums"
chmod 644 "$R/DEBIAN/control" "$R/DEBIAN/triggers" "$R/DEBIAN/md5sums"
find "$R" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
DEB="$OUT/rustnet_${DEBVER}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zxz --build "$R" "$DEB" >/dev/null
echo "$DEB"
