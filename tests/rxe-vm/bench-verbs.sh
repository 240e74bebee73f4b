#!/bin/bash
# tests/rxe-vm/bench-verbs.sh -- the verbs benchmark side by side with perftest,
# in one VM run, on the same devices and sizes (rxe0 -> rxe1 across the veth):
#   ib_write_bw vs `rustnet bench` bandwidth at 64 KiB, 256 KiB, 1 MiB
#   ib_write_lat vs `rustnet bench` 8-byte half round trip: typical (median
#   round trip / 2, perftest's headline t_typical) and average
# Each point is measured REPS times (default 3); min/median/max are printed,
# and a CSV lands in out/bench-verbs.csv. Emulated RDMA (qemu TCG): use the
# ratios, never the absolute numbers. The plugin runs with NCCL_IB_TIMEOUT=14,
# perftest's default (NCCL's 20 makes one packet the emulation drops cost 4 s
# instead of 67 ms), and its bandwidth harness sleeps when idle
# (--idle-nap-us: the emulated NIC is kernel work on the same two vCPUs, and
# perftest's passive server leaves it one). For the latency runs both tools have the
# server on vCPU 0 and the client on vCPU 1: left alone, the guest scheduler
# sometimes keeps two busy-polling processes on one vCPU, which doubles a
# ping-pong's round trip. Bandwidth runs are left to the scheduler (pinning
# there starves the emulated NIC's kernel work and cost ib_write_bw 40% at 1 MiB).
# Beside each bandwidth run it reads rxe's own retransmission counters
# (out_of_seq_request, duplicate_request, completer_retry_err: rxe0 + rxe1)
# and prints them per tool, median [min-max] per run, in a table and the CSV
# (test "rxe_<counter>"): a QP whose packets arrive out of order makes rxe go
# back and resend, and a build that provokes it more than perftest shows here.
# Last, what each message costs in NIC calls (WORK=0 skips it; WORK_ONLY=1
# runs only it): for 64 KiB, 512 KiB and 4 MiB, 8 in flight, one way, with
# NCCL_IB_QPS_PER_CONNECTION 1 and 4, both ends write a statistics file
# (RUSTNET_STATS_DIR) and `rustnet stats` divides the sender's and the
# receiver's verbs work by their messages: doorbells (ibv_post_send calls),
# send WRs, signaled WRs, receive WRs posted, ibv_poll_cq calls (and the
# empty ones: those depend on how fast the harness calls test()), CQEs and
# CTS writes. What NCCL's net_ib posts per message, read from its source,
# is in docs/performance.md beside it.
#
#   tests/rxe-vm/bench-verbs.sh            # builds, boots the VM, runs, prints
#   REPS=5 tests/rxe-vm/bench-verbs.sh
#   PLUGINS="old=out/old.so new=out/new.so" tests/rxe-vm/bench-verbs.sh
#   (an entry "label=a.so:b.so" runs a.so on the listening end, rxe1, and
#   b.so on the connecting end, rxe0: two builds talking to each other)
#     # two (or more) plugin builds, interleaved within every rep (same VM,
#     # same perftest reference), one column each; paths under the repo
#     # (out/ is writable and ignored)
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [ "${1:-}" != --in-vm ]; then
  # shellcheck source=tests/rxe-vm/bench-lib.sh
  . "$HERE/bench-lib.sh"
  vm_bench "$HERE/bench-verbs.sh" "REPS INFLIGHT PLUGINS WORK WORK_ONLY"
