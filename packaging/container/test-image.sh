#!/bin/bash
# Tests the librustnet layer image the way a user takes it: a Debian base image
# made offline from the debootstrapped root (podman import), the layer copied in
# by Containerfile.example (multi-stage COPY --from), then inside a container
# (network none: loopback only):
#   - the layer holds only the plugin, its two NCCL links, the tool and the copyright;
#   - `rustnet doctor --json` (plugin init selects TCP);
#   - `rustnet bench` over NCCL's bare file name, found by the dynamic linker
#     with no LD_LIBRARY_PATH (LD_DEBUG names the file);
#   - the conformance suite's binary (bind-mounted read-only) over the
#     installed files.
# Where containers cannot run here, it says so and why, and runs the same
# checks in a chroot of the base root plus the layer's files instead.
#   test-image.sh ROOTFS.tar.gz IMAGE CONFORMANCE_BINARY
set -euo pipefail
cd "$(dirname "$0")/../.."
TAR=$(readlink -f "$1") IMG=$2 CONF=$(readlink -f "$3")
. packaging/container/podman-env.sh
MA=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
SUM=$(sha256sum "$TAR" | cut -c1-12)
BASE=localhost/rustnet-ci-debian:$SUM
if ! $PODMAN image exists "$BASE"; then
  echo "-- podman import $(basename "$TAR") as $BASE"
  $PODMAN import -q "$TAR" "$BASE" >/dev/null
fi
echo "-- what the layer holds"
ctr=$($PODMAN create "$IMG" /usr/bin/rustnet)
LIST=$(mktemp)
trap 'rm -f "$LIST"; $PODMAN rm -f "$ctr" >/dev/null 2>&1 || true' EXIT
$PODMAN export "$ctr" | tar -t | grep -v '/$' | sort > "$LIST"
sed 's/^/  /' "$LIST"
want=$(printf '%s\n' usr/bin/rustnet "usr/lib/$MA/libnccl-net-librustnet.so" "usr/lib/$MA/libnccl-net-rustnet.so" \
  "usr/lib/$MA/librustnet.so" usr/share/doc/rustnet/copyright | sort)
[ "$(cat "$LIST")" = "$want" ] || { echo "FAIL: the layer holds other files than the plugin and the tool"; exit 1; }
echo "  layer size: $($PODMAN image inspect --format '{{.Size}}' "$IMG") bytes uncompressed"

INSIDE='set -eu
unset LD_LIBRARY_PATH RUSTNET_PLUGIN
export NCCL_SOCKET_IFNAME=lo
echo "-- rustnet doctor --json"
rc=0; rustnet doctor --json > /tmp/doctor.json || rc=$?
echo "  exit $rc"; [ $rc -le 2 ]
echo "-- rustnet bench --plugin libnccl-net-rustnet.so (dynamic linker search)"
LD_DEBUG=libs rustnet bench --plugin libnccl-net-rustnet.so --sizes 4K,1M --reps 2 --bytes 32M --no-raw --lat-iters 200 > /tmp/bench.out 2> /tmp/bench.ld
head -n 6 /tmp/bench.out | sed "s/^/  /"
found=$(grep -o "trying file=[^ ]*libnccl-net-rustnet.so" /tmp/bench.ld | head -n 1 | sed "s/trying file=//")
echo "  the dynamic linker opened: $found"
echo "$found" | grep -Eq "^(/usr)?/lib/MA/libnccl-net-rustnet.so\$" || { echo "FAIL: not the installed file"; exit 1; }
echo "-- conformance suite over the installed files (namespace cases filtered out: no iproute2 in the base)"
RUSTNET_PLUGIN=/usr/lib/MA/librustnet.so RUSTNET_CONF_LIBNAME=/usr/lib/MA/libnccl-net-rustnet.so \
  /opt/conformance traffic_v grouped vdevice peer_killed garbage invalid_env injected_panic null_stale dlclose
cat /tmp/doctor.json > /tmp/out/doctor.json'
INSIDE=${INSIDE//MA/$MA}
OUTD=$(mktemp -d)
if podman_can_run "$BASE"; then
  echo "-- containers run here: $PODMAN $PODMAN_RUN_OPTS"
  T=localhost/rustnet-ci-test:$SUM
  $PODMAN build --quiet $PODMAN_RUN_OPTS --build-arg BASE="$BASE" --build-arg RUSTNET="$IMG" \
    -f packaging/container/Containerfile.example -t "$T" packaging/container >/dev/null
  echo "-- built $T from Containerfile.example (base + COPY --from the layer + ldconfig)"
  $PODMAN run --rm $PODMAN_RUN_OPTS -v "$CONF:/opt/conformance:ro" -v "$OUTD:/tmp/out" "$T" sh -c "$INSIDE"
  $PODMAN rmi "$T" >/dev/null 2>&1 || true
else
  echo "!! SKIPPED: running containers with podman on this machine ($PODMAN_RUN_WHY)"
  echo "!! falling back: the same checks in a chroot of the base root plus the layer's files"
  ROOT=$(mktemp -d /tmp/rustnet-img-root.XXXXXX)
  tar -C "$ROOT" -xzf "$TAR"
  $PODMAN export "$ctr" | tar -C "$ROOT" -x
  cp "$CONF" "$ROOT/opt/conformance"; mkdir -p "$ROOT/tmp/out"
  unshare -m --propagation private sh -c '
    set -e
    mount -t proc proc "$1/proc"; mount --rbind /dev "$1/dev"; mount -t tmpfs tmpfs "$1/dev/shm"
    chroot "$1" ldconfig
    exec chroot "$1" /bin/sh -c "$2"' sh "$ROOT" "$INSIDE"
  cp "$ROOT/tmp/out/doctor.json" "$OUTD/"
  rm -rf "$ROOT"
fi
python3 - "$OUTD/doctor.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = [c for c in d["checks"] if c["layer"] == "plugin" and c["what"] == "transport"]
assert t and t[0]["status"] == "Pass" and t[0]["detail"].startswith("socket"), f"doctor: plugin init did not select TCP: {t}"
print("  doctor --json: verdict", d["verdict"], "| plugin:", t[0]["detail"], "| export_env:", d["export_env"])
PY
rm -rf "$OUTD"
$PODMAN image prune -f >/dev/null 2>&1 || true   # earlier builds of the layer, untagged by this one
