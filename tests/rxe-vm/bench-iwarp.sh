#!/bin/bash
# tests/rxe-vm/bench-iwarp.sh -- the plugin over soft-iWARP beside perftest, in
# one VM run (RXE_VM_SIW=1), siw0 -> siw1 across their own veth pair:
#   `ib_write_bw -R` (rdma_cm, RDMA WRITE) vs `rustnet bench` one-way bandwidth
#   at 64 KiB, 256 KiB and 1 MiB, interleaved: for every repeat and size,
#   perftest then the plugin, so drift in the emulation hits both alike.
# Both in MiB/s (perftest's "MB/sec" is 2^20 bytes per second; rustnet
# bench's GB/s is 10^9 and is converted). Each point REPS times (default 3):
# median [min-max] and the ratio of medians; CSV in out/bench-iwarp.csv.
# Emulated (qemu TCG, siw's TCP in the guest kernel on the same 2 vCPUs):
# read the ratio, not the numbers. Same harness settings as bench-verbs.sh
# (NCCL_IB_TIMEOUT=14, --idle-nap-us "${NAP:-50}", bandwidth runs left to the scheduler).
#
#   tests/rxe-vm/bench-iwarp.sh            # builds, boots the VM, runs, prints
#   REPS=5 MIB=64 QPS=1 tests/rxe-vm/bench-iwarp.sh
#   MIB: MiB moved per point (default 48); QPS: NCCL_IB_QPS_PER_CONNECTION (default 1);
#   NAP: rustnet bench --idle-nap-us (default 50, as bench-verbs.sh)
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ "${1:-}" != --in-vm ]; then
  # shellcheck source=tests/rxe-vm/bench-lib.sh
  . "$HERE/bench-lib.sh"
  RXE_VM_SIW=1 vm_bench "$HERE/bench-iwarp.sh" "REPS INFLIGHT MIB QPS NAP"
fi
ulimit -l unlimited
cd "$ROOT" || exit 2
REPS=${REPS:-3}
MIB=${MIB:-48}
BIN=$ROOT/target/release/rustnet
S_IP=${RXE_VM_SIW_IP1:?boot with RXE_VM_SIW=1}
csv=$ROOT/out/bench-iwarp.csv
SIZES=(65536 262144 1048576)
echo "test,size,tool,run,value,unit" > "$csv"
# shellcheck source=tests/rxe-vm/bench-lib.sh
. "$HERE/bench-lib.sh"

perf() { # perf <size> <iters> -> MiB/s (BW average)
  local size=$1 n=$2 out sp
  timeout 120 ib_write_bw -R -d siw1 -F -s "$size" -n "$n" -p 18515 > /tmp/srv.log 2>&1 &
  sp=$!
  waitport 18515 || sleep 1
  out=$(timeout 120 ib_write_bw -R -d siw0 -F -s "$size" -n "$n" -p 18515 "$S_IP" 2>&1)
  wait $sp
  # "#bytes #iterations BW peak BW average MsgRate"
  awk -v s="$size" '$1==s && NF>=5 {print $4; exit}' <<<"$out"
}

plugin() { # plugin <size> -> MiB/s (one-way median of one repeat)
  local size=$1 sp
  export NCCL_IB_TIMEOUT=14 NCCL_IB_QPS_PER_CONNECTION=${QPS:-1} RUSTNET_TRANSPORT=ib
  rm -f /tmp/b.csv  # a stale CSV from the last size must not pass for this run
  NCCL_IB_HCA="=siw1" NCCL_SOCKET_IFNAME=sveth1 timeout 300 "$BIN" bench --listen "$S_IP:18600" --idle-nap-us "${NAP:-50}" > /tmp/bsrv.log 2>&1 &
  sp=$!
  waitport 18600 || { echo "bench server did not start" >&2; cat /tmp/bsrv.log >&2; return 1; }
  NCCL_IB_HCA="=siw0" NCCL_SOCKET_IFNAME=sveth0 timeout 300 "$BIN" bench --peer "$S_IP:18600" --no-raw \
    --sizes "$size" --bytes "${MIB}M" --lat-iters 0 --idle-nap-us "${NAP:-50}" --reps 1 --inflight "${INFLIGHT:-8}" --csv /tmp/b.csv > /tmp/bcli.log 2>&1
  wait $sp
  grep -q '^oneway' /tmp/b.csv || { echo "rustnet bench failed:" >&2; cat /tmp/bcli.log /tmp/bsrv.log >&2; return 1; }
  awk -F, '$1=="oneway" {printf "%.2f", $4 * 1e9 / 1048576; exit}' /tmp/b.csv
}

declare -A P R
for r in $(seq "$REPS"); do
  for size in "${SIZES[@]}"; do
    a=$(perf "$size" $((MIB * 1048576 / size))); P[$size]+="$a "; echo "bw,$size,ib_write_bw -R,$r,$a,MiB/s" >> "$csv"
    b=$(plugin "$size") || exit 1; R[$size]+="$b "; echo "bw,$size,rustnet,$r,$b,MiB/s" >> "$csv"
    echo "repeat $r, $((size / 1024)) KiB: ib_write_bw -R $a, rustnet $b MiB/s"
  done
done

echo
echo "siw0 -> siw1 (soft-iWARP, MTU 1024), $REPS interleaved runs each, ${MIB} MiB per point, median [min-max], MiB/s"
printf '%-8s %-24s %-24s %s\n' "size" "ib_write_bw -R" "rustnet bench (plugin)" "ratio"
for size in "${SIZES[@]}"; do
  a=${P[$size]} b=${R[$size]}
  printf '%-8s %-24s %-24s %s\n' "$((size / 1024))K" "$(stats "$a")" "$(stats "$b")" "$(awk -v x="$(med "$b")" -v y="$(med "$a")" 'BEGIN{if (x == "" || y == "" || y + 0 == 0) print "n/a"; else printf "%.2fx", x/y}')"
done
echo "CSV: out/bench-iwarp.csv"