fi
ulimit -l unlimited
cd "$ROOT" || exit 2
REPS=${REPS:-3}
BIN=$ROOT/target/release/rustnet
S_IP=$RXE_VM_IP1
# shellcheck source=tests/rxe-vm/bench-lib.sh
. "$HERE/bench-lib.sh"
declare -A X
rxe_add() { # rxe_add TOOL BEFORE BYTES: what moved since BEFORE per GB moved, per counter, into X[TOOL.counter] and the CSV
  local tool=$1 i=0 k pg
  read -ra pg <<<"$(rxe_per_gb "$2" "$3")"
  for k in $RXE_KEYS; do
    X[$tool.$k]+="${pg[i]} "; echo "rxe_$k,all,$tool,$r,${pg[i]},events/GB" >> "$csv"
    i=$((i + 1))
  done
}
csv=$ROOT/out/bench-verbs.csv
echo "test,size,tool,run,value,unit" > "$csv"

perf() { # perf <tool> <size> <iters> -> prints "MB/s" (bw) or "t_typical t_avg" (lat, usec)
  local tool=$1 size=$2 n=$3 out pin0=() pin1=()
  [ "$tool" = ib_write_lat ] && pin0=(taskset -c 0) pin1=(taskset -c 1)
  timeout 120 "${pin0[@]}" "$tool" -d rxe1 -x 1 -s "$size" -n "$n" -p 18515 > /tmp/srv.log 2>&1 &
  local sp=$!
  waitport 18515 || { echo "server did not start" >&2; return 1; }
  out=$(timeout 120 "${pin1[@]}" "$tool" -d rxe0 -x 1 -s "$size" -n "$n" -p 18515 "$S_IP" 2>&1)
  wait $sp
  # bw: "#bytes #iterations BW peak BW average MsgRate"; lat: "#bytes #iter t_min t_max t_typical t_avg ..."
  if [ "$tool" = ib_write_bw ]; then
    awk -v s="$size" '$1==s && NF>=5 {print $4; exit}' <<<"$out"
  else
    awk -v s="$size" '$1==s && NF>=6 {print $5, $6; exit}' <<<"$out"
  fi
}

declare -A P R
[ "${WORK_ONLY:-0}" = 1 ] && REPS=0
for r in $(seq "$REPS"); do
  c0=$(rxe_now)
  for size in 65536 262144 1048576; do
    v=$(perf ib_write_bw $size 300); P[bw_$size]+="$v "; echo "bw,$size,ib_write_bw,$r,$v,MB/s" >> "$csv"
  done
  rxe_add ib_write_bw "$c0" $((300 * (65536 + 262144 + 1048576)))
  read -r typ avg <<<"$(perf ib_write_lat 8 1000)"
  P[lat]+="$typ "; P[lat_avg]+="$avg "
  echo "lat_typical,8,ib_write_lat,$r,$typ,us" >> "$csv"; echo "lat_average,8,ib_write_lat,$r,$avg,us" >> "$csv"
  # the plugin: server end on rxe1/veth1, client on rxe0/veth0, through the
  # vtable; bandwidth left to the scheduler, latency pinned as perftest's
  export NCCL_IB_TIMEOUT=14
  for plug in ${PLUGINS:-=}; do
  label=${plug%%=*} so=${plug#*=}
  for run in bw lat; do
    # shellcheck disable=SC2054  # the commas are inside one argument
    pin0=() pin1=() args=(--sizes 64K,256K,1M --bytes 96M --lat-iters 0 --idle-nap-us 50)
    [ $run = lat ] && pin0=(taskset -c 0) pin1=(taskset -c 1) args=(--sizes 8 --bytes 8K --lat-iters 1000)
    # "srv.so:cli.so": the listening end loads one build, the connecting end the other
    so_s=${so%%:*} so_c=${so#*:}
    penv=(); [ -n "$so_s" ] && penv=(RUSTNET_PLUGIN="$ROOT/${so_s#"$ROOT"/}")
    cenv=(); [ -n "$so_c" ] && cenv=(RUSTNET_PLUGIN="$ROOT/${so_c#"$ROOT"/}")
    env "${penv[@]}" NCCL_IB_HCA="=rxe1" NCCL_SOCKET_IFNAME=veth1 RUSTNET_TRANSPORT=ib timeout 300 "${pin0[@]}" "$BIN" bench --listen "$S_IP:18600" "${args[@]:6}" > /tmp/bsrv.log 2>&1 &
    sp=$!
    c0=$(rxe_now)
    waitport 18600 || { echo "bench server did not start"; cat /tmp/bsrv.log; exit 1; }
    env "${cenv[@]}" NCCL_IB_HCA="=rxe0" NCCL_SOCKET_IFNAME=veth0 RUSTNET_TRANSPORT=ib timeout 300 "${pin1[@]}" "$BIN" bench --peer "$S_IP:18600" --no-raw \
      "${args[@]}" --reps 1 --inflight ${INFLIGHT:-8} --csv /tmp/b.csv > /tmp/bcli.log 2>&1
    wait $sp
    [ $run = bw ] && rxe_add "rustnet${label:+-$label}" "$c0" $((3 * 96 * 1048576))
    grep -q '^oneway' /tmp/b.csv || { echo "rustnet bench failed:"; cat /tmp/bcli.log /tmp/bsrv.log; exit 1; }
    while IFS=, read -r t size _ med _; do
      tool=rustnet${label:+-$label}
      case $run,$t in
        bw,oneway) v=$(awk -v g="$med" 'BEGIN{printf "%.2f", g*1000}'); R[${label}bw_$size]+="$v "; echo "bw,$size,$tool,$r,$v,MB/s" >> "$csv" ;;
        lat,latency) R[${label}lat_avg]+="$med "; echo "lat_average,8,$tool,$r,$med,us" >> "$csv" ;;
        lat,latency_typical) R[${label}lat]+="$med "; echo "lat_typical,8,$tool,$r,$med,us" >> "$csv" ;;
      esac
    done < <(tail -n +2 /tmp/b.csv)
  done
  done
  if [ -n "${PLUGINS:-}" ]; then
    # the first plugin also fills the perftest comparison below
    first=${PLUGINS%% *}; first=${first%%=*}
    for k in bw_65536 bw_262144 bw_1048576 lat lat_avg; do R[$k]=${R[$first$k]}; done
  fi
  [ -n "${R[lat]:-}" ] || { echo "rustnet bench reported no latency:"; cat /tmp/bcli.log /tmp/bsrv.log; exit 1; }
