#!/bin/bash
# tests/rxe-vm/loss.sh -- verbs traffic under packet loss on a live (soft-RoCE)
# fabric, in one VM boot:
#
#   flock /tmp/rxe-vm.lock tests/rxe-vm/loss.sh
#
# Each scenario runs rustnet-loss (crates/rustnet-rigs/src/loss.rs): one process, rxe0/veth0 <-> rxe1/veth1,
# one connection each way, both directions at once, every byte checked. Once
# both connections are up it puts netem on LOSS_DEVS (default veth1: rxe1's
# data and the ACKs of rxe0's data leave there) and moves LOSS_BYTES each way.
#   - 0% and 1% loss: must finish with every byte right (RC retransmits);
#     1% is slower. NCCL_IB_TIMEOUT=14 (67 ms) there: NCCL's default 20 is
#     4.3 s per retransmission timeout (a lost last packet of a burst waits
#     for it), which leaves an emulated link mostly idle (LOSS_SLOW=1 adds a
#     1% run at 20 anyway).
#   - 100% loss with recovery off (RUSTNET_RECOVERY_TIMEOUT=0): the comms
#     must fail, naming the peer, within the time NCCL_IB_TIMEOUT /
#     NCCL_IB_RETRY_CNT imply: 4.096 us * 2^timeout * (retry_cnt + 1). Small
#     values keep it short. (rxe, like the IB spec's RNR counter, treats
#     retry_cnt 7 as "retry forever"; real HCAs do not.)
#   - cut-rec: 100% loss with recovery on (RUSTNET_RECOVERY_TIMEOUT=5): the
#     comms stop, recover, find no peer answering and fail once the window is
#     spent (the retry budget + 5 s), naming the knob.
#   - flap-0.5, flap-3, flap-20: veth1 down for that long mid-transfer (the
#     port goes down: PORT_ERR, then PORT_ACTIVE), default NCCL_IB_TIMEOUT and
#     NCCL_IB_RETRY_CNT, traffic by time (LOSS_SECONDS): no error, every byte
#     right, and "again" = from link-up to the first message received after
#     it (the plugin recovers on PORT_ACTIVE instead of waiting for the HCA's
#     next retransmission); more than LOSS_RESUME_MAX (2) s fails. The
#     out-of-band sockets go over lo there (NCCL_SOCKET_IFNAME on a network
#     other than the fabric, as on most clusters), so "again" times the
#     recovery and not the rig putting its routes back; flap-3-shared and
#     flap-20-shared keep them on veth0 (the fabric's own link, as on a RoCE
#     cluster whose NCCL_SOCKET_IFNAME is the RDMA port's netdev).
#   - loss5 (by name only): as loss1 with 5% loss.
#   - qperr (by name only): 300 s of traffic (LOSS_QPERR_SECONDS) with a QP
#     forced to the error state every 500th data post (RUSTNET_FAULT_QP_ERROR;
#     the goal is at least 20 forced errors in the 5 minutes):
#     no error, every byte right; the statistics table counts the recoveries.
#   - cut-3-rec: every packet on veth1 dropped for 3 s (netem; the port stays
#     ACTIVE, no port event) with NCCL_IB_TIMEOUT=14 and NCCL_IB_RETRY_CNT=2,
#     so the QPs fail with retry exceeded inside the cut (rxe treats 7 as
#     "retry forever"): the comms recover, fail again on the new QPs until the
#     cut ends (one episode), then go on; no error, every byte right, "again"
#     from the end of the cut.
#   - flap-connect: veth1 down for 3 s from just before the connections are
#     set up: connect and accept wait for the port (RUSTNET_CONNECT_TIMEOUT),
#     then the traffic runs clean.
#   - invreq (by name only): LOSS_INVREQ_SECONDS (600) of 64 KiB messages
#     both ways, no loss: soft-RoCE's "invalid request" (IBV_WC_REM_INV_REQ_ERR,
#     docs/resilience.md) comes now and then on its own; each must be
#     recovered in place, every byte right. It prints how many there were.
# Per scenario it prints the time, the rxe hw_counters that moved (both
# devices, summed), the plugin's own statistics file (RUSTNET_STATS_DIR,
# read by `rustnet stats`), `rustnet watch`'s verdict during the 1% run, and
# the WARN naming the peer when a comm failed; then one table.
#
# Also run by verbs-suite.sh (VERBS_LOSS). Knobs: LOSS_BYTES (32 MiB per direction), LOSS_DEVS ("veth1"), LOSS_SLOW=1,
# LOSS_SCENARIOS ("clean loss1 cut-t14 cut-t16 cut-t18 cut-rec flap-0.5 flap-3 flap-3-shared flap-connect cut-3-rec"; LOSS_SLOW=1 adds loss1-t20
# flap-20 and flap-20-shared), LOSS_RESUME_MAX (2 s), LOSS_REPEAT (runs per scenario, 1), LOSS_MSG (message size, 1 MiB),
# LOSS_PLUGIN (the plugin the rig loads: another build, for an A/B in one boot; default the tree's),
# LOSS_NO_BUILD=1, LOSS_NCCL_DEBUG (INFO: print each recovery's steps and their times), RXE_VM_* (run.sh). Exit: 0 every scenario behaved, 1 one
# did not, 125 the VM died or timed out, 2 the build failed.
set -u -o pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

