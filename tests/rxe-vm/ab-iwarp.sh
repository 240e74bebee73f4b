#!/bin/bash
# tests/rxe-vm/ab-iwarp.sh -- two plugin builds over soft-iWARP, interleaved in
# one VM boot (the order alternating every round), siw0 -> siw1: the 8-byte
# half round trip (LAT_ROUNDS rounds, default 5) and one-way bandwidth at
# 64 KiB and 512 KiB, 8 in flight (BW_ROUNDS rounds, default 3). Prints one
# line per run, then median [min-max] per build and the median of the
# per-round ratios B/A. Runs inside the guest:
#
#   RXE_VM_SIW=1 tests/rxe-vm/run.sh \
#     'A=out/before.so B=target/release/librustnet.so bash tests/rxe-vm/ab-iwarp.sh'
#
# A, B: the two librustnet.so builds (paths the guest can read: not under
# /tmp); BIN: the rustnet tool (default target/release/rustnet). Emulated
# (qemu TCG, siw in the guest kernel on the same 2 vCPUs): read the ratio.
set -u
BIN=${BIN:-target/release/rustnet}
A=${A:?A=path of the first librustnet.so} B=${B:?B=path of the second librustnet.so}
S_IP=10.198.0.2
export NCCL_IB_TIMEOUT=14 RUSTNET_TRANSPORT=ib
ulimit -l unlimited
out=$(mktemp)
run() { # run <label> <so> <bw|lat: the rows kept> <bench args...>
  local label=$1 so=$2 want=$3; shift 3
  rm -f /tmp/ab.csv
  NCCL_IB_HCA="=siw1" NCCL_SOCKET_IFNAME=sveth1 timeout 300 "$BIN" bench --plugin "$so" --listen "$S_IP:18600" --idle-nap-us 50 > /tmp/ab-srv.log 2>&1 &
  local sp=$!
  for _ in $(seq 50); do ss -ltn | grep -q ':18600 ' && break; sleep 0.1; done
  NCCL_IB_HCA="=siw0" NCCL_SOCKET_IFNAME=sveth0 timeout 300 "$BIN" bench --plugin "$so" --peer "$S_IP:18600" --no-raw --one-way \
    --idle-nap-us 50 --reps 1 --inflight 8 --csv /tmp/ab.csv "$@" > /tmp/ab-cli.log 2>&1
  wait $sp
  if ! grep -q '^oneway\|^latency' /tmp/ab.csv 2>/dev/null; then
    echo "$label: no result"; tail -5 /tmp/ab-cli.log /tmp/ab-srv.log; return
  fi
  awk -F, -v l="$label" -v w="$want" '$1=="oneway" && w=="bw" {printf "%s bw_%s %.2f\n", l, $2, $4 * 1e9 / 1048576} $1=="latency" && w=="lat" {printf "%s lat_%s %s\n", l, $2, $4}' /tmp/ab.csv | tee -a "$out"
}
for r in $(seq "${LAT_ROUNDS:-5}"); do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for x in $order; do run "$x" "${!x}" lat --sizes 64K --bytes 4M --lat-iters 1000 --lat-size 8; done
done
for r in $(seq "${BW_ROUNDS:-3}"); do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for size in 512K 64K; do
    for x in $order; do run "$x" "${!x}" bw --sizes "$size" --bytes 48M --lat-iters 0; done
  done
done
echo "== median [min-max] per build, and the median of per-round ratios B/A (latency: lower is better)"
python3 - "$out" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if len(l.split()) == 3]
keys = sorted({k for _, k, _ in rows})
for k in keys:
    a = [float(v) for x, kk, v in rows if kk == k and x == "A"]
    b = [float(v) for x, kk, v in rows if kk == k and x == "B"]
    if not a or not b:
        continue
    r = [y / x for x, y in zip(a, b)]
    f = lambda v: "%.1f [%.1f-%.1f]" % (st.median(v), min(v), max(v))
    print(f"{k:10} A {f(a):24} B {f(b):24} B/A {st.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]")
PY
rm -f "$out"