done

work_run() { # work_run SIZE QPS: one one-way run with statistics files; prints the sender's and the receiver's rows
  local size=$1 qps=$2 d=/tmp/work.$1.$2 sp
  rm -rf "$d"; mkdir -p "$d"
  env RUSTNET_STATS_DIR="$d" NCCL_IB_QPS_PER_CONNECTION="$qps" NCCL_IB_HCA="=rxe1" NCCL_SOCKET_IFNAME=veth1 RUSTNET_TRANSPORT=ib \
    timeout 300 "$BIN" bench --listen "$S_IP:18600" > /tmp/wsrv.log 2>&1 &
  sp=$!
  waitport 18600 || { echo "bench server did not start"; cat /tmp/wsrv.log; exit 1; }
  env RUSTNET_STATS_DIR="$d" NCCL_IB_QPS_PER_CONNECTION="$qps" NCCL_IB_HCA="=rxe0" NCCL_SOCKET_IFNAME=veth0 RUSTNET_TRANSPORT=ib \
    timeout 300 "$BIN" bench --peer "$S_IP:18600" --no-raw --one-way --sizes "$size" --bytes "$3" --lat-iters 0 --reps 1 \
    --inflight "${INFLIGHT:-8}" --idle-nap-us 50 > /tmp/wcli.log 2>&1 || { echo "rustnet bench failed:"; cat /tmp/wcli.log /tmp/wsrv.log; exit 1; }
  wait $sp
  # the data went rxe0 -> rxe1 (the other rows are the one-byte acks)
  "$BIN" stats "$d" | awk '/^verbs work per message/ {f = 1; next} f && NF == 12 && (($2 == "rxe0" && $3 == "send") || ($2 == "rxe1" && $3 == "recv"))'
}
if [ "${WORK:-1}" = 1 ]; then
  echo
  echo "verbs work per message, one way rxe0 -> rxe1, ${INFLIGHT:-8} in flight (rustnet stats over both ends' RUSTNET_STATS_DIR files)"
  printf '%-6s %-4s %-4s %9s %9s %8s %8s %8s %8s %8s %8s %8s\n' size qps dir msgs doorbell send_wr signaled recv_wr poll empty cqe cts
  for size in 64K 512K 4M; do
    case $size in 64K) bytes=128M ;; 512K) bytes=256M ;; *) bytes=512M ;; esac
    for qps in 1 4; do
      while read -ra v; do # host device dir msgs, then the 8 per-message values
        printf '%-6s %-4s %-4s %9s %9s %8s %8s %8s %8s %8s %8s %8s\n' "$size" "$qps" "${v[@]:2}"
        i=4
        for op in doorbell send_wr signaled recv_wr poll empty cqe cts; do echo "work_$op,$size,rustnet-${v[2]}-${qps}qp,1,${v[i]},per_msg" >> "$csv"; i=$((i + 1)); done
      done < <(work_run "$size" "$qps" "$bytes")
    done
  done
