#!/bin/bash
# The conformance suite (the built .so driven from two processes) under
# AddressSanitizer and under valgrind memcheck; any report fails the run.
# Also the call-sequence fuzzer (tests/fuzz_calls.rs) under ASan, briefly.
# Called from scripts/test.sh; about 2.5 minutes on 2 cores (docs/fuzzing.md).
#
#   RUSTNET_SANITIZE=asan|valgrind|all   which (default all)
#   RUSTNET_SANITIZE_LEAKS=asan (default): LeakSanitizer on (any leak fails;
#       tests/lsan.supp names the harness's own deliberate leaks); 1: also
#       valgrind's "definitely lost"; 0: no leak check.
#
# ASan needs a nightly toolchain (-Zsanitizer); it is installed with rustup
# when missing. RUSTNET_ASAN_TOOLCHAIN picks one (default nightly; a dated
# one, e.g. nightly-2026-05-19, pins it should a newer nightly break the flags). Where that is impossible the ASan part is SKIPPED with the
# reason, loudly, and valgrind still runs. valgrind comes from apt.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${RUSTNET_SANITIZE:-all}
leaks=${RUSTNET_SANITIZE_LEAKS:-asan}
tc=${RUSTNET_ASAN_TOOLCHAIN:-nightly}
logs=$(mktemp -d /tmp/rustnet-sanitize.XXXXXX)
host=$(rustc -vV | awk '/^host:/{print $2}')
fail=0

asan() {
  echo "== sanitize: AddressSanitizer (nightly, -Zsanitizer=address, target/asan)"
  if ! rustup run "$tc" rustc -V >/dev/null 2>&1; then
    echo "toolchain $tc missing: rustup toolchain install $tc --profile minimal"
    # judged by the result, not rustup's exit code (its self-update check
    # may fail after a good install)
    timeout 600 rustup toolchain install "$tc" --profile minimal --no-self-update >"$logs/rustup.log" 2>&1 || true
    if ! rustup run "$tc" rustc -V >/dev/null 2>&1; then
      echo "!! SKIPPED: ASan: the toolchain $tc cannot be installed here ($(tail -n 1 "$logs/rustup.log")); valgrind still runs"
      return 0
    fi
  fi
  local t0=$SECONDS
  # --target keeps RUSTFLAGS off build scripts and proc macros (bindgen);
  # --export-dynamic: the ASan runtime is linked into the test executable
  # only, and the dlopen'ed ASan .so resolves __asan_* from it.
  export RUSTFLAGS="-Zsanitizer=address -Clink-arg=-Wl,--export-dynamic"
  export CARGO_TARGET_DIR=target/asan
  cargo "+$tc" test --release --target "$host" --test conformance --test fuzz_calls --no-run --quiet
  echo "built in $((SECONDS - t0)) s"
  mkdir -p "$logs/asan"
  # every process (the peers inherit it) writes its report to a file:
  # a report from a peer that was killed after DONE is not lost
  local lsan=1
  [ "$leaks" = 0 ] && lsan=0
  export ASAN_OPTIONS="log_path=$logs/asan/asan:detect_leaks=$lsan:halt_on_error=1:detect_stack_use_after_return=1"
  export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
  local rc=0
  # The *_flat cases measure RSS over hundreds of cycles: ASan's quarantine
  # holds freed memory by design, so they would fail on the sanitizer, not
  # on the plugin (they run uninstrumented in the main suite).
  # Every load_unload_* case (stats dir, TCP helper) bounds RSS over hundreds
  # of load/unload cycles the same way (reload_many's RSS check).
  echo "(skipped under ASan: *_flat and load_unload_* cases, RSS flatness; they run in the main suite)"
  cargo "+$tc" test --release --target "$host" --test conformance -- --skip _flat --skip load_unload_ 2>&1 | tail -n 25 || rc=1
  RUSTNET_FUZZ_CALLS_SECS=${RUSTNET_SANITIZE_FUZZ_SECS:-15} \
    cargo "+$tc" test --release --target "$host" --test fuzz_calls 2>&1 | tail -n 6 || rc=1
  unset RUSTFLAGS CARGO_TARGET_DIR ASAN_OPTIONS LSAN_OPTIONS
  if ls "$logs"/asan/asan.* >/dev/null 2>&1; then
    for f in "$logs"/asan/asan.*; do
      echo "---- $f"
      head -n 60 "$f"
    done
    echo "FAIL: AddressSanitizer reported errors (above)"
    rc=1
  fi
  echo "ASan: $([ $rc = 0 ] && echo clean || echo FAILED) in $((SECONDS - t0)) s (leak check: $([ $lsan = 1 ] && echo on || echo off))"
  [ $rc = 0 ] || fail=1
}