# ---- in the guest ------------------------------------------------------------
if [ "${1:-}" = --in-vm ]; then
  ulimit -l unlimited
  T=${LOSS_TARGET:-$ROOT/target/release}
  export RUSTNET_TRANSPORT=ib NCCL_IB_HCA="=rxe0,rxe1" NCCL_SOCKET_IFNAME=veth0 RUSTNET_PLUGIN=${LOSS_PLUGIN:-$T/librustnet.so}
  devs=${LOSS_DEVS:-veth1}
  W=/tmp/loss
  mkdir -p $W
  keys="sent_pkts rcvd_pkts duplicate_request out_of_seq_request rcvd_seq_err completer_retry_err retry_exceeded_err ack_deferred"
  snap() { # snap FILE: every hw_counter of rxe0 and rxe1 as "name value", summed
    local f v
    for f in /sys/class/infiniband/rxe0/ports/1/hw_counters/* /sys/class/infiniband/rxe1/ports/1/hw_counters/*; do
      read -r v < "$f" || v=0
      echo "${f##*/} $v"
    done | awk '{ s[$1] += $2 } END { for (k in s) print k, s[k] }' | sort > "$1"
  }
  delta() { # delta BEFORE AFTER: "name=+N" for the counters in $keys
    join "$1" "$2" | awk -v keys="$keys" 'BEGIN { n = split(keys, k, " "); for (i = 1; i <= n; i++) want[k[i]] = i }
      ($1 in want) { d[want[$1]] = $1 "=" ($3 - $2) }
      END { for (i = 1; i <= n; i++) if (i in d) printf "%s ", d[i]; print "" }'
  }
  fails=0
  rows=()
  # flap DEV SECONDS OUT: link down, wait, up, the rig's routes back; the
  # link-down and link-up times (unix seconds) into OUT.down / OUT.up
  cat > $W/flap.sh <<'FLAP'
#!/bin/bash
dev=$1 down=$2 out=$3 after=${4:-2}
routes=$(ip -o route show table all | grep " dev $dev" || true)
sleep "$after"
ip link set "$dev" down
date +%s.%N > "$out.down"
sleep "$down"
ip link set "$dev" up
date +%s.%N > "$out.up"
# (a host re-adds an interface's connected routes as it comes up; the rig's
# policy routes it does not: put them back in one batch, at once. The
# recovery does not wait for them: the kernel's RoCE resolution is bound to
# the GID's netdev. What used to cost a second after link-up was the
# kernel's resolution race, which the plugin now avoids by resolving the
# neighbour first: see docs/resilience.md.)
sed -n 's/^/route replace /p' <<<"$routes" | ip -force -batch - 2>/dev/null
date +%s.%N > "$out.routes"
FLAP
  chmod +x $W/flap.sh
  # cut DEV SECONDS OUT: every packet through DEV dropped for that long (a
  # switch that blackholes traffic; the port stays ACTIVE: no port event),
  # the same time files as flap.sh (.routes = .up: nothing to put back)
  cat > $W/cut.sh <<'CUT'