fi
[ "$REPS" -gt 0 ] || { echo "CSV: out/bench-verbs.csv"; exit 0; }

echo
echo "rxe0 -> rxe1 across the veth, $REPS runs each, median [min-max]"
printf '%-10s %-26s %-26s %s\n' "size" "ib_write_bw MB/s" "rustnet bench MB/s" "ratio"
for size in 65536 262144 1048576; do
  a=${P[bw_$size]} b=${R[bw_$size]}
  printf '%-10s %-26s %-26s %s\n' "$((size / 1024))K" "$(stats "$a")" "$(stats "$b")" "$(awk -v x="$(med "$b")" -v y="$(med "$a")" 'BEGIN{printf "%.0f%%", 100*x/y}')"
done
echo
echo "8-byte half round trip, us (server vCPU 0, client vCPU 1), median [min-max]"
printf '%-10s %-26s %-26s %s\n' "" "ib_write_lat" "rustnet bench" "ratio"
for k in lat lat_avg; do
  name=typical; [ $k = lat_avg ] && name=average
  printf '%-10s %-26s %-26s %s\n' "$name" "$(stats "${P[$k]}")" "$(stats "${R[$k]}")" "$(awk -v x="$(med "${R[$k]}")" -v y="$(med "${P[$k]}")" 'BEGIN{printf "%.2fx", x/y}')"
done
echo "(typical = median round trip / 2, perftest's t_typical; average = all round trips / count / 2)"
if [ -n "${PLUGINS:-}" ]; then
  echo
  echo "plugin builds, interleaved in every run, median [min-max]"
  printf '%-14s' "point"; for plug in $PLUGINS; do printf '%-26s' "${plug%%=*}"; done; echo
  for k in bw_65536 bw_262144 bw_1048576 lat lat_avg; do
    case $k in bw_*) name="$(( ${k#bw_} / 1024 ))K MB/s" ;; lat) name="lat typ us" ;; *) name="lat avg us" ;; esac
    printf '%-14s' "$name"; for plug in $PLUGINS; do printf '%-26s' "$(stats "${R[${plug%%=*}$k]}")"; done; echo
  done
fi
echo
echo "rxe retransmission events per GB moved in each bandwidth run (3 sizes; rxe0 + rxe1), median [min-max]"
tools="ib_write_bw"; for plug in ${PLUGINS:-=}; do l=${plug%%=*}; tools+=" rustnet${l:+-$l}"; done
printf '%-22s' "counter"; for t in $tools; do printf '%-24s' "$t"; done; echo
for k in $RXE_KEYS; do
  printf '%-22s' "$k"; for t in $tools; do printf '%-24s' "$(stats "${X[$t.$k]:-}")"; done; echo
done
echo "CSV: out/bench-verbs.csv"
