#!/bin/bash
# tests/rxe-vm/bench-netib.sh -- librustnet beside a plugin build of NCCL's own
# net_ib design, what a user on an IB/RoCE cluster would otherwise run, in one
# VM boot: rxe0 -> rxe1 across the veth, both plugins driven by the same
# stand-in for NCCL's proxy (`rustnet bench --plugin`, through the vtable),
# interleaved in every repeat (the order alternates), REPS repeats (default 5).
#
#   COMPETITOR=/path/to/libnccl-net.so tests/rxe-vm/bench-netib.sh
#   REPS=3 COMPETITOR=... tests/rxe-vm/bench-netib.sh
#
# The competitor is built by you, outside this repository, from its public
# source (for example the IB backend of the NCCL RDMA plugin, which is
# net_ib's code as a plugin; it must export ncclNetPlugin_v8 and load
# without CUDA); nothing here builds it. It runs with its own defaults and
# the same NCCL_IB_HCA, NCCL_SOCKET_IFNAME and NCCL_IB_TIMEOUT=14
# (perftest's; NCCL's 20 makes a packet the emulation drops cost 4 s).
#
# Per repeat and plugin: bandwidth at 64K, 512K, 1M and 4M, 8 in flight (NCCL's
# steps), one way and both ways (per direction); the half round trip of an
# 8-byte and a 64 KiB ping-pong (server on vCPU 0, client on vCPU 1, as
# bench-verbs.sh pins perftest's); the user CPU seconds of both processes per
# GB moved in the bandwidth run (/usr/bin/time); rxe's retransmission
# counters per GB. Printed: each plugin's median [min-max] and the median of
# the per-repeat ratios librustnet / competitor [range]; CSV in
# out/bench-netib.csv. Emulated RDMA (qemu TCG): the ratios mean something,
# the absolute numbers do not.
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ "${1:-}" != --in-vm ]; then
  [ -n "${COMPETITOR:-}" ] || { echo "bench-netib.sh: set COMPETITOR to the competitor plugin's .so (built outside this repository)"; exit 2; }
  COMPETITOR=$(readlink -f "$COMPETITOR")
  export COMPETITOR
  # shellcheck source=tests/rxe-vm/bench-lib.sh
  . "$HERE/bench-lib.sh"
  vm_bench "$HERE/bench-netib.sh" "REPS COMPETITOR" "$COMPETITOR"
fi
ulimit -l unlimited
cd "$ROOT" || exit 2
REPS=${REPS:-5}
BIN=$ROOT/target/release/rustnet
S_IP=$RXE_VM_IP1
SIZES="65536 524288 1048576 4194304"
BYTES=$((128 << 20))
csv=$ROOT/out/bench-netib.csv
echo "point,plugin,run,value,unit" > "$csv"  # point: ow_SIZE, bi_SIZE, lat8, cpu_user, rxe_COUNTER
declare -A V
# shellcheck source=tests/rxe-vm/bench-lib.sh
. "$HERE/bench-lib.sh"
put() { V[$1.$2]+="$3 "; echo "$2,$1,$4,$3,$5" >> "$csv"; } # put PLUGIN KEY VALUE RUN UNIT

