#!/bin/bash
# tests/rxe-vm/verbs-suite.sh -- run the verbs test binaries against real
# kernel RDMA (soft-RoCE in a VM). This is what CI calls:
#
#   tests/rxe-vm/verbs-suite.sh
#
# 1. On the host (the VM must not compete with the build for the two cores,
#    and has no writable cargo home): `cargo build --release`, then
#    `cargo test --release --no-run --message-format=json` to learn the paths
#    of the test binaries.
# 2. One VM boot (run.sh) with two veth pairs (RXE_VM_PAIRS=2: rxe0-rxe1 and
#    rxe2-rxe3); inside it each selected binary runs from the host's
#    read-only target dir with --test-threads=1 and
#      RUSTNET_TEST_DEVICE=rxe0 RUSTNET_TEST_DEVICE2=rxe1 RUSTNET_TRANSPORT=ib
#      NCCL_SOCKET_IFNAME=veth0 RXE_VM_IP0=10.199.0.1 RXE_VM_IP1=10.199.0.2
#      RUSTNET_TEST_RAILS="rxe0,rxe2;rxe1,rxe3" (merged-device tests)
#    The conformance suite runs four times: both peers on rxe0; rxe0 -> rxe1;
#    the traffic cases with 4 QPs per connection split (NCCL_IB_QPS_PER_CONNECTION=4
#    NCCL_IB_SPLIT_DATA_ON_QPS=1); the v6-v8 traffic cases and the cross-round
#    tags case through merged devices (rxe0+rxe2 -> rxe1+rxe3, RUSTNET_IB_MERGE_NICS),
#    and v9-v12 makeVDevice fusing the same two devices per side; with a
#    soft-iWARP pair (RXE_VM_SIW=1, the default) a fifth pass runs every
#    version's traffic, grouped tags, profiler events and peer death over
#    siw0 -> siw1 (rdma_cm, notices), a sixth its traffic with 4 QPs split
#    (a notice per lane), and fuzz_calls runs again on siw0. A further pass
#    runs the traffic cases with peer A at RUSTNET_IB_EAGER_LAZY=0 (its rings
#    registered at connect, as builds before late rings do) against B's late
#    rings, both directions; with VERBS_PEER_SO=/path/librustnet.so (another
#    build, e.g. main's) one more runs them with B on that build. Then a
#    short `rustnet bench scale` over rxe0 (16 and 128 comm pairs, ~30 s)
#    checks what one verbs comm costs: 1 QP and at most 1.5 memory
#    registrations per comm, at most 180 KiB of RSS per comm (NCCL's net_ib
#    design measured 178 in this VM, docs/scale.md), RSS back within 8 MB
#    after close.
# 3. Prints PASS/FAIL per binary and a summary. Exit 0 when all passed, 1 when
#    any failed, 125 when the VM died or timed out, other values when the build
#    failed.
#
# Knobs:
#   VERBS_TESTS="a b"        cargo test targets to run (integration test names,
#                            i.e. tests/<name>.rs; `rustnet` = the lib unit
#                            tests). Default: every test target whose name
#                            contains "verbs" or "conformance", fuzz_calls (its fixed seeds, ~30 s)
#                            and iwarp_* (rdma_cm and notices over siw0 -> siw1).
#   VERBS_TEST_ARGS="..."    extra libtest arguments (a name filter, --nocapture);
#                            device tests are #[ignore]d on hosts, so --include-ignored is always passed
#   VERBS_TEST_TIMEOUT=600   seconds per binary
#   VERBS_SMOKE=auto|1|0     run smoke.sh first: auto = only when no test binary
#                            was selected (the rig itself is then what we check)
#   VERBS_ENV="K=V ..."      more environment for the tests (e.g. RUST_LOG=debug)
#   VERBS_RW_TARGET=1        mount the cargo target dir read-write (for tests
#                            that write under target/, e.g. CARGO_TARGET_TMPDIR)
#   VERBS_NO_BUILD=1         skip `cargo build --release` (test binaries are
#                            still (re)built by `cargo test --no-run`)
#   VERBS_PEER_SO=PATH       an older plugin build for peer B in an extra
#                            conformance pass (wire compatibility); a path the
#                            guest can read (under / but not /tmp)
#   VERBS_SIW_QP_FAULTS=1|0  run the conformance traffic over siw with QPs
#                            moved to the error state at random (default 1 since
#                            the iWARP delivery fence, stop 39; 0 skips it)
#   VERBS_SCALE=auto|1|0     run the short verbs bench scale check; auto = with
#                            the default selection (no VERBS_TEST_ARGS)
#   VERBS_LOSS=auto|1|0      run loss.sh's scenarios (netem loss on veth1 under
#                            verbs traffic, ~40 s) in the same boot; auto = with
#                            the default selection (no VERBS_TEST_ARGS)
#   RXE_VM_*                 passed on to run.sh (RXE_VM_PAIRS, RXE_VM_TIMEOUT...)
set -u -o pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

