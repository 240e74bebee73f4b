#!/bin/bash
# Packaging checks (scripts/test.sh runs this as its own step): builds the
# .deb, the Python wheel and the OCI layer, installs each where a user would,
# and runs the plugin from there; validates the Kubernetes manifests offline.
#   1. tools        apt: dpkg-dev debootstrap podman runc python3-venv; PyPI (pinned, cached venv):
#                   kubernetes-validate (Kubernetes' schemas) and auditwheel
#   2. deb          build; contents (multiarch dir, NCCL's two names as links, /usr/bin/rustnet, docs);
#                   Depends only libc6/libgcc-s1, libibverbs1 only recommended; no NEEDED on rdma/CUDA
#                   libraries; a second build of the same commit is byte-identical
#   3. rootfs       a clean Debian root (debootstrap minbase), cached under /var/cache/rustnet-ci
#   4. deb-chroot   dpkg -i into that root, then with no LD_LIBRARY_PATH: ldconfig cache, rustnet doctor
#                   --json, rustnet bench over NCCL's bare file name, the conformance suite
#   5. wheel        build; auditwheel show agrees with the computed manylinux tag; fresh venv:
#                   plugin-path, check (dlopen in Python), env, bench, the conformance suite
#   6. image        OCI layer built offline with podman (only the plugin and the tool), saved as an
#                   OCI archive; Containerfile.example builds a Debian image with it; inside: doctor
#                   --json, bench, the conformance suite (chroot fallback, said loudly, where
#                   containers cannot run)
#   7. k8s          deploy/validate.py (strict schemas of Kubernetes 1.37 and 1.30, the NAD CRD schema,
#                   cross-checks) and deploy/tests (validator negatives; the training pod's environment
#                   rendered from the init container's real rustnet doctor --export-env output)
# Artefacts land in out/pkg/. Heavy steps run under nice -n 19.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${RUSTNET_ROOTFS_CACHE:-/var/cache/rustnet-ci}
OUT=out/pkg
mkdir -p "$OUT" "$CACHE"
T0=$(date +%s)
declare -a SUMMARY=()
step_t=0 step_name=""
step() {  # closes the previous step's timer, opens the next
  local now; now=$(date +%s)
  [ -n "$step_name" ] && SUMMARY+=("$(printf '%-11s %4ss' "$step_name" $((now - step_t)))")
  step_name=$1; step_t=$now
  [ "$1" = end ] || echo "== package-check: $1: $2"
}

step tools "apt and PyPI packages this check needs"
need=""
for p in dpkg-dev debootstrap podman runc binutils; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need="$need $p"
done
VTEST=$(mktemp -d)
python3 -m venv "$VTEST/v" >/dev/null 2>&1 || need="$need python3-venv"
rm -rf "$VTEST"
if [ -n "$need" ]; then
  echo "installing:$need"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends $need >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $need >/dev/null; }
fi
PYPINS="kubernetes-validate==1.37.0 auditwheel==6.8.2"
TOOLS="$CACHE/pytools-$(echo "$PYPINS $(python3 -V 2>&1)" | sha256sum | cut -c1-10)"
if [ ! -x "$TOOLS/bin/kubernetes-validate" ] || [ ! -x "$TOOLS/bin/auditwheel" ]; then
  rm -rf "$TOOLS"
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q --disable-pip-version-check $PYPINS
fi
echo "tools venv: $TOOLS ($("$TOOLS/bin/pip" list --disable-pip-version-check 2>/dev/null | grep -iE '^(kubernetes-validate|auditwheel|jsonschema) ' | tr -s ' ' | paste -sd, -))"

