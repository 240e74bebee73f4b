#!/bin/bash
# tests/rxe-vm/callgrind-test.sh -- user-space instructions per test() call,
# counted exactly: one end of `rustnet bench --one-way` (the receiving end,
# or with SIDE=send the sending end) runs under valgrind's callgrind in the
# soft-RoCE VM (rxe1 <- rxe0), once per plugin,
# and scripts/callgrind-per-call.py reads the calls and the inclusive
# instructions of the plugin's test slot, with a tree of where they go.
# (perf counts no instructions under the VM's TCG: no PMU.)
#
#   tests/rxe-vm/callgrind-test.sh
#   PLUGINS="now=target/release/librustnet.so netib=out/libnccl-net-netib.so" tests/rxe-vm/callgrind-test.sh
#
# Knobs: PLUGINS ("label=path ...", default: this build), SIDE (recv, send
# or "recv send": both, one run each), SIZE (bytes per message, 524288),
# MIB (MiB moved, 32), DEPTH (tree depth, 3), INSTR=1 (count per machine
# instruction too, for scripts/callgrind-lines.py's per-source-line view). The
# callgrind files stay in out/callgrind.LABEL.SIDE.out, the reports in
# out/callgrind.LABEL.SIDE.txt. Under valgrind that end runs some 50x slower,
# so it makes fewer (or more) unfinished calls per message than natively:
# compare instructions per call, not calls.
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ "${1:-}" != --in-vm ]; then
  # shellcheck source=tests/rxe-vm/bench-lib.sh
  . "$HERE/bench-lib.sh"
  vm_bench_plugins "$HERE/callgrind-test.sh" "SIDE SIZE MIB DEPTH INSTR"
fi
ulimit -l unlimited
cd "$ROOT" || exit 2
. "$HERE/bench-lib.sh"
BIN=$ROOT/target/release/rustnet
SIZE=${SIZE:-524288}
SIDE=${SIDE:-recv}
for side in $SIDE; do
  case $side in recv | send) ;; *) echo "callgrind-test.sh: SIDE is recv, send or both, not $SIDE"; exit 2 ;; esac
done
MIB=${MIB:-32}
S_IP=$RXE_VM_IP1
# the test slot's name: ours is one extern "C" fn per ABI version, net_ib's ncclIbTest
SLOT='(rustnet::abi::v[0-9]+::test$|^ncclIbTest$)'
rc=0
for side in $SIDE; do
  for p in $PLUGINS; do
    label=${p%%=*} so=$(readlink -f "${p#*=}")
    cg=$ROOT/out/callgrind.$label.$side.out
    rm -f "$cg"
    vg=(valgrind --tool=callgrind --callgrind-out-file="$cg" --dump-instr="$([ "${INSTR:-0}" = 1 ] && echo yes || echo no)")
    srv=() cli=()
    if [ "$side" = recv ]; then srv=("${vg[@]}"); else cli=("${vg[@]}"); fi
    env NCCL_IB_HCA="=rxe1" NCCL_SOCKET_IFNAME=veth1 RUSTNET_TRANSPORT=ib NCCL_IB_TIMEOUT=20 timeout 1200 \
      "${srv[@]}" "$BIN" bench --plugin "$so" --listen "$S_IP:18610" --idle-nap-us 50 > /tmp/srv.log 2>&1 &
    sp=$!
    # valgrind starts slowly: up to a minute for the port
    for _ in 1 2 3 4 5 6; do waitport 18610 && break; done
    env NCCL_IB_HCA="=rxe0" NCCL_SOCKET_IFNAME=veth0 RUSTNET_TRANSPORT=ib NCCL_IB_TIMEOUT=20 timeout 1200 \
      "${cli[@]}" "$BIN" bench --plugin "$so" --peer "$S_IP:18610" --no-raw --one-way --sizes "$SIZE" --bytes $((MIB << 20)) \
      --lat-iters 0 --reps 1 --inflight 8 > /tmp/cli.log 2>&1
    c=$?
    wait $sp
    s=$?
    if [ $c != 0 ] || [ $s != 0 ] || [ ! -s "$cg" ]; then
      echo "$label: the run failed (client $c, server $s)"; tail -20 /tmp/cli.log /tmp/srv.log; rc=1; continue
    fi
    end=receiving; [ "$side" = send ] && end=sending
    echo "== $label ($so): $end end, $((SIZE / 1024)) KiB one way, $MIB MiB, 8 in flight"
    python3 "$ROOT/scripts/callgrind-per-call.py" "$cg" "$SLOT" --depth "${DEPTH:-3}" | tee "$ROOT/out/callgrind.$label.$side.txt"
  done
done
exit $rc