valgrind_memcheck() {
  echo "== sanitize: valgrind memcheck"
  if ! command -v valgrind >/dev/null; then
    echo "valgrind missing: apt-get install valgrind"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    $sudo apt-get install -y -qq valgrind >"$logs/apt.log" 2>&1 ||
      { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq valgrind >"$logs/apt.log" 2>&1; } ||
      { echo "FAIL: valgrind cannot be installed: $(tail -n 1 "$logs/apt.log")"; fail=1; return 0; }
  fi
  local t0=$SECONDS
  cargo build --release --quiet
  local exe
  exe=$(cargo test --release --test conformance --no-run --message-format=json 2>/dev/null |
    python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="conformance": print(m["executable"])')
  mkdir -p "$logs/vg"
  local lk=no
  [ "$leaks" = 1 ] && lk=full
  # Every case but the bulk-traffic ones (200 MB each, minutes under
  # valgrind): traffic_v8 with one cycle stands for them. The peers are the
  # same executable, traced (--trace-children); `ip netns exec` and shells
  # are not valgrind's business.
  local rc=0
  RUSTNET_CONF_CYCLES=1 timeout 900 valgrind -q --trace-children=yes --trace-children-skip='*/ip,*/sh,*/bash' \
    --error-exitcode=99 --leak-check=$lk --errors-for-leak-kinds=definite \
    --suppressions=tests/valgrind.supp --log-file="$logs/vg/vg.%p" \
    "$exe" traffic_v8 grouped vdevice peer_killed garbage invalid_env injected_panic null_stale dlclose \
    handle_kinds panic_mid link_cut ipv6 2>&1 |
    grep -E '^test |^test result' || rc=1
  # a peer killed after DONE never prints its summary: look for the error
  # records themselves in every process's log
  if grep -lE '^==[0-9]+== (Invalid (read|write|free)|Conditional jump|Use of uninitialised|Syscall param|Mismatched free|Source and destination overlap|Argument .* of function|Process terminating)|ERROR SUMMARY: [1-9]' "$logs"/vg/vg.* >/dev/null 2>&1; then
    for f in $(grep -lE '^==[0-9]+== (Invalid|Conditional|Use of|Syscall|Mismatched|Source and|Argument|Process terminating)|ERROR SUMMARY: [1-9]' "$logs"/vg/vg.*); do
      echo "---- $f"
      head -n 60 "$f"
    done
    echo "FAIL: valgrind memcheck reported errors (above)"
    rc=1
  fi
  echo "valgrind: $([ $rc = 0 ] && echo clean || echo FAILED) in $((SECONDS - t0)) s over $(ls "$logs"/vg | wc -l) processes (leak check: $lk)"
  [ $rc = 0 ] || fail=1
}

case $which in
  asan) asan ;;
  valgrind) valgrind_memcheck ;;
  all) asan; valgrind_memcheck ;;
  *) echo "RUSTNET_SANITIZE=$which: asan, valgrind or all"; exit 2 ;;
esac
if [ $fail = 0 ]; then rm -rf "$logs"; else echo "logs kept in $logs"; fi
exit $fail