step build "release build and the conformance suite's binary"
nice -n 19 cargo build --release --quiet
CONF=$(nice -n 19 cargo test --release --test conformance --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "conformance":
        print(m["executable"])')
[ -x "$CONF" ] || { echo "FAIL: no conformance binary"; exit 1; }

step deb "build the Debian package and check what it holds"
DEB=$(packaging/deb/build-deb.sh "$OUT")
MA=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
LISTING=$(dpkg-deb -c "$DEB")
echo "$LISTING" | awk '$6 ~ /usr\/(bin|lib)\/./ {print "  " $1, $6, $7, $8}'
for want in "./usr/lib/$MA/librustnet.so" "./usr/lib/$MA/libnccl-net-rustnet.so -> librustnet.so" \
            "./usr/lib/$MA/libnccl-net-librustnet.so -> librustnet.so" ./usr/bin/rustnet \
            ./usr/share/doc/rustnet/copyright ./usr/share/doc/rustnet/docs/knobs.md; do
  grep -qF -- " $want" <<< "$LISTING" || { echo "FAIL: $want not in the package"; exit 1; }
done
deps=$(dpkg-deb -f "$DEB" Depends)
echo "  Depends: $deps | Recommends: $(dpkg-deb -f "$DEB" Recommends)"
others=$(echo "$deps" | tr ',' '\n' | sed 's/(.*//; s/ //g' | grep -vxE 'libc6|libgcc-s1' || true)
[ -z "$others" ] || { echo "FAIL: the package depends on more than libc: $others"; exit 1; }
X=$(mktemp -d); dpkg-deb -x "$DEB" "$X"
if readelf -d "$X/usr/lib/$MA/librustnet.so" | grep NEEDED | grep -E 'ibverbs|rdmacm|libcuda|cudart'; then
  echo "FAIL: the packaged plugin links rdma-core or CUDA"; exit 1
fi
rm -rf "$X"
sum1=$(sha256sum "$DEB" | cut -d' ' -f1)
cp "$DEB" "$DEB.first"; packaging/deb/build-deb.sh "$OUT" >/dev/null
sum2=$(sha256sum "$DEB" | cut -d' ' -f1); rm -f "$DEB.first"
[ "$sum1" = "$sum2" ] || { echo "FAIL: two builds of one commit differ ($sum1 vs $sum2)"; exit 1; }
echo "  reproducible: two builds give sha256 ${sum1:0:16}..."

step rootfs "a clean Debian root file system"
ROOTFS=$(packaging/rootfs.sh)

step deb-chroot "install the .deb into the clean root and run the plugin from there"
nice -n 19 packaging/deb/test-deb-chroot.sh "$ROOTFS" "$DEB" "$CONF"

step wheel "build the wheel, check its tag, install it into a fresh venv and run the plugin from there"
WHL=$(python3 packaging/wheel/build_wheel.py --out "$OUT")
"$TOOLS/bin/auditwheel" show "$WHL" > "$OUT/auditwheel.txt" 2>&1 || { cat "$OUT/auditwheel.txt"; echo "FAIL: auditwheel show"; exit 1; }
tag=$(basename "$WHL" .whl | sed 's/.*-py3-none-//')
grep -q "consistent with the following platform tag: \"$tag\"" <(tr -s ' \n' ' ' < "$OUT/auditwheel.txt") \
  || { cat "$OUT/auditwheel.txt"; echo "FAIL: auditwheel disagrees with the tag $tag"; exit 1; }
echo "  auditwheel show: consistent with $tag (external libraries: libc, libm, libgcc_s only)"
nice -n 19 packaging/wheel/test-wheel.sh "$WHL" "$CONF"

step image "the OCI layer: build offline with podman, then run the plugin inside a container"
IMG=$(packaging/container/build-image.sh "$DEB" "$OUT")
nice -n 19 packaging/container/test-image.sh "$ROOTFS" "$IMG" "$CONF"

step k8s "validate the Kubernetes manifests offline; render the training pod's environment"
"$TOOLS/bin/python" deploy/validate.py
RUSTNET_BIN=target/release/rustnet "$TOOLS/bin/python" -m unittest discover -s deploy/tests -v 2>&1 | grep -E '^(test_|Ran |OK|FAILED)|Error|SKIPPED' \
  ; [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAIL: deploy/tests"; exit 1; }

step end ""
echo "== package-check: artefacts"
for f in "$DEB" "$WHL" "$OUT"/rustnet-plugin-*.oci.tar; do
  printf '  %-60s %9s bytes\n' "$(basename "$f")" "$(stat -c %s "$f")"
done
echo "== package-check: wall time per step (total $(( $(date +%s) - T0 ))s)"
printf '  %s\n' "${SUMMARY[@]}"
echo "package-check: all steps passed"
