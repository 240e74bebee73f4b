#!/usr/bin/env bash
# Profiler events through real NCCL (docs/profiler.md), on a GPU machine:
# builds NCCL's example profiler plugin from NCCL's own source, runs
# all_reduce_perf (2 ranks, one GPU, through the network) three times with
# it loaded (NCCL_PROFILE_EVENT_MASK=4095), and compares the net events in
# its Chrome-trace dumps:
#   rustnet           the plugin (ABI v10 on NCCL 2.26-2.28): NET_SOCK events,
#                     as many ends as begins
#   rustnet_knob_off  RUSTNET_PROFILER=0: none
#   nccl_socket       NCCL's own Socket transport: its events, for the format
# usage: profiler-events.sh --plugin-dir DIR --profiler-src DIR [--kit DIR]
#   --plugin-dir: holds librustnet.so
#   --profiler-src: NCCL's ext-profiler/example (plugins/profiler/example on
#                   master) at the NCCL version the machine runs, e.g. from
#                   `git archive v2.28.9-1 ext-profiler/example`
#   --kit: the nccl-tests kit (default <repo>/.gpu/nccl-kit; ../shared/gpu/README.md)
# Output: $OUT (default ./out/profiler-events). Exit 0 when the verdict holds.
set -u
here=$(cd "$(dirname "$0")" && pwd)
plugin_dir="" src="" kit="$here/../.gpu/nccl-kit"
while [ $# -gt 0 ]; do
  case $1 in
    --plugin-dir) plugin_dir=$2; shift 2 ;;
    --profiler-src) src=$2; shift 2 ;;
    --kit) kit=$2; shift 2 ;;
    *) echo "unknown argument $1 (see the header)"; exit 2 ;;
  esac
done
[ -f "$plugin_dir/librustnet.so" ] || { echo "--plugin-dir must hold librustnet.so"; exit 2; }
[ -f "$src/plugin.cc" ] || { echo "--profiler-src must be NCCL's example profiler source"; exit 2; }
[ -x "$kit/bin/all_reduce_perf" ] || { echo "no nccl-tests kit at $kit (--kit)"; exit 2; }
plugin_dir=$(cd "$plugin_dir" && pwd) src=$(cd "$src" && pwd) kit=$(cd "$kit" && pwd)
out=$(mkdir -p "${OUT:-./out/profiler-events}" && cd "${OUT:-./out/profiler-events}" && pwd)
prof="$out/libnccl-profiler-example.so"
( cd "$src" && g++ -O2 -Inccl -I/usr/local/cuda/include -fPIC -shared -o "$prof" ./*.cc ) > "$out/build.log" 2>&1 ||
  { echo "building the example profiler failed:"; tail -20 "$out/build.log"; exit 1; }
export NCCL_KIT_PYTHON=${NCCL_KIT_PYTHON:-python3}
# shellcheck disable=SC1091
source "$kit/env.sh"
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_MNNVL_ENABLE=0 NCCL_NVLS_ENABLE=0
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
export NCCL_PROFILER_PLUGIN=$prof NCCL_PROFILE_EVENT_MASK=4095
# begins and ends of NET_SOCK events over a run's dumps
count() { cat "$out/$1"/prof* 2>/dev/null | grep -c "\"NET_SOCK\", \"ph\": \"$2\""; }
run() {
  local name=$1
  shift
  mkdir -p "$out/$name"
  env "$@" NCCL_PROFILE_DUMP_FILE="$out/$name/prof" timeout 150 mpiexec -n 2 "$kit/rank-wrap.sh" \
    "$kit/bin/all_reduce_perf" -b 1M -e 4M -f 2 -g 1 -n 5 -w 2 > "$out/$name/log.txt" 2>&1
  echo "=== $name: exit $?, NET_SOCK begin $(count "$name" b) end $(count "$name" e), NET_IB $(cat "$out/$name"/prof* 2>/dev/null | grep -c NET_IB)"
  grep -E 'Loaded net plugin|Using network|PROFILER|wrong' "$out/$name/log.txt" | sort | uniq -c | head -8
  cat "$out/$name"/prof* 2>/dev/null | grep -m2 '"NET_SOCK", "ph": "b"'
}
run rustnet NCCL_NET_PLUGIN="$plugin_dir/librustnet.so" NCCL_NET=rustnet
run rustnet_knob_off NCCL_NET_PLUGIN="$plugin_dir/librustnet.so" NCCL_NET=rustnet RUSTNET_PROFILER=0
run nccl_socket NCCL_NET_PLUGIN=none NCCL_NET=Socket NCCL_IB_DISABLE=1
b=$(count rustnet b) e=$(count rustnet e) off=$(count rustnet_knob_off b)
if [ "$b" -gt 0 ] && [ "$b" = "$e" ] && [ "$off" = 0 ]; then
  echo "PASS: the plugin's socket events reach NCCL's profiler ($b begins, $e ends); none with RUSTNET_PROFILER=0"
else
  echo "FAIL: plugin begins $b, ends $e; with RUSTNET_PROFILER=0: $off"
  exit 1
fi
