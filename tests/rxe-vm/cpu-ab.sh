#!/bin/bash
# tests/rxe-vm/cpu-ab.sh -- the user CPU of the receiving end, per message
# and per CQ poll, of two or more plugin builds, interleaved in one boot of
# the soft-RoCE VM (rxe1 <- rxe0): for an A/B of a change to test()'s path.
# callgrind-test.sh counts instructions exactly; this measures what they
# cost under the VM's CPU, which is noisy: compare the per-round ratios.
#
#   PLUGINS="before=out/before.so now=target/release/librustnet.so" tests/rxe-vm/cpu-ab.sh
#
# Each round runs every plugin once (`rustnet bench --plugin`, one way,
# SIZE-byte messages, 8 in flight, MIB MiB, --idle-nap-us 50 on both ends),
# the order reversed every other round; the receiving process runs under
# /usr/bin/time. Polls come from librustnet's statistics file (a build
# without one, e.g. a competitor, shows "-" per poll). Knobs: PLUGINS
# ("label=path ...", default this build), ROUNDS (4), SIZE (524288), MIB
# (256). Per-run CSV: out/cpu-ab.csv.
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ "${1:-}" != --in-vm ]; then
  # shellcheck source=tests/rxe-vm/bench-lib.sh
  . "$HERE/bench-lib.sh"
  vm_bench_plugins "$HERE/cpu-ab.sh" "ROUNDS SIZE MIB"
fi
ulimit -l unlimited
cd "$ROOT" || exit 2
. "$HERE/bench-lib.sh"
BIN=$ROOT/target/release/rustnet
SIZE=${SIZE:-524288} MIB=${MIB:-256} ROUNDS=${ROUNDS:-4}
S_IP=$RXE_VM_IP1
read -ra plugs <<<"$PLUGINS"
csv=$ROOT/out/cpu-ab.csv
echo "round,label,user_s,sys_s,wall_s,mb_s,polls,us_per_poll,user_us_per_msg" > "$csv"
declare -A U P M
for r in $(seq "$ROUNDS"); do
  order=("${plugs[@]}")
  if [ $((r % 2)) = 0 ]; then
    order=()
    for ((i = ${#plugs[@]} - 1; i >= 0; i--)); do order+=("${plugs[i]}"); done
  fi
  for p in "${order[@]}"; do
    label=${p%%=*} so=$(readlink -f "${p#*=}")
    st=/tmp/cpu-ab.$label.$r
    rm -rf "$st"; mkdir -p "$st"
    env RUSTNET_STATS_DIR="$st" NCCL_IB_HCA="=rxe1" NCCL_SOCKET_IFNAME=veth1 RUSTNET_TRANSPORT=ib NCCL_IB_TIMEOUT=14 timeout 600 \
      /usr/bin/time -f "%U %S %e" -o /tmp/cpu-ab.srv "$BIN" bench --plugin "$so" --listen "$S_IP:18620" --idle-nap-us 50 > /tmp/cpu-ab.srv.log 2>&1 &
    sp=$!
    waitport 18620 || { echo "$label: the server end did not listen"; tail /tmp/cpu-ab.srv.log; exit 1; }
    env NCCL_IB_HCA="=rxe0" NCCL_SOCKET_IFNAME=veth0 RUSTNET_TRANSPORT=ib NCCL_IB_TIMEOUT=14 timeout 600 \
      "$BIN" bench --plugin "$so" --peer "$S_IP:18620" --no-raw --one-way --sizes "$SIZE" --bytes $((MIB << 20)) \
      --lat-iters 0 --idle-nap-us 50 --reps 1 --inflight 8 --csv /tmp/cpu-ab.csv > /tmp/cpu-ab.cli.log 2>&1
    c=$?
    wait $sp
    s=$?
    if [ $c != 0 ] || [ $s != 0 ]; then
      echo "$label: the run failed (client $c, server $s)"; tail -5 /tmp/cpu-ab.cli.log /tmp/cpu-ab.srv.log; exit 1
    fi
    read -r u sy w < /tmp/cpu-ab.srv
    gbs=$(awk -F, 'NR == 2 { print $4 }' /tmp/cpu-ab.csv)
    polls=$(cat "$st"/*.prom 2>/dev/null | awk '/^rustnet_device_verbs_work_total/ && /dir="recv"/ && /op="poll"/ { s += $2 } END { printf "%d", s }')
    msgs=$(((MIB << 20) / SIZE))
    per_poll=$(awk -v u="$u" -v p="$polls" 'BEGIN { if (p > 0) printf "%.2f", u * 1e6 / p; else print "-" }')
    per_msg=$(awk -v u="$u" -v m="$msgs" 'BEGIN { printf "%.1f", u * 1e6 / m }')
    mbs=$(awk -v g="$gbs" 'BEGIN { printf "%.1f", g * 1000 }')
    echo "round $r $label: receiving end user ${u} s, sys ${sy} s, wall ${w} s; ${mbs} MB/s; ${polls} polls; ${per_poll} us/poll; ${per_msg} us/message"
    echo "$r,$label,$u,$sy,$w,$mbs,$polls,$per_poll,$per_msg" >> "$csv"
    U[$label]+="$per_msg " P[$label]+="$per_poll " M[$label]+="$mbs "
  done
done
first=${plugs[0]%%=*}
echo
echo "== receiving end, $((SIZE / 1024)) KiB one way, 8 in flight, $ROUNDS rounds: median [min-max]; ratios per round against $first"
printf '%-12s %-24s %-24s %-24s %s\n' build "user us/message" "user us/poll" "MB/s" "user/message vs $first"
for p in "${plugs[@]}"; do
  label=${p%%=*}
  ratios=$(awk -F, -v a="$first" -v b="$label" '$2 == a { x[$1] = $9 } $2 == b { y[$1] = $9 } END { for (r in x) if (r in y && x[r] > 0) printf "%.2f ", y[r] / x[r] }' "$csv")
  printf '%-12s %-24s %-24s %-24s %s\n' "$label" "$(stats "${U[$label]}")" "$(stats "${P[$label]//-/}" 2)" "$(stats "${M[$label]}")" "$(stats "$ratios" 2)"
done
echo "(per-run rows: out/cpu-ab.csv)"