#!/bin/bash
dev=$1 secs=$2 out=$3 after=${4:-2}
sleep "$after"
tc qdisc replace dev "$dev" root netem loss 100%
date +%s.%N > "$out.down"
sleep "$secs"
tc qdisc del dev "$dev" root
date +%s.%N > "$out.up"
cp "$out.up" "$out.routes"
CUT
  chmod +x $W/cut.sh
  # scenario NAME LOSS TIMEOUT RETRY MODE [ENV] [FLAP_SECONDS] [FLAP_AT: run|connect|cut]
  scenario() {
    local name=$1 loss=$2 to=$3 rc=$4 mode=$5 xenv=${6:-} flap=${7:-} at=${8:-run} out dir line secs expect="" res again="-" window=0
    # (a repeat is named flap-3/2: its files flap-3_2)
    dir=$W/stats-${name//\//_} out=$W/${name//\//_}
    echo
    echo "=== $name: loss $loss on $devs, NCCL_IB_TIMEOUT=$to NCCL_IB_RETRY_CNT=$rc $xenv${flap:+, veth1 down for $flap s}, expect $mode"
    apply=""
    for d in $devs; do apply+="tc qdisc replace dev $d root netem loss $loss; "; done
    local by_time=() before=""
    if [ -n "$flap" ] && [ "$at" = connect ]; then
      # the link goes down just before the connections are set up: wait
      # until it is down (a fixed 0.3 s was sometimes too short under
      # emulation, and the link then went down in the middle of a handshake)
      before="setsid $W/flap.sh veth1 $flap $out 0 > /dev/null 2>&1 & for i in \$(seq 200); do [ -s $out.down ] && break; sleep 0.05; done; sleep 0.1"
      apply=""
    elif [ -n "$flap" ] && [ "$at" = cut ]; then
      apply="setsid $W/cut.sh veth1 $flap $out > /dev/null 2>&1 &"
    elif [ -n "$flap" ]; then
      apply="setsid $W/flap.sh veth1 $flap $out > /dev/null 2>&1 &"
    fi
    if [ -n "$flap" ]; then
      by_time=("LOSS_SECONDS=$(awk -v f="$flap" 'BEGIN { print f + 15 }')" "LOSS_DEADLINE_S=$(awk -v f="$flap" 'BEGIN { print int(f + 90) }')")
      rm -f "$out.up" "$out.down" "$out.routes"
    fi
    # the rig's own deadline, if the scenario sets one, plus a minute; else 480 s
    local tmo=480
    [[ $xenv == *LOSS_DEADLINE_S=* ]] && { tmo=${xenv##*LOSS_DEADLINE_S=}; tmo=$((${tmo%% *} + 60)); }
    # (a scenario run again in this boot starts from an empty statistics
    # directory: the rig reads every file in it)
    rm -rf "$dir"
    snap $out.before
    watch_pid=""
    if [ "$name" = loss1 ]; then
      "$T/rustnet" watch --dev rxe0,rxe1 --interval 1 > $out.watch 2>&1 &
      watch_pid=$!
      # a copy of the statistics file mid-run (open comms: per-comm and per-QP series)
      (sleep 4; cp "$dir"/*.prom $out.mid.prom 2>/dev/null) &
    fi
    # shellcheck disable=SC2086  # xenv: assignments, one per word
    env NCCL_IB_TIMEOUT="$to" NCCL_IB_RETRY_CNT="$rc" LOSS_MODE="$mode" LOSS_APPLY="$apply" \
      RUSTNET_STATS_DIR="$dir" RUSTNET_STATS_INTERVAL=1 LOSS_BYTES="${LOSS_BYTES:-33554432}" \
      LOSS_TIMELINE="$out.timeline" LOSS_BEFORE="$before" $xenv "${by_time[@]}" \
      timeout "$tmo" "$T/rustnet-loss" > $out.out 2> $out.err
    local prc=$?
    [ -n "$watch_pid" ] && { sleep 1.2; kill "$watch_pid" 2>/dev/null; wait "$watch_pid" 2>/dev/null; }
    for d in $devs; do tc qdisc del dev "$d" root 2>/dev/null; done
    snap $out.after
    cat $out.out
    line=$(grep -E '^LOSS (ok|failed)' $out.out)
    secs=$(sed -n 's/.* secs=\([0-9.]*\).*/\1/p' <<<"$line")
    local cnt
    cnt=$(delta $out.before $out.after)
    echo "rxe hw_counters (rxe0+rxe1): $cnt"
    if [ "$mode" = fail ]; then
      [[ $xenv == *RUSTNET_RECOVERY_TIMEOUT=* ]] && { window=${xenv##*RUSTNET_RECOVERY_TIMEOUT=}; window=${window%% *}; }
      expect=$(awk -v t="$to" -v r="$rc" -v w="$window" 'BEGIN { printf "%.3f", 4.096e-6 * 2^t * (r + 1) + w }')
      echo "expected: 4.096 us * 2^$to * ($rc + 1) + a recovery window of $window s = $expect s"
      grep -m2 'comm failed' $out.err | sed 's/^/  WARN: /' | cut -c1-500
      # LOSS_NCCL_DEBUG=INFO: the recoveries' steps up to the failure
      [ -n "${NCCL_DEBUG:-}" ] && grep -E 'recovery epoch|recovering in place|the peer stopped' $out.err | head -60 | sed 's/^/  INFO: /' | cut -c1-240
    fi
    if [ -n "$flap" ]; then
      grep -E 'recover' $out.err | grep -v 'recovery epoch' | head -6 | sed 's/^/  WARN: /' | cut -c1-300
      # LOSS_NCCL_DEBUG=INFO: each recovery's steps with their times
      grep -E 'recovery epoch' $out.err | head -40 | sed 's/^/  INFO: /' | cut -c1-200
      if [ -s "$out.up" ]; then
        # from link-up to the first message received after it, and the longest silence
        again=$(awk -v up="$(cat "$out.up")" '$1 > up { print $1 - up; exit }' "$out.timeline")
        again=$(printf '%.2f' "${again:-999}")
        local rback
        rback=$(awk -v a="$(cat "$out.up")" -v b="$(cat "$out.routes" 2>/dev/null || echo 0)" 'BEGIN { printf "%.2f", b - a }')
        echo "link down $(awk -v a="$(cat "$out.down")" -v b="$(cat "$out.up")" 'BEGIN { printf "%.2f", b - a }') s (routes back $rback s after link-up); traffic again ${again} s after link-up ($(awk -v a="$again" -v r="$rback" 'BEGIN { printf "%.2f", a - r }') s after the routes); longest gap between messages $(sort -n "$out.timeline" | awk 'NR > 1 && $1 - p > g { g = $1 - p } { p = $1 } END { printf "%.2f", g }') s"
        grep -h 'recovered in' $out.err | sed 's/^/  WARN: /' | cut -c1-200
        # (with LOSS_NCCL_DEBUG=INFO) connects that waited for the kernel's address resolution
        grep -h 'moving the new QPs to RTS took' $out.err | sed 's/.*recovery epoch/  INFO: recovery epoch/' | cut -c1-120
      else
        echo "the flap did not finish (no link-up time)"
        again=999
      fi
    fi
    if [[ $name == invreq* ]]; then
      local ninv nrec
      ninv=$(grep -c "answered 'invalid request'" $out.err)
      nrec=$(grep -c 'recovered in' $out.err)
      echo "soft-RoCE 'invalid request' completions recovered in place: $ninv (recoveries: $nrec)"
      grep -h -m3 "answered 'invalid request'" $out.err | sed 's/^/  WARN: /' | cut -c1-400
      grep -h -m3 'recovered in' $out.err | sed 's/^/  WARN: /' | cut -c1-200
    fi
    echo "plugin statistics ($dir):"
    "$T/rustnet" stats "$dir" | sed 's/^/  /'
    local errs bytes
    errs=$(cat "$dir"/*.prom 2>/dev/null | awk '/^rustnet_device_errors_total/ { s += $2 } END { print s + 0 }')
    bytes=$(cat "$dir"/*.prom 2>/dev/null | awk '/^rustnet_device_bytes_total.*dir="recv"/ { s += $2 } END { printf "%.0f\n", s }')
    if [ -n "$watch_pid" ]; then
      echo "rustnet watch during the run: one interval, then what it named (count of intervals):"
      awk '/^--- t=/ { n++ } n == 3' $out.watch | sed 's/^/  /'
      grep -E '^  => ' $out.watch | sed 's/ [0-9.]*\/s//g; s/+[0-9.]*//g' | sort | uniq -c | sort -rn | head -6 | sed 's/^/  /'
      if [ -s $out.mid.prom ]; then
        echo "the statistics file 4 s into the run (comm and QP series):"
        grep -E '^rustnet_(info|comm_bytes|qp_)' $out.mid.prom | sed 's/^/  /'
      fi
    fi
    res=PASS
    if [ "$mode" = ok ] && ! grep -q '^LOSS ok' $out.out; then
      res=FAIL
      # what failed the comm (the rig's files are gone with the VM)
      grep -m3 -E 'comm failed|failed in recovery' $out.err | sed 's/^/  WARN: /' | cut -c1-600
    fi
    if [ "$mode" = fail ]; then
      if ! grep -q '^LOSS failed' $out.out; then res=FAIL
      elif ! grep -q 'comm failed.*10\.199\.0\.' $out.err; then res="FAIL(no peer named)"
      elif awk -v s="$secs" -v e="$expect" 'BEGIN { exit !(s > 3 * e + 2) }'; then res="FAIL(too slow)"
      elif [ "$window" != 0 ] && ! grep -q 'comm failed.*RUSTNET_RECOVERY_TIMEOUT' $out.err; then res="FAIL(knob not named)"
      fi
    fi
    if [ -n "$flap" ] && [ "$res" = PASS ] && awk -v a="$again" -v m="${LOSS_RESUME_MAX:-2}" 'BEGIN { exit !(a > m) }'; then
      res="FAIL(again after ${again} s)"
    fi
    [ $prc != 0 ] && [ "$res" = PASS ] && res="FAIL(exit $prc)"
    [ "$res" = PASS ] || fails=$((fails + 1))
    rows+=("$(printf '%-10s %5s %3s %3s %-4s %8s %8s %6s %12s %6s  %s' "$name" "$loss" "$to" "$rc" "$mode" "${secs:--}" "${expect:--}" "$errs" "$bytes" "$again" "$res | $cnt")")
  }
  want=" ${LOSS_SCENARIOS:-clean loss1 cut-t14 cut-t16 cut-t18 cut-rec flap-0.5 flap-3 flap-3-shared flap-connect cut-3-rec} "
  [ "${LOSS_SLOW:-0}" = 1 ] && want+="loss1-t20 flap-20 flap-20-shared "
  # each picked scenario runs LOSS_REPEAT times (1): rows name/2, name/3, ...
  pick() {
    [[ $want == *" $1 "* ]] || return 0
    local k name=$1
    shift
    for k in $(seq 1 "${LOSS_REPEAT:-1}"); do
      if [ "$k" = 1 ]; then scenario "$name" "$@"; else scenario "$name/$k" "$@"; fi
    done
  }
  pick clean   0%   14 7 ok
  pick loss1   1%   14 7 ok
  pick loss1-t20 1% 20 7 ok
  # (by name only) 5% loss: slower still, nothing lost
  pick loss5   5%   14 7 ok
  pick cut-t14 100% 14 2 fail RUSTNET_RECOVERY_TIMEOUT=0
  pick cut-t16 100% 16 3 fail RUSTNET_RECOVERY_TIMEOUT=0
  pick cut-t18 100% 18 1 fail RUSTNET_RECOVERY_TIMEOUT=0
  pick cut-rec 100% 14 2 fail RUSTNET_RECOVERY_TIMEOUT=5
  # the out-of-band sockets on lo (as on a cluster whose NCCL_SOCKET_IFNAME
  # is another network than the RDMA fabric): "again" is the recovery's own
  # time; the -shared ones use veth0, whose routes the rig puts back itself
  pick flap-0.5 0%  20 7 ok NCCL_SOCKET_IFNAME=lo 0.5
  pick flap-3  0%   20 7 ok NCCL_SOCKET_IFNAME=lo 3
  pick flap-20 0%   20 7 ok NCCL_SOCKET_IFNAME=lo 20
  pick flap-3-shared 0% 20 7 ok "" 3
  pick flap-20-shared 0% 20 7 ok "" 20
  pick flap-connect 0% 20 7 ok "" 3 connect
  # every packet on veth1 dropped for 3 s, the port ACTIVE throughout, with a
  # retry budget short enough that the QPs fail inside the cut
  # (NCCL_IB_RETRY_CNT < 7: rxe takes 7 as "retry forever"): each recovery's
  # new QPs fail again until the cut ends, as one episode; no error
  pick cut-3-rec 0% 14 2 ok NCCL_SOCKET_IFNAME=lo 3 cut
  # five minutes of traffic with a QP moved to the error state every 500th
  # data post (from the 300th): at least 20 recoveries
  pick qperr   0%   20 7 ok "RUSTNET_FAULT_QP_ERROR=send:300:500 LOSS_SECONDS=${LOSS_QPERR_SECONDS:-300} LOSS_DEADLINE_S=420"
  # (by name only) ten minutes of 64 KiB messages both ways, no fault
  # injected: rxe's own "invalid request" now and then, each recovered
  inv_s=${LOSS_INVREQ_SECONDS:-600}
  pick invreq  0%   20 7 ok "LOSS_MSG=65536 LOSS_WINDOW=8 LOSS_SECONDS=$inv_s LOSS_DEADLINE_S=$((inv_s + 120))"
  echo
  echo "=== loss table (secs: ok = transfer time of ${LOSS_BYTES:-33554432} B each way, or how long a flap run lasted; fail = from the loss to the first failed call; again: from link-up to the next message received)"
  printf '%-10s %5s %3s %3s %-4s %8s %8s %6s %12s %6s  %s\n' scenario loss to rc mode secs expect errors "recv bytes" again "result | rxe hw_counters (rxe0+rxe1)"
  printf '%s\n' "${rows[@]}"
  [ $fails = 0 ] && echo "loss: PASS" || echo "loss: FAIL ($fails scenario(s))"
  [ $fails = 0 ]
  exit
fi

# ---- on the host ---------------------------------------------------------------
cd "$ROOT" || exit 2
if [ "${LOSS_NO_BUILD:-0}" != 1 ]; then
  cargo build --release --quiet || exit 2  # the plugin, rustnet and rustnet-loss
fi
case $ROOT in /tmp/*|/run/*|/var/tmp/*) export RXE_VM_RO="${RXE_VM_RO:-} $ROOT" ;; esac
# the VM outlives the long scenarios it is asked for (a 1200 s invreq once
# ran into the 900 s default and was killed with nothing to show)
vm_s=900
case " ${LOSS_SCENARIOS:-} " in *" invreq "*) vm_s=$((vm_s + ${LOSS_INVREQ_SECONDS:-600} + 180)) ;; esac
case " ${LOSS_SCENARIOS:-} " in *" qperr "*) vm_s=$((vm_s + ${LOSS_QPERR_SECONDS:-300} + 180)) ;; esac
export RXE_VM_PAIRS=1 RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-$vm_s}
guest=$(printf '%q ' env "LOSS_BYTES=${LOSS_BYTES:-33554432}" "LOSS_DEVS=${LOSS_DEVS:-veth1}" "LOSS_SLOW=${LOSS_SLOW:-0}" \
  "LOSS_SCENARIOS=${LOSS_SCENARIOS:-clean loss1 cut-t14 cut-t16 cut-t18 cut-rec flap-0.5 flap-3 flap-3-shared flap-connect cut-3-rec}" "LOSS_MSG=${LOSS_MSG:-1048576}" \
  "LOSS_RESUME_MAX=${LOSS_RESUME_MAX:-2}" "LOSS_REPEAT=${LOSS_REPEAT:-1}" "LOSS_QPERR_SECONDS=${LOSS_QPERR_SECONDS:-300}" \
  "LOSS_INVREQ_SECONDS=${LOSS_INVREQ_SECONDS:-600}" ${LOSS_PLUGIN:+"LOSS_PLUGIN=$LOSS_PLUGIN"} \
  ${LOSS_NCCL_DEBUG:+"NCCL_DEBUG=$LOSS_NCCL_DEBUG"} bash "$HERE/loss.sh" --in-vm)
"$HERE/run.sh" "$guest"
