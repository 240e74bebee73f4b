#!/bin/bash
# tests/rxe-vm/bench-lib.sh -- what the VM benchmarks share (bench-verbs.sh,
# bench-netib.sh, bench-iwarp.sh source it inside the guest): waiting for a
# server's port, median [min-max] of a list of samples, and rxe's
# retransmission counters.

# waitport PORT: until something listens on PORT (10 s at most)
waitport() { for _ in $(seq 200); do ss -Hltn "sport = :$1" | grep -q . && return 0; sleep 0.05; done; return 1; }

# stats "v1 v2 ...": "median [min-max]" ("-" for none); med: the median alone
stats() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '{a[NR]=$1} END{if(NR==0){print "-";exit} printf "%.1f [%.1f-%.1f]", a[int((NR+1)/2)], a[1], a[NR]}'; }
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
