#!/bin/bash
# Soak the built plugin: hours-long-style traffic with faults, every byte
# checked, fds/threads/RSS (and verbs MRs/QPs) sampled into CSV + SVG.
#
#   scripts/soak.sh                 30 min over TCP, then 5 min over verbs in the VM
#   SOAK_SECONDS=180 SOAK_VM_SECONDS=60 scripts/soak.sh     (what CI runs)
#
# The driver is crates/rustnet-rigs/src/soak/main.rs, the binary rustnet-soak (its
# header lists every SOAK_* knob). Parts:
#   TCP   two network namespaces joined by a veth (root + iproute2; else
#         loopback, and the link faults are skipped loudly); faults: peer B
#         SIGKILLed and restarted, link cut for 2 x RUSTNET_SOCKET_TIMEOUT + 2 s
#         and link flapped for 0.5 s: both ends must survive both with every
#         byte intact (the cut by recovering: RUSTNET_RECOVERY_TIMEOUT, default
#         120 s; with RUSTNET_RECOVERY_TIMEOUT=0 a cut must fail both ends,
#         naming the peer).
#   VM    soft-RoCE (tests/rxe-vm), rxe0/veth0 <-> rxe1/veth1, RUSTNET_TRANSPORT=ib,
#         1% loss (netem) on both veths for the whole run, the same faults
#         (the cut/flap take veth1 down, and its port with it: the verbs
#         comms recover in place and must survive both, every byte intact,
#         as long as RUSTNET_RECOVERY_TIMEOUT outlasts the cut).
#         Runs under `flock /tmp/rxe-vm.lock`.
#
# Knobs: SOAK_SECONDS (1800, TCP part), SOAK_VM_SECONDS (300; 0 = skip the VM),
# SOAK_TCP=0 (skip TCP), SOAK_VM_LOSS (1%), SOAK_VM_IB_TIMEOUT (14: 67 ms
# verbs retransmission timer; NCCL's default 20 is 4.3 s per lost packet,
# which at 1% loss leaves an emulated link mostly idle), SOAK_OUT
# (target/soak). Outputs per part under $SOAK_OUT/{tcp,vm}: soak-summary.md,
# soak-samples.csv, soak-cycles.csv, soak-quiet.csv, soak.svg.
# Exit: 0 every part passed, 1 a part failed, 125 the VM died or timed out.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
out=${SOAK_OUT:-$ROOT/target/soak}
case $out in /*) ;; *) out=$ROOT/$out ;; esac
echo "[soak] cargo build --release (the plugin and target/release/rustnet-soak)"
cargo build --release --quiet || exit 2
rc=0
if [ "${SOAK_TCP:-1}" != 0 ]; then
  echo "[soak] TCP part: ${SOAK_SECONDS:-1800} s"
  mkdir -p "$out/tcp"
  SOAK_OUT=$out/tcp RUSTNET_TRANSPORT=socket target/release/rustnet-soak || rc=1
fi
vm_secs=${SOAK_VM_SECONDS:-300}
if [ "$vm_secs" != 0 ]; then
  if [ ! -x tests/rxe-vm/run.sh ]; then
    echo "[soak] !! SKIPPED: verbs part (tests/rxe-vm/run.sh not present)"
  else
    echo "[soak] verbs part in the soft-RoCE VM: $vm_secs s, loss ${SOAK_VM_LOSS:-1%}"
    mkdir -p "$out/vm"
    guest=$(printf '%q ' env RUSTNET_TRANSPORT=ib SOAK_NET=vm "SOAK_SECONDS=$vm_secs" "SOAK_OUT=$out/vm" \
      "SOAK_LOSS=${SOAK_VM_LOSS-1%}" "NCCL_IB_TIMEOUT=${SOAK_VM_IB_TIMEOUT:-14}" \
      "SOAK_MAX_BIG=${SOAK_VM_MAX_BIG:-1048576}" "SOAK_MAX_ROUNDS=${SOAK_VM_MAX_ROUNDS:-8}" \
      "SOAK_CYCLE_TIMEOUT_S=${SOAK_VM_CYCLE_TIMEOUT_S:-300}" "SOAK_FAULT_EVERY_S=${SOAK_VM_FAULT_EVERY_S:-30}" \
      "SOAK_SAMPLE_S=5" "SOAK_SEED=${SOAK_SEED:-1}" \
      "$ROOT/target/release/rustnet-soak")
    # The guest sees the host's / read-only but has its own /tmp, /run and
    # /var/tmp: a checkout under one of them must be shared explicitly (as
    # verbs-suite.sh and loss.sh do). Only target/release, where the binary
    # and librustnet.so lie: the VM mounts RW folders first, so sharing all
    # of $ROOT would hide $out/vm when it lies inside $ROOT (the default).
    vm_ro=${RXE_VM_RO:-}
    case $ROOT in /tmp|/tmp/*|/run|/run/*|/var/tmp|/var/tmp/*) vm_ro+=" $ROOT/target/release" ;; esac
    RXE_VM_RO=$vm_ro RXE_VM_RW="$out/vm" RXE_VM_PAIRS=1 RXE_VM_TIMEOUT=$((vm_secs + 600)) \
      flock /tmp/rxe-vm.lock tests/rxe-vm/run.sh "$guest"
    vrc=$?
    if [ $vrc = 125 ]; then rc=125; elif [ $vrc != 0 ]; then [ $rc = 0 ] && rc=1; fi
  fi
fi
for part in tcp vm; do
  [ -f "$out/$part/soak-summary.md" ] && { echo "== soak $part ($out/$part)"; cat "$out/$part/soak-summary.md"; }
done
echo "[soak] $([ $rc = 0 ] && echo PASS || echo "FAIL (exit $rc)")"
exit $rc
