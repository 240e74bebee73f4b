#!/bin/bash
# Builds the OCI image of the librustnet layer offline with podman, from the
# files of the .deb (no registry, no network), and saves it as an OCI archive.
#   packaging/container/build-image.sh DEB [OUTDIR]     (default out/pkg)
# Prints the image name; the archive is OUTDIR/rustnet-plugin-<version>.oci.tar
# (load it elsewhere with `podman load -i` or `skopeo copy oci-archive:...`).
# Storage: $RUSTNET_PODMAN_ROOT (default /var/cache/rustnet-ci/containers),
# vfs driver, so it works without overlayfs and leaves the machine's own
# podman storage alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEB=$(readlink -f "$1"); OUT=${2:-out/pkg}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
command -v podman >/dev/null || { echo "build-image: podman is missing (apt-get install podman runc)" >&2; exit 1; }
. packaging/container/podman-env.sh
VERSION=$(dpkg-deb -f "$DEB" Version | sed 's/-[^-]*$//')
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
dpkg-deb -x "$DEB" "$STAGE/all"
mkdir -p "$STAGE/ctx/usr/share/doc/rustnet"
cp -a "$STAGE/all/usr/bin" "$STAGE/all/usr/lib" "$STAGE/ctx/usr/"
cp -a "$STAGE/all/usr/share/doc/rustnet/copyright" "$STAGE/ctx/usr/share/doc/rustnet/"
cp packaging/container/Containerfile "$STAGE/ctx/"
IMG=localhost/rustnet-plugin:$VERSION
$PODMAN build --quiet --network none --timestamp "${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}" \
  -f "$STAGE/ctx/Containerfile" -t "$IMG" -t localhost/rustnet-plugin:latest "$STAGE/ctx" >/dev/null
rm -f "$OUT/rustnet-plugin-$VERSION.oci.tar"
$PODMAN save -q --format oci-archive -o "$OUT/rustnet-plugin-$VERSION.oci.tar" "$IMG"
echo "$IMG"