# ---- in the guest: verbs-suite.sh --in-vm NAME=PATH ... ----------------------
if [ "${1:-}" = --in-vm ]; then
  shift
  ulimit -l unlimited
  export RUSTNET_TEST_DEVICE=rxe0 RUSTNET_TEST_DEVICE2=rxe1 RUSTNET_TRANSPORT=ib \
         NCCL_SOCKET_IFNAME=veth0 RUST_BACKTRACE=1 CARGO_MANIFEST_DIR="$ROOT"
  export RXE_VM_IP0 RXE_VM_IP1
  [ "${RXE_VM_PAIRS:-1}" -ge 2 ] && export RUSTNET_TEST_RAILS="rxe0,rxe2;rxe1,rxe3"
  # emulation is noisy: a failed conformance case runs once more and is
  # reported as FLAKY (with its first error) if it then passes
  export RUSTNET_CONF_RETRY=1
  # connect/close churn: 3000 verbs connections (each ~10 ms under
  # emulation) show fd, thread and heap growth as well as the host's 10000
  # TCP ones, and leave the binary room within VERBS_TEST_TIMEOUT
  export RUSTNET_CONF_CONNECTS=${RUSTNET_CONF_CONNECTS:-3000}
  # what `cargo test` would add, so dylib-linked tests find their libraries
  export LD_LIBRARY_PATH="${VERBS_LIB_DIRS:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for kv in ${VERBS_ENV:-}; do export "${kv?}"; done
  smoke=${VERBS_SMOKE:-auto}
  fails=0 results=()
  if [ "$smoke" = 1 ] || { [ "$smoke" = auto ] && [ $# = 0 ]; }; then
    echo "=== smoke"
    if bash "$HERE/smoke.sh"; then results+=("PASS smoke"); else results+=("FAIL smoke"); fails=$((fails + 1)); fi
  fi
  # rustnet doctor, live: must see rxe0/rxe1, their GID tables, the IPv4 RoCE
  # v2 choice with its reason, and the plugin's own init choosing verbs.
  if [ -x "${VERBS_RUSTNET:-}" ] && [ -z "${VERBS_TEST_ARGS:-}" ] && { [ $# = 0 ] || [[ " $* " == *conformance* ]]; }; then
    echo "=== doctor (live): RUSTNET_TRANSPORT=ib rustnet doctor --json"
    djson=$("$VERBS_RUSTNET" doctor --json 2>/tmp/doctor.err)
    dmiss=()
    wants=('"dev":"rxe0"' '"dev":"rxe1"' '"gid_index":1' '::ffff:10.199.0.1 RoCE v2' '"detail":"ib: ')
    # iWARP beside RoCE: listed, told apart, and the rdma_cm line said
    [ -n "${RXE_VM_SIW_DEVICES:-}" ] && wants+=('"dev":"siw0"' '"iwarp":true' 'iWARP connects only through rdma_cm')
    for want in "${wants[@]}"; do
      [[ $djson == *"$want"* ]] || dmiss+=("$want")
    done
    if [ ${#dmiss[@]} = 0 ]; then
      "$VERBS_RUSTNET" doctor 2>/dev/null | grep -E 'GID [0-9]+:|transport:|\(iWARP\)' | sed 's/^/  /'
      results+=("PASS doctor (live)")
    else
      echo "doctor output lacks: ${dmiss[*]}"; echo "$djson" | head -c 3000; echo; cat /tmp/doctor.err
      results+=("FAIL doctor (live)"); fails=$((fails + 1))
    fi
  fi
  # The conformance suite runs up to six times: both peers on rxe0 (one
  # device to itself); the traffic and peer-death cases rxe0 -> rxe1 across
  # the veth; the traffic cases with 4 QPs split; (two pairs booted) the
  # v6-v8 traffic cases (and the cross-round tags case) through self-merged
  # devices rxe0+rxe2 -> rxe1+rxe3; and (siw booted) siw0 -> siw1 and siw
  # with 4 QPs split.
  runs=()
  for t in "$@"; do
    runs+=("$t")
    case ${t%%=*} in conformance)
      runs+=("conformance_rxe0_to_rxe1=${t#*=}" "conformance_4qps_split=${t#*=}")
      runs+=("conformance_qp_faults=${t#*=}" "conformance_qp_faults_4qps_split=${t#*=}")
      runs+=("conformance_eager_at_connect_vs_late=${t#*=}")
      [ -n "${VERBS_PEER_SO:-}" ] && runs+=("conformance_with_peer_build=${t#*=}")
      [ "${RXE_VM_PAIRS:-1}" -ge 2 ] && runs+=("conformance_merged_rxe0+rxe2_to_rxe1+rxe3=${t#*=}")
      [ -n "${RXE_VM_SIW_DEVICES:-}" ] && runs+=("conformance_siw0_to_siw1=${t#*=}" "conformance_siw_4qps_split=${t#*=}")
      # (random QP faults over iWARP; before the delivery fence about one
      # traffic run in 13 lost a message the sender had completed, which
      # failed the comm: docs/resilience.md)
      [ -n "${RXE_VM_SIW_DEVICES:-}" ] && [ "${VERBS_SIW_QP_FAULTS:-1}" = 1 ] && runs+=("conformance_siw_qp_faults=${t#*=}")
      ;;
    fuzz_calls)
      # the same call-sequence fuzz over iWARP (siw0 to itself through rdma_cm)
      [ -n "${RXE_VM_SIW_DEVICES:-}" ] && runs+=("fuzz_calls_siw0=${t#*=}")
      ;;
    esac
  done
  for t in "${runs[@]}"; do
    name=${t%%=*} bin=${t#*=}
    extra=() run_env=()
    unset RUSTNET_CONF_A_ENV RUSTNET_CONF_B_ENV
    case $name in
      conformance_rxe0_to_rxe1)
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        # (killed_during_recovery: veth1 goes down under both ends, one is
        # killed while they recover; the survivor must fail naming it)
        # (late_rank: veth1 flaps while B's rank calls nothing; B's comm
        # must recover by the keeper thread; connect_rtr: the first moves of
        # new QPs to RTR fail as a link lost inside them does)
        extra=(traffic peer_killed killed_during_recovery late_rank connect_rtr)
        run_env=(RUSTNET_CONF_FLAP_IF=veth1)
        export RUSTNET_CONF_A_ENV="NCCL_IB_HCA==rxe0 NCCL_SOCKET_IFNAME=veth0" RUSTNET_CONF_B_ENV="NCCL_IB_HCA==rxe1 NCCL_SOCKET_IFNAME=veth1" ;;
      conformance_4qps_split)
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        extra=(traffic)
        run_env=(NCCL_IB_QPS_PER_CONNECTION=4 NCCL_IB_SPLIT_DATA_ON_QPS=1) ;;
      conformance_qp_faults|conformance_qp_faults_4qps_split)
        # QPs moved to the error state at random posts (3 per mille, both
        # ends, both sides): every comm recovers in place, every byte checked,
        # and at least one recovery must have happened
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        extra=(traffic_v8 traffic_v12 grouped_tags_across_rounds)
        run_env=(RUSTNET_FAULT_QP_ERROR=random:3 RUSTNET_FAULT_SEED=7 RUSTNET_CONF_WANT_RECOVERY=1)
        [ "$name" = conformance_qp_faults_4qps_split ] && run_env+=(NCCL_IB_QPS_PER_CONNECTION=4 NCCL_IB_SPLIT_DATA_ON_QPS=1)
        export RUSTNET_CONF_A_ENV="NCCL_IB_HCA==rxe0 NCCL_SOCKET_IFNAME=veth0" RUSTNET_CONF_B_ENV="NCCL_IB_HCA==rxe1 NCCL_SOCKET_IFNAME=veth1" ;;
      conformance_eager_at_connect_vs_late)
        # A registers its eager rings at connect (a build before late rings
        # answers the same), B asks for its peer's ring late: both directions
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        extra=(traffic_v8 traffic_v12)
        export RUSTNET_CONF_A_ENV="RUSTNET_IB_EAGER_LAZY=0" ;;
      conformance_with_peer_build)
        # B loads another build (VERBS_PEER_SO): the wire between builds
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        extra=(traffic_v8 traffic_v12)
        export RUSTNET_CONF_B_ENV="RUSTNET_CONF_LIBNAME=$VERBS_PEER_SO" ;;
      conformance_siw0_to_siw1)
        # iWARP (soft-iWARP): rdma_cm connections, notices instead of
        # immediates; every exported version's traffic, grouped tags,
        # profiler events and a peer killed mid-transfer; (late_rank) sveth1
        # flaps while one rank calls nothing (either direction): both comms
        # recover in place over new rdma_cm connections, the away one by the
        # keeper thread;
        # (killed_during_recovery) a peer killed while both recover: the
        # survivor fails naming it
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        extra=(traffic_v grouped_tags_across_rounds profiler_events_v peer_killed late_rank killed_during_recovery)
        run_env=(RUSTNET_CONF_FLAP_IF=sveth1)
        export RUSTNET_CONF_A_ENV="NCCL_IB_HCA==siw0 NCCL_SOCKET_IFNAME=sveth0" RUSTNET_CONF_B_ENV="NCCL_IB_HCA==siw1 NCCL_SOCKET_IFNAME=sveth1" ;;
      conformance_siw_4qps_split)
        # four lanes per message: a notice per QP, put back together
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        extra=(traffic_v grouped_tags_across_rounds peer_killed_mid_transfer)
        run_env=(NCCL_IB_QPS_PER_CONNECTION=4 NCCL_IB_SPLIT_DATA_ON_QPS=1)
        export RUSTNET_CONF_A_ENV="NCCL_IB_HCA==siw0 NCCL_SOCKET_IFNAME=sveth0" RUSTNET_CONF_B_ENV="NCCL_IB_HCA==siw1 NCCL_SOCKET_IFNAME=sveth1" ;;
      conformance_siw_qp_faults)
        # iWARP QPs moved to the error state at random posts (3 per mille,
        # both ends, both sides): soft-iWARP closes the connection, every
        # comm recovers in place over new rdma_cm connections and resends
        # only the notices' lanes the restart points lack; every byte checked
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        extra=(traffic_v8 traffic_v12 grouped_tags_across_rounds)
        run_env=(RUSTNET_FAULT_QP_ERROR=random:3 RUSTNET_FAULT_SEED=7 RUSTNET_CONF_WANT_RECOVERY=1)
        export RUSTNET_CONF_A_ENV="NCCL_IB_HCA==siw0 NCCL_SOCKET_IFNAME=sveth0" RUSTNET_CONF_B_ENV="NCCL_IB_HCA==siw1 NCCL_SOCKET_IFNAME=sveth1" ;;
      fuzz_calls_siw0)
        run_env=("NCCL_IB_HCA==siw0" NCCL_SOCKET_IFNAME=sveth0) ;;
      conformance_merged*)
        [ -z "${VERBS_TEST_ARGS:-}" ] || continue
        # (late_rank: veth1, under member 0 of each end, flaps while B's
        # rank calls nothing; B's member comm recovers by the keeper thread;
        # merged_member_down: veth1 stays down: both ends fail at the end of
        # the window, saying why, no failover between members yet)
        extra=(traffic_v6 traffic_v7 traffic_v8 grouped_tags_across_rounds vdevice_v9 vdevice_v10 vdevice_v11 vdevice_v12 late_rank merged_member_down)
        run_env=(RUSTNET_CONF_FLAP_IF=veth1)
        export RUSTNET_CONF_A_ENV="NCCL_IB_HCA==rxe0,rxe2 RUSTNET_IB_MERGE_NICS=rxe0,rxe2 NCCL_SOCKET_IFNAME=veth0" \
               RUSTNET_CONF_B_ENV="NCCL_IB_HCA==rxe1,rxe3 RUSTNET_IB_MERGE_NICS=rxe1,rxe3 NCCL_SOCKET_IFNAME=veth1" ;;
    esac
    echo "=== $name: $bin --test-threads=1 --include-ignored ${VERBS_TEST_ARGS:-} ${extra[*]}"
    t0=$EPOCHREALTIME
    # shellcheck disable=SC2086
    env "${run_env[@]}" timeout -k 10 "${VERBS_TEST_TIMEOUT:-600}" "$bin" --test-threads=1 --include-ignored ${VERBS_TEST_ARGS:-} "${extra[@]}" < /dev/null
    rc=$?
    dt=$(( (${EPOCHREALTIME/./} - ${t0/./}) / 1000000 ))
    case $rc in
      0) results+=("PASS $name (${dt} s)") ;;
      124|137) results+=("FAIL $name (timed out after ${dt} s)"); fails=$((fails + 1)) ;;
      *) results+=("FAIL $name (exit $rc, ${dt} s)"); fails=$((fails + 1)) ;;
    esac
  done
  # What one verbs comm costs (docs/scale.md): 16 and 128 comm pairs of one
  # process pair on rxe0, each comm 1 QP and at most 1.5 registrations (its
  # FIFO or sizes area; the rest come from shared blocks), RSS per comm at
  # most 180 KiB (net_ib's design: 178 here), RSS back within 8 MB after
  # closing everything. CSV columns: see `rustnet bench scale --help`.
  scale=${VERBS_SCALE:-auto}
  if [ "$scale" = 1 ] || { [ "$scale" = auto ] && [ -z "${VERBS_TEST_ARGS:-}" ] && { [ $# = 0 ] || [[ " $* " == *conformance* ]]; }; }; then
    echo "=== scale: rustnet bench scale over verbs (rxe0 to itself), 16 and 128 comm pairs"
    t0=$EPOCHREALTIME
    csv=/tmp/scale-ci.csv
    ulimit -n 65536 2>/dev/null
    # (transparent huge pages off in this throw-away guest: a heap that
    # happened to grow into a 2 MB page once read as 66 KiB more per comm
    # and 10 MB kept after close, stop 37's third suite; the check is about
    # what the plugin allocates per comm, not how the kernel backs it)
    echo madvise > /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null
    NCCL_IB_HCA="=rxe0" NCCL_IB_TIMEOUT=14 timeout -k 10 300 "$VERBS_RUSTNET" bench scale --comms 16,128 --reps 1 \
      --lat-iters 200 --bytes 8M --idle-s 0.5 --label ci --csv "$csv" < /dev/null 2>&1 | tail -n 6
    rc=${PIPESTATUS[0]}
    dt=$(( (${EPOCHREALTIME/./} - ${t0/./}) / 1000000 ))
    # columns: 6 RSS KiB/comm, 11 RSS after close - start (MB), 20 QPs/comm, 22 registrations/comm
    if [ $rc = 0 ] && awk -F, 'NR > 1 { n++ } NR > 1 && ($6 > 180 || $11 > 8 || $20 != 1 || $22 > 1.5) { print "FAIL: bench scale: " $0; bad = 1 } END { exit bad || n < 4 }' "$csv"; then
      results+=("PASS scale (${dt} s)")
    else
      results+=("FAIL scale (exit $rc, ${dt} s)"); fails=$((fails + 1))
    fi
  fi
  # Packet loss on the live fabric (loss.sh, ~40 s): 1% netem loss must only
  # slow verbs traffic, 100% must fail it within NCCL_IB_TIMEOUT/RETRY_CNT's
  # time, naming the peer. Runs with the default selection (VERBS_LOSS=auto),
  # or VERBS_LOSS=1 / 0.
  loss=${VERBS_LOSS:-auto}
  if [ "$loss" = 1 ] || { [ "$loss" = auto ] && [ -z "${VERBS_TEST_ARGS:-}" ] && { [ $# = 0 ] || [[ " $* " == *conformance* ]]; }; }; then
    if [ -x "${VERBS_RUSTNET%/*}/rustnet-loss" ]; then
      echo "=== loss: tests/rxe-vm/loss.sh --in-vm"
      t0=$EPOCHREALTIME
      LOSS_TARGET=${VERBS_RUSTNET%/*} timeout -k 10 480 bash "$HERE/loss.sh" --in-vm < /dev/null
      rc=$?
      dt=$(( (${EPOCHREALTIME/./} - ${t0/./}) / 1000000 ))
      if [ $rc = 0 ]; then results+=("PASS loss (${dt} s)"); else results+=("FAIL loss (exit $rc, ${dt} s)"); fails=$((fails + 1)); fi
    else
      # cargo build --release builds the rigs: missing means a broken build
      echo "=== loss: ${VERBS_RUSTNET%/*}/rustnet-loss not built"
      results+=("FAIL loss (rustnet-loss not built)"); fails=$((fails + 1))
    fi
  fi
  echo "=== verbs-suite results"
  printf '  %s\n' "${results[@]}"
  echo "verbs-suite: $((${#results[@]} - fails)) passed, $fails failed"
  [ $fails = 0 ]
  exit
fi

# ---- on the host: build, select, boot ----------------------------------------
msg() { echo "[verbs-suite] $*" >&2; }
cd "$ROOT" || exit 2
if [ "${VERBS_NO_BUILD:-0}" != 1 ]; then
  msg "cargo build --release"
  cargo build --release || { rc=$?; msg "cargo build failed"; exit "$rc"; }
fi
msg "cargo test --release --no-run"
json=$(cargo test --release --no-run --message-format=json) || { rc=$?; msg "building the tests failed"; exit "$rc"; }
# every test executable cargo built: "<target name> <kind> <path>" per line
artifacts=$(python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m["profile"]["test"] and m.get("executable"):
        print(m["target"]["name"], m["target"]["kind"][0], m["executable"])
' <<<"$json") || { msg "cannot parse cargo's JSON output"; exit 2; }
msg "test binaries built:"
while read -r name kind path; do [ -n "$name" ] && msg "  $name ($kind) $path"; done <<<"$artifacts"

selected=()
if [ -n "${VERBS_TESTS:-}" ]; then
  for want in $VERBS_TESTS; do
    found=0
    # a name can match several artifacts (the lib and a bin are both `rustnet`)
    while read -r name kind path; do
      [ "$name" = "$want" ] || continue
      found=1
      if [ "$kind" = test ]; then selected+=("$name=$path"); else selected+=("$name($kind)=$path"); fi
    done <<<"$artifacts"
    [ $found = 1 ] || { msg "VERBS_TESTS: no test target named '$want'"; exit 2; }
  done
else
  while read -r name kind path; do
    [ "$kind" = test ] && [[ $name == *verbs* || $name == *conformance* || $name == fuzz_calls || $name == iwarp_* ]] && selected+=("$name=$path")
  done <<<"$artifacts"
fi
if [ ${#selected[@]} = 0 ]; then
  msg "no verbs/conformance test binaries yet: running the rig smoke test only"
else
  msg "running in the VM: ${selected[*]%%=*}"
fi

# The guest sees the host's / read-only, except /tmp, /run and /var/tmp, which
# are its own tmpfs: share anything we need from there explicitly.
hidden() { case $1 in /tmp|/tmp/*|/run|/run/*|/var/tmp|/var/tmp/*) return 0 ;; esac; return 1; }
target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
             python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])') || target_dir=$ROOT/target
ro=${RXE_VM_RO:-} rw=${RXE_VM_RW:-}
if [ "${VERBS_RW_TARGET:-0}" = 1 ]; then rw+=" $target_dir"
elif hidden "$target_dir"; then ro+=" $target_dir"; fi
hidden "$ROOT" && ro+=" $ROOT"
export RXE_VM_RO=$ro RXE_VM_RW=$rw
export RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-3600}
# two veth pairs: rxe0-rxe1 and rxe2-rxe3 (merged-device tests need both)
export RXE_VM_PAIRS=${RXE_VM_PAIRS:-2}
# and a soft-iWARP pair siw0-siw1 on its own veths for tests/iwarp_*.rs
# (siw.ko is built on the first run, ~20 s; RXE_VM_SIW=0 leaves it out and
# those tests then skip with the reason)
export RXE_VM_SIW=${RXE_VM_SIW:-1}

# libtest binaries linked against Rust dylibs find them where cargo test would
# put them on LD_LIBRARY_PATH: target/release/deps and the toolchain's lib dir
lib_dirs="$target_dir/release/deps:$target_dir/release"
sysroot=$(rustc --print sysroot 2>/dev/null) && lib_dirs+=":$sysroot/lib"

guest_cmd=$(printf '%q ' env \
  "VERBS_SMOKE=${VERBS_SMOKE:-auto}" "VERBS_TEST_ARGS=${VERBS_TEST_ARGS:-}" \
  "VERBS_TEST_TIMEOUT=${VERBS_TEST_TIMEOUT:-600}" "VERBS_ENV=${VERBS_ENV:-}" "VERBS_LOSS=${VERBS_LOSS:-auto}" \
  "VERBS_PEER_SO=${VERBS_PEER_SO:-}" "VERBS_SCALE=${VERBS_SCALE:-auto}" \
  "VERBS_LIB_DIRS=$lib_dirs" "VERBS_RUSTNET=$target_dir/release/rustnet" bash "$HERE/verbs-suite.sh" --in-vm "${selected[@]}")
"$HERE/run.sh" "$guest_cmd"
rc=$?
[ $rc = 125 ] && msg "the VM died or timed out (exit 125)"
exit $rc
