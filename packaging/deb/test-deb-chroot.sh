#!/bin/bash
# Installs the .deb into a clean Debian root file system and runs, against
# the INSTALLED files and with no LD_LIBRARY_PATH in the environment:
#   1. dpkg -i with only the base system present (Depends satisfiable without
#      rdma-core), ldconfig's cache listing the plugin's NCCL file names;
#   2. `rustnet doctor --json` (the plugin's own init selects TCP there);
#   3. `rustnet bench` with NCCL's bare file name libnccl-net-rustnet.so,
#      resolved by the dynamic linker from the multiarch directory (LD_DEBUG
#      shows which file it opened), and with the tool's default plugin path;
#   4. the conformance suite's binary, its peers opening the installed
#      /usr/lib/<multiarch>/libnccl-net-rustnet.so by absolute path.
# Runs in a private mount namespace (unshare -m), so /proc and /dev bind
# mounts vanish with it whatever happens.
#   test-deb-chroot.sh ROOTFS.tar.gz PKG.deb CONFORMANCE_BINARY
set -euo pipefail
TAR=$1 DEB=$2 CONF=$3
MA=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
ROOT=$(mktemp -d /tmp/rustnet-deb-root.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
tar -C "$ROOT" -xzf "$TAR"
cp "$DEB" "$ROOT/tmp/rustnet.deb"
cp "$CONF" "$ROOT/tmp/conformance"
cat > "$ROOT/tmp/inside.sh" <<IN
#!/bin/sh
set -eu
unset LD_LIBRARY_PATH RUSTNET_PLUGIN
export PATH=/usr/sbin:/usr/bin:/sbin:/bin NCCL_SOCKET_IFNAME=lo
echo "-- dpkg -i (base system only)"
dpkg -i /tmp/rustnet.deb >/tmp/dpkg.log 2>&1 || { cat /tmp/dpkg.log; exit 1; }
dpkg -s rustnet | sed -n 's/^\(Version\|Depends\|Recommends\): /  \1: /p'
dpkg -L rustnet | grep -E '^/usr/(bin|lib)/' | sed 's/^/  /'
if dpkg -s libibverbs1 >/dev/null 2>&1; then echo "FAIL: libibverbs1 is in the base root"; exit 1; fi
ldconfig -p | grep -E 'lib(nccl-net-)?(lib)?rustnet\.so' | sed 's/^/  ldconfig: /'
ldconfig -p | grep -Eq "libnccl-net-rustnet.so .*=> (/usr)?/lib/$MA/libnccl-net-rustnet.so" \
  || { echo "FAIL: ldconfig cache lacks libnccl-net-rustnet.so"; exit 1; }
echo "-- rustnet doctor --json"
rc=0; rustnet doctor --json > /tmp/doctor.json || rc=\$?
echo "  exit \$rc (0 pass, 1 warn, 2 fail)"; [ \$rc -le 2 ]
echo "-- rustnet bench --plugin libnccl-net-rustnet.so (bare NCCL name, dynamic linker search)"
LD_DEBUG=libs rustnet bench --plugin libnccl-net-rustnet.so --sizes 4K,1M --reps 2 --bytes 32M --no-raw --lat-iters 200 \
  > /tmp/bench.out 2> /tmp/bench.ld
sed 's/^/  /' /tmp/bench.out | head -n 12
found=\$(grep -o 'trying file=[^ ]*libnccl-net-rustnet.so' /tmp/bench.ld | head -n 1 | sed 's/trying file=//')
echo "  the dynamic linker opened: \$found"
# merged /usr: /lib is a link to usr/lib, the linker may name either
echo "\$found" | grep -Eq "^(/usr)?/lib/$MA/libnccl-net-rustnet.so\$" || { echo "FAIL: expected /usr/lib/$MA/libnccl-net-rustnet.so"; grep -i rustnet /tmp/bench.ld | head; exit 1; }
echo "-- rustnet bench with the default plugin path (/usr/bin/rustnet -> ../lib/$MA/librustnet.so)"
rustnet bench --sizes 64K --reps 1 --bytes 8M --no-raw --lat-iters 0 > /tmp/bench2.out
grep -q "plugin /usr/lib/$MA/librustnet.so" /tmp/bench2.out || { echo "FAIL: default plugin path"; head -n 3 /tmp/bench2.out; exit 1; }
head -n 1 /tmp/bench2.out | sed 's/^/  /'
echo "-- conformance suite over the installed files (namespace cases need iproute2: not in a minbase root, filtered out)"
RUSTNET_PLUGIN=/usr/lib/$MA/librustnet.so RUSTNET_CONF_LIBNAME=/usr/lib/$MA/libnccl-net-rustnet.so \
  /tmp/conformance traffic_v grouped vdevice peer_killed garbage invalid_env injected_panic null_stale dlclose
IN
chmod +x "$ROOT/tmp/inside.sh"
unshare -m --propagation private sh -c '
  set -e
  mount -t proc proc "$1/proc"
  mount --rbind /dev "$1/dev"
  mount -t sysfs sysfs "$1/sys"
  mount -t tmpfs tmpfs "$1/dev/shm"
  exec chroot "$1" /tmp/inside.sh' sh "$ROOT"
python3 - "$ROOT/tmp/doctor.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = [c for c in d["checks"] if c["layer"] == "plugin" and c["what"] == "transport"]
print("  doctor verdict:", d["verdict"], "| export_env:", d["export_env"])
assert t and t[0]["status"] == "Pass" and t[0]["detail"].startswith("socket"), f"doctor: plugin init did not select TCP: {t}"
print("  doctor plugin check:", t[0]["status"], t[0]["detail"])
PY