run_bench() { # run_bench PLUGIN SO RUN bw|lat8|lat64k
  local p=$1 so=$2 r=$3 kind=$4 pin0=() pin1=() args srv=() sp c0 u k i v
  # shellcheck disable=SC2054  # the commas are inside one argument
  case $kind in
    bw) args=(--sizes 64K,512K,1M,4M --bytes "$BYTES" --lat-iters 0 --idle-nap-us 50); srv=(--idle-nap-us 50) ;;
    lat8) args=(--sizes 8 --bytes 8K --lat-iters 1000 --lat-size 8); pin0=(taskset -c 0) pin1=(taskset -c 1) ;;
    lat64k) args=(--sizes 8 --bytes 8K --lat-iters 500 --lat-size 64K); pin0=(taskset -c 0) pin1=(taskset -c 1) ;;
  esac
  c0=$(rxe_now)
  env NCCL_IB_HCA="=rxe1" NCCL_SOCKET_IFNAME=veth1 RUSTNET_TRANSPORT=ib NCCL_IB_TIMEOUT=14 timeout 600 \
    /usr/bin/time -f "%U %S" -o /tmp/srv.cpu "${pin0[@]}" "$BIN" bench --plugin "$so" --listen "$S_IP:18600" "${srv[@]}" > /tmp/srv.log 2>&1 &
  sp=$!
  waitport 18600 || { echo "$p: bench server did not start"; cat /tmp/srv.log; exit 1; }
  env NCCL_IB_HCA="=rxe0" NCCL_SOCKET_IFNAME=veth0 RUSTNET_TRANSPORT=ib NCCL_IB_TIMEOUT=14 timeout 600 \
    /usr/bin/time -f "%U %S" -o /tmp/cli.cpu "${pin1[@]}" "$BIN" bench --plugin "$so" --peer "$S_IP:18600" --no-raw \
    "${args[@]}" --reps 1 --inflight 8 --csv /tmp/b.csv > /tmp/cli.log 2>&1
  wait $sp
  [ -s /tmp/b.csv ] || { echo "$p ($kind): rustnet bench failed:"; cat /tmp/cli.log /tmp/srv.log; exit 1; }
  while IFS=, read -r t size _ med _; do
    case $kind,$t in
      bw,oneway) put "$p" "ow_$size" "$(awk -v g="$med" 'BEGIN{printf "%.1f", g*1000}')" "$r" MB/s ;;
      bw,bidir) put "$p" "bi_$size" "$(awk -v g="$med" 'BEGIN{printf "%.1f", g*1000/2}')" "$r" MB/s ;;
      lat8,latency_typical) put "$p" lat8 "$med" "$r" us ;;
      lat64k,latency_typical) put "$p" lat64k "$med" "$r" us ;;
    esac
  done < <(tail -n +2 /tmp/b.csv)
  rm -f /tmp/b.csv
  if [ "$kind" = bw ]; then
    # GB moved: each size one way, then both ways
    u=$(cat /tmp/srv.cpu /tmp/cli.cpu | awk -v b="$BYTES" '{u += $1} END {printf "%.2f", u / (4 * 3 * b / 1e9)}')
    put "$p" cpu_user "$u" "$r" s/GB
    read -ra k <<<"$(rxe_per_gb "$c0" $((4 * 3 * BYTES)))"; i=0
    for v in $RXE_KEYS; do put "$p" "rxe_$v" "${k[i]}" "$r" events/GB; i=$((i + 1)); done
  fi
}

OURS=$ROOT/target/release/librustnet.so
for r in $(seq "$REPS"); do
  order="ours netib"; [ $((r % 2)) = 0 ] && order="netib ours"
  for kind in bw lat8 lat64k; do
    for p in $order; do
      so=$OURS; [ "$p" = netib ] && so=$COMPETITOR
      run_bench "$p" "$so" "$r" "$kind"
    done
  done
  echo "repeat $r of $REPS done" >&2
done

ratio() { # per-repeat ratios ours/netib, median [min-max]
  paste -d' ' <(tr ' ' '\n' <<<"$1" | grep -v '^$') <(tr ' ' '\n' <<<"$2" | grep -v '^$') |
    awk '$2 > 0 {print $1 / $2}' | sort -g | awk '{a[NR]=$1} END{if(NR==0){print "-";exit} printf "%.2f [%.2f-%.2f]", a[int((NR+1)/2)], a[1], a[NR]}'
}
echo
echo "librustnet beside the net_ib-design plugin ($(basename "$COMPETITOR")), rxe0 -> rxe1, 8 in flight, $REPS repeats, interleaved"
printf '%-26s %-24s %-24s %s\n' point librustnet net_ib-design "ratio (per repeat)"
row() { printf '%-26s %-24s %-24s %s\n' "$1" "$(stats "${V[ours.$2]:-}")" "$(stats "${V[netib.$2]:-}")" "$(ratio "${V[ours.$2]:-}" "${V[netib.$2]:-}")"; }
for s in $SIZES; do row "$((s / 1024))K one way MB/s" "ow_$s"; done
for s in $SIZES; do row "$((s / 1024))K both ways MB/s/dir" "bi_$s"; done
row "8 B half round trip us" lat8
row "64K half round trip us" lat64k
row "user CPU s/GB (both ends)" cpu_user
for k in $RXE_KEYS; do row "rxe $k /GB" "rxe_$k"; done
echo "(bandwidth: higher is better; latency, CPU and rxe events: lower is better)"
echo "CSV: out/bench-netib.csv"
