#!/bin/bash
# tests/rxe-vm/bench-lib.sh -- what the VM benchmarks share (bench-verbs.sh,
# bench-netib.sh, bench-iwarp.sh, callgrind-test.sh, cpu-ab.sh source it): on the host,
# the build and the VM launch; inside the guest, waiting for a server's port,
# median [min-max] of a list of samples, and rxe's retransmission counters.

# ---- on the host -------------------------------------------------------------
# vm_bench SCRIPT "VARS" [FILE ...]: build the release tree, refuse FILEs
# the guest cannot see (the host's /tmp is not the guest's), share a checkout
# that lives under /tmp read-only, and re-run SCRIPT --in-vm in the VM with
# out/ writable and the environment variables VARS passed in. Needs ROOT and
# HERE set; does not return.
vm_bench() {
  local script=$1 vars=$2 f
  shift 2
  cd "$ROOT" || exit 2
  cargo build --release --quiet || exit $?
  case $ROOT in /tmp/*|/run/*|/var/tmp/*) export RXE_VM_RO="${RXE_VM_RO:-} $ROOT" ;; esac
  for f in "$@"; do
    [ -f "$f" ] || { echo "${script##*/}: no such file: $f"; exit 2; }
    case $(readlink -f "$f") in
      "$ROOT"/*) ;; # (shared with the checkout)
      /tmp/*|/run/*|/var/tmp/*) echo "${script##*/}: the VM does not see the host's $f; put it elsewhere"; exit 2 ;;
    esac
  done
  mkdir -p out
  RXE_VM_RW="$ROOT/out" RXE_VM_PASSENV="$vars" exec "$HERE/run.sh" "bash $script --in-vm"
}

# vm_bench_plugins SCRIPT "VARS": vm_bench for a script driven by PLUGINS
# ("label=path ...", default: this build's plugin), whose files it checks.
vm_bench_plugins() {
  local p files=()
  PLUGINS=${PLUGINS:-"librustnet=$ROOT/target/release/librustnet.so"}
  export PLUGINS
  for p in $PLUGINS; do files+=("${p#*=}"); done
  vm_bench "$1" "PLUGINS $2" "${files[@]}"
}

# ---- in the guest --------------------------------------------------------------

# waitport PORT: until something listens on PORT (10 s at most)
waitport() { for _ in $(seq 200); do ss -Hltn "sport = :$1" | grep -q . && return 0; sleep 0.05; done; return 1; }

# stats "v1 v2 ..." [DECIMALS]: "median [min-max]" ("-" for none), with
# DECIMALS (1) digits; med: the median alone
stats() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk -v d="${2:-1}" '{a[NR]=$1} END{if(NR==0){print "-";exit} f="%." d "f"; printf f " [" f "-" f "]", a[int((NR+1)/2)], a[1], a[NR]}'; }
med() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

# rxe's own counters of a QP going back and resending: a QP whose packets
# arrive out of order makes rxe resend (docs/verbs-cost.md)
RXE_KEYS="out_of_seq_request duplicate_request completer_retry_err"
rxe_now() { # the three counters, each summed over rxe0 and rxe1
  local k d s v
  for k in $RXE_KEYS; do
    s=0
    for d in rxe0 rxe1; do read -r v < "/sys/class/infiniband/$d/ports/1/hw_counters/$k" || v=0; s=$((s + v)); done
    printf '%s ' "$s"
  done
}
rxe_per_gb() { # rxe_per_gb BEFORE BYTES: each counter's growth since BEFORE (rxe_now's output) per GB moved
  local was now i=0 k
  read -ra was <<<"$1"; read -ra now <<<"$(rxe_now)"
  for k in $RXE_KEYS; do
    awk -v n="$((now[i] - was[i]))" -v b="$2" 'BEGIN { printf "%.1f ", n * 1e9 / b }'
    i=$((i + 1))
  done
}
