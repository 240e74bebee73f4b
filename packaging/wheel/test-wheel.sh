#!/bin/bash
# Installs the wheel into a fresh venv (no index: only the wheel itself) and
# checks, with no LD_LIBRARY_PATH in the environment:
#   - `python -m librustnet plugin-path` is an absolute path inside the venv;
#   - `python -m librustnet check` dlopens it in the Python process (RTLD_NOW|RTLD_LOCAL, as NCCL);
#   - `python -m librustnet env` sourced by sh sets NCCL_NET_PLUGIN to that path;
#   - the `rustnet` console script and `python -m librustnet bench` drive the
#     plugin from that path: init, devices, listen, connect/accept, traffic;
#   - the conformance suite's binary runs over the plugin file inside the venv.
#   test-wheel.sh WHEEL CONFORMANCE_BINARY
set -euo pipefail
WHL=$(readlink -f "$1") CONF=$(readlink -f "$2")
unset LD_LIBRARY_PATH RUSTNET_PLUGIN
export NCCL_SOCKET_IFNAME=lo
V=$(mktemp -d /tmp/rustnet-wheel-venv.XXXXXX)
trap 'rm -rf "$V"' EXIT
python3 -m venv "$V"
"$V/bin/pip" install -q --no-index --disable-pip-version-check "$WHL"
cd "$V"   # not the source tree: the import must come from site-packages
PY="$V/bin/python"
echo "-- pip show"
"$V/bin/pip" show -f librustnet | grep -E '^(Name|Version|Location)|lib/|bin/' | sed 's/^/  /'
P=$("$PY" -m librustnet plugin-path)
echo "-- plugin-path: $P"
case "$P" in "$V"/lib/python3*/site-packages/librustnet/lib/libnccl-net-rustnet.so) ;; *) echo "FAIL: not inside the venv"; exit 1;; esac
[ -f "$P" ]
echo "-- check (dlopen inside Python)"
"$PY" -m librustnet check | sed 's/^/  /'
echo "-- env (sourced by sh)"
rc=0; "$PY" -m librustnet env > "$V/env.sh" || rc=$?
sed 's/^/  /' "$V/env.sh"; echo "  exit $rc (as rustnet doctor: 0 pass, 1 warn, 2 fail)"
[ "$rc" -le 1 ] || { echo "FAIL: doctor reported failures"; exit 1; }
got=$(sh -c ". '$V/env.sh' && printf %s \"\$NCCL_NET_PLUGIN\"")
[ "$got" = "$P" ] || { echo "FAIL: env block sets NCCL_NET_PLUGIN=$got, want $P"; exit 1; }
"$PY" -m librustnet env --legacy > "$V/env-legacy.sh" || true
got=$(sh -c ". '$V/env-legacy.sh' && printf '%s %s' \"\$NCCL_NET_PLUGIN\" \"\${LD_LIBRARY_PATH%%:*}\"")
[ "$got" = "rustnet $(dirname "$P")" ] || { echo "FAIL: legacy env block gives '$got'"; exit 1; }
echo "  --legacy: NCCL_NET_PLUGIN=rustnet, LD_LIBRARY_PATH starts with the package's lib/"
echo "-- console script: $V/bin/rustnet knobs"
"$V/bin/rustnet" knobs > "$V/knobs.out"; head -n 1 "$V/knobs.out" | cut -c1-100 | sed "s/^/  /"
echo "-- python -m librustnet bench (driver over the wheel's plugin, two processes)"
"$PY" -m librustnet bench --sizes 4K,1M --reps 2 --bytes 32M --no-raw --lat-iters 200 > "$V/bench.out"
sed 's/^/  /' "$V/bench.out" | head -n 6
grep -q "plugin $P (ABI" "$V/bench.out" || { echo "FAIL: bench did not use $P"; exit 1; }
echo "-- conformance suite over the plugin inside the venv"
RUSTNET_PLUGIN="$P" RUSTNET_CONF_LIBNAME="$P" "$CONF" \
  traffic_v grouped vdevice peer_killed garbage invalid_env injected_panic null_stale dlclose
