#!/usr/bin/env bash
# One run on a GPU machine (no Rust, no network, no RDMA NIC needed). All
# ranks share one GPU, so CUDA MPS must serve them: without it their kernels
# time-slice the GPU and both networks read the same busbw (the scheduler's
# pace, not the network's). Steps:
#   0. MPS: a private control daemon (own pipe/log dirs) is started and must
#      answer; it is stopped on every exit (trap). No MPS, no verdict (exit 4).
#   1. preflight: GPU, the nccl-tests kit (or torch), the plugin file opens
#      and exports "rustnet"
#   2. with an nccl-tests kit (.gpu/nccl-kit in the repo, or --kit DIR):
#      all_reduce_perf and sendrecv_perf at 2, 4, 8 ranks, the plugin and
#      NCCL's Socket interleaved, 3 repeats, median and range per size;
#      all_gather_perf and alltoall_perf once at 8 ranks (ncclharness/kitbench.py)
#      without a kit (or --torch): the torch sweep (2 ranks) and the DDP check
#   3. MPS evidence: the MPS logs must show a server and the ranks as clients
#   4. verdict: median busbw plugin >= Socket at every size >= 1 MiB
# Everything (tables, CSV, plot, logs) goes to $OUT (default ./out/gpu-check).
# The whole run stays under GPU_CHECK_BUDGET_S (default 500 s): each step
# gets a share of what is left and a hard timeout.
#
# usage: gpu-check.sh [--plugin-dir DIR] [--kit DIR | --torch] [--quick]
#                     [--ranks 2,4,8] [--repeats N] [--no-extras] [--env K=V]...
#                     [--kitbench "ARGS"] [--no-mps] [--out DIR] [--bundle DIR]
#   DIR holds librustnet.so (make-gpu-kit.sh: out/gpu-kit). Default: the kit
#   this script sits in, else <repo>/out/gpu-kit, else <repo>/target/release.
#   --kit DIR: the nccl-tests kit (default <repo>/.gpu/nccl-kit if present).
#   --torch: the torch sweep even if a kit is present.
#   --quick: smaller sizes (kit: 1M..4M, no extras; torch: up to 64 MiB,
#            fewer DDP steps): a smoke test.
#   --ranks/--repeats/--no-extras: a part of the kit plan (e.g. a rerun).
#   --env K=V: a variable for both networks (e.g. NCCL_NSOCKS_PERTHREAD=4).
#   --kitbench "ARGS": more options for ncclharness/kitbench.py (e.g. "-n 5 -e 16M");
#            python3 -m ncclharness.kitbench --help lists them.
#   --no-mps: run without MPS (drop-in and data checks only): no verdict.
#   --out DIR: where everything goes (default $OUT, else ./out/gpu-check).
#   --bundle DIR: at the end (also after a failure or interrupt) put the
#            main files flat into DIR plus everything as gpu-check-all.tgz
#            (the device tool returns at most 8 files, 2 folders down).
# env: PYTHON (default: the first of python3, python, python3.12 that imports
#      torch), GPU_CHECK_BUDGET_S (default 500), RUSTNET_TRANSPORT for the
#      plugin run (default socket: the TCP transport), OUT,
#      GPU_CHECK_MPS_WAIT_S (default 12: how long the new MPS daemon may take to answer).
# exit: 0 all proven and goal met; 1 goal not met; 2 a failure, refusal or
#       incomplete result; 3 torch/GPU/kit libraries missing; 4 no verdict:
#       MPS could not be started or did not serve the ranks.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-500}
DEADLINE=$((T0 + BUDGET))
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else   # the first python that has torch
  PY=python3
  for c in python3 python python3.12; do
    if command -v "$c" >/dev/null && "$c" -c 'import torch' 2>/dev/null; then PY=$c; break; fi
  done
fi
TRANSPORT=${RUSTNET_TRANSPORT:-socket}
PLUGIN=""
KIT=""
KIT_ASKED=0
FORCE_TORCH=0
QUICK=0
USE_MPS=1
RANKS=""
REPEATS=""
NO_EXTRAS=0
BUNDLE=""
OUT_ARG=""
EXTRA_ENV=()
KITBENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --plugin-dir) PLUGIN=$2; shift 2 ;;
    --kit) KIT=$2; KIT_ASKED=1; shift 2 ;;
    --torch) FORCE_TORCH=1; shift ;;
    --quick) QUICK=1; shift ;;
    --ranks) RANKS=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --no-extras) NO_EXTRAS=1; shift ;;
    --env) EXTRA_ENV+=("--env" "$2"); shift 2 ;;
    --kitbench) read -r -a more <<< "$2"; KITBENCH_ARGS+=("${more[@]}"); shift 2 ;;
    --no-mps) USE_MPS=0; shift ;;
    --bundle) BUNDLE=$2; shift 2 ;;
    --out) OUT_ARG=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT_ARG:-${OUT:-$PWD/out/gpu-check}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu-check.log") 2>&1
if [ -z "$PLUGIN" ]; then
  for d in "$HERE/.." "$HERE/../out/gpu-kit" "$HERE/../target/release"; do
    if [ -f "$d/librustnet.so" ] || [ -f "$d/libnccl-net-rustnet.so" ]; then PLUGIN=$(cd "$d" && pwd); break; fi
  done
fi
if [ -n "$PLUGIN" ] && [ -e "$PLUGIN" ]; then   # absolute: later steps run from other folders
  PLUGIN=$(cd "$(dirname "$PLUGIN")" && pwd)/$(basename "$PLUGIN")
fi
if [ "$FORCE_TORCH" = 1 ]; then
  KIT=""
elif [ "$KIT_ASKED" = 0 ] && [ -d "$REPO/.gpu/nccl-kit" ]; then
  KIT="$REPO/.gpu/nccl-kit"
fi
MODE=torch
[ -n "$KIT" ] && MODE=kit
say() { printf '[%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
declare -A SECS RC
SECS[preflight]=0; SECS[bench]=0; SECS[ddp]=0; RC[bench]=2; RC[ddp]=0

# ---- 0. MPS (a private daemon; stopped on every exit)
MPS_DIR=""
MPS_STARTED=0
CHILD=""
mpsctl() {  # mpsctl SECONDS COMMAND: one command to our daemon, bounded in time
  echo "$2" | timeout -k 2 "$1" nvidia-cuda-mps-control
}
mps_pids_of() {  # the MPS processes that serve pipe dir $1 (found by their environment)
  local p
  for p in /proc/[0-9]*; do
    case "$(cat "$p/comm" 2>/dev/null)" in nvidia-cuda-mps*) ;; *) continue ;; esac
    if tr '\0' '\n' 2>/dev/null < "$p/environ" | grep -qxF "CUDA_MPS_PIPE_DIRECTORY=$1"; then
      echo "${p#/proc/}"
    fi
  done
}
mps_stop_dir() {  # mps_stop_dir PIPE_DIR: quit that daemon; kill it if it does not go
  local pipe=$1 pids
  CUDA_MPS_PIPE_DIRECTORY=$pipe mpsctl 5 quit >/dev/null 2>&1
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(mps_pids_of "$pipe")
    [ -z "$pids" ] && return 0
    sleep 0.5
  done
  say "MPS: the daemon of $pipe did not quit; ending pid(s) $pids"
  # shellcheck disable=SC2086  # a list of pids
  kill -TERM $pids 2>/dev/null; sleep 1
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null
  return 0
}
# shellcheck disable=SC2317  # called through the trap
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
    kill -TERM "$CHILD" 2>/dev/null   # the harness ends its rank processes on TERM
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$CHILD" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$CHILD" 2>/dev/null
  fi
  if [ "$MPS_STARTED" = 1 ]; then
    mps_stop_dir "$CUDA_MPS_PIPE_DIRECTORY"
    mkdir -p "$OUT/mps"
    cp -r "$CUDA_MPS_LOG_DIRECTORY/." "$OUT/mps/" 2>/dev/null
    say "MPS: stopped (logs in $OUT/mps/)"
  fi
  [ -n "$MPS_DIR" ] && rm -rf "$MPS_DIR"
  [ -n "$BUNDLE" ] && bundle "$BUNDLE"
  exit "$rc"
}
# shellcheck disable=SC2317  # called from cleanup
bundle() {  # bundle DIR: the main files flat in DIR (7 at most) + one archive of everything
  local dir=$1 f
  mkdir -p "$dir" || return 0
  for f in summary.txt gpu-check.log nccl-tests/report.txt nccl-tests/summary.csv nccl-tests/runs.csv \
           nccl-tests/busbw.svg sweep/report.txt sweep/busbw.svg ddp/ddp-report.txt; do
    [ -f "$OUT/$f" ] && cp "$OUT/$f" "$dir/$(echo "$f" | tr '/' '-')"
  done
  tar czf "$dir/gpu-check-all.tgz" -C "$OUT" --exclude=plugin-lib . 2>/dev/null
  say "bundle: $(find "$dir" -maxdepth 1 -type f | wc -l) files in $dir"
}
# Rank processes of an earlier run that was killed (SIGKILL skips the trap;
# the harness starts each run in its own session) would hold the GPU: every
# process this script starts carries RUSTNET_GPU_CHECK_RUN in its environment.
# A run still going (its gpu-check.sh alive: another checkout's tests, say) is left alone.
end_leftover_ranks() {
  local p pids="" mark owner
  for p in /proc/[0-9]*; do
    [ -O "$p" ] || continue
    case "$(cat "$p/comm" 2>/dev/null)" in nvidia-cuda-mps*) continue ;; esac   # MPS: stopped by quit
    mark=$(tr '\0' '\n' 2>/dev/null < "$p/environ" | sed -n 's/^RUSTNET_GPU_CHECK_RUN=//p')
    [ -n "$mark" ] || continue
    owner=${mark%%-*}
    if [ "$owner" -gt 0 ] 2>/dev/null && kill -0 "$owner" 2>/dev/null; then continue; fi
    pids="$pids ${p#/proc/}"
  done
  [ -z "$pids" ] && return 0
  say "ending processes left by an earlier killed run:$pids"
  # shellcheck disable=SC2086  # a list of pids
  kill -KILL $pids 2>/dev/null
  sleep 1
}
trap cleanup EXIT
trap 'say "interrupted"; exit 2' INT TERM HUP
# Run a step in the background and wait for it, so that a TERM to this
# script runs the trap at once (bash defers traps while a foreground child runs).
step() { "$@" & CHILD=$!; wait "$CHILD"; local rc=$?; CHILD=""; return "$rc"; }

no_verdict() { say "NO VERDICT: $*"; say "exit 4 (MPS missing: the one-GPU numbers would measure the GPU scheduler)"; exit 4; }

end_leftover_ranks
export RUSTNET_GPU_CHECK_RUN="$$-$T0"
say "gpu-check: mode=$MODE out=$OUT budget=${BUDGET}s plugin=${PLUGIN:-<none>} kit=${KIT:-<none>} transport=$TRANSPORT quick=$QUICK mps=$USE_MPS python=$PY"
[ -n "$PLUGIN" ] || { say "FAIL: no librustnet.so found; run make-gpu-kit.sh first or pass --plugin-dir"; exit 2; }
[ -f "$PLUGIN/BUILD-INFO" ] && sed 's/^/  build: /' "$PLUGIN/BUILD-INFO"
if [ "$KIT_ASKED" = 1 ] && [ "$FORCE_TORCH" = 0 ] && [ ! -d "$KIT" ]; then
  say "FAIL: --kit $KIT is not a folder"; exit 2
fi

if [ "$USE_MPS" = 1 ]; then
  command -v nvidia-cuda-mps-control >/dev/null || no_verdict "nvidia-cuda-mps-control is not on PATH (PATH=$PATH)"
  # Leftovers of an earlier run of this script that was killed (SIGKILL skips the trap).
  for d in /tmp/rustnet-mps.*; do
    if [ ! -d "$d/pipe" ] || [ ! -O "$d" ]; then continue; fi
    owner=$(cat "$d/owner" 2>/dev/null)
    if [ -n "$owner" ] && kill -0 "$owner" 2>/dev/null; then continue; fi   # its run is still going
    say "MPS: stopping a leftover daemon of an earlier run ($d)"
    mps_stop_dir "$d/pipe"; rm -rf "$d"
  done
  [ -S /tmp/nvidia-mps/control ] && say "MPS: note: a system daemon also runs (/tmp/nvidia-mps); ours is separate"
  # Short path: the pipe dir holds unix sockets (108-byte limit).
  MPS_DIR=$(mktemp -d /tmp/rustnet-mps.XXXXXX)
  echo $$ > "$MPS_DIR/owner"
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  MPS_STARTED=1   # from here on the trap stops it, even if -d only half worked
  # Without the run marker: the daemon is stopped by quit, not by end_leftover_ranks.
  # Its output goes to a file, not $(...): a daemon that kept the pipe open
  # would make the substitution wait for it.
  if ! env -u RUSTNET_GPU_CHECK_RUN timeout -k 2 20 nvidia-cuda-mps-control -d >"$MPS_DIR/start.out" 2>&1; then
    no_verdict "nvidia-cuda-mps-control -d failed: $(head -c 500 "$MPS_DIR/start.out")"
  fi
  ok=0
  wait_until=$(( $(date +%s) + ${GPU_CHECK_MPS_WAIT_S:-12} ))
  while [ "$(date +%s)" -lt "$wait_until" ]; do
    if mpsctl "$(min 5 "${GPU_CHECK_MPS_WAIT_S:-12}")" get_server_list >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.5
  done
  [ $ok = 1 ] || no_verdict "the MPS control daemon started but does not answer (get_server_list); see $CUDA_MPS_LOG_DIRECTORY/control.log"
  say "MPS: control daemon up (pipe $CUDA_MPS_PIPE_DIRECTORY, log $CUDA_MPS_LOG_DIRECTORY)"
else
  say "WARNING: --no-mps: the ranks will time-slice the GPU; numbers are printed but there is NO VERDICT"
fi

# ---- 1. preflight
s=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_mode \
  --format=csv,noheader | sed 's/^/  gpu: /'
if [ "$MODE" = kit ]; then
  KIT=$(cd "$KIT" && pwd)
  for f in "$KIT"/bin/* "$KIT"/mpi/bin/* "$KIT"/*.sh; do
    [ -e "$f" ] && [ ! -x "$f" ] && chmod u+x "$f" 2>/dev/null
  done
  export NCCL_KIT=$KIT NCCL_KIT_PYTHON=$PY
  # shellcheck disable=SC1091  # the kit's own env.sh (PATH: its mpiexec; LD_LIBRARY_PATH: libnccl)
  . "$KIT/env.sh" || { say "FAIL: sourcing $KIT/env.sh failed"; exit 3; }
  missing=$(ldd "$KIT/bin/all_reduce_perf" 2>&1 | grep 'not found')
  if [ -n "$missing" ]; then
    say "FAIL: the kit's binaries miss libraries here (set NCCL_LIB_DIR for libnccl.so.2):"; echo "$missing"; exit 3
  fi
  say "kit: $KIT, mpiexec $(command -v mpiexec)"
else
  timeout -k 5 60 "$PY" - <<'PYEOF'
import sys
try:
    import torch
except ImportError:
    print("FAIL: torch is not importable by " + sys.executable); sys.exit(3)
ok = torch.cuda.is_available()
nccl = ".".join(map(str, torch.cuda.nccl.version())) if ok else "?"
print(f"  python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"NCCL {nccl}, cuda available: {ok}, devices: {torch.cuda.device_count() if ok else 0}")
if ok:
    print(f"  device 0: {torch.cuda.get_device_name(0)}")
sys.exit(0 if ok and torch.distributed.is_nccl_available() else 3)
PYEOF
  rc=$?
  [ $rc -eq 0 ] || { say "FAIL: no usable torch+CUDA+NCCL (rc $rc)"; exit 3; }
fi
(cd "$HERE" && timeout -k 5 30 "$PY" -m ncclharness.pluginprobe "$PLUGIN") | sed 's/^/  /'
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "FAIL: the plugin does not load here"; exit 2; }
SECS[preflight]=$(( $(date +%s) - s ))

# ---- 2. the measurement
if [ "$MODE" = kit ]; then
  args=(--kit "$KIT" --plugin-dir "$PLUGIN" --out "$OUT/nccl-tests" --rustnet-transport "$TRANSPORT")
  [ $QUICK = 1 ] && args+=(-b 1M -e 4M -n 5 -w 1 --extras none)
  [ -n "$RANKS" ] && args+=(--ranks "$RANKS")
  [ -n "$REPEATS" ] && args+=(--repeats "$REPEATS")
  [ $NO_EXTRAS = 1 ] && args+=(--extras none)
  args+=("${EXTRA_ENV[@]}" "${KITBENCH_ARGS[@]}")
  bench_budget=$(( $(left) - 30 ))
  if [ "$bench_budget" -lt 20 ]; then say "FAIL: not enough time left for the nccl-tests runs"; exit 2; fi
  say "nccl-tests from the kit: ${bench_budget}s for all runs (hard limit $(( bench_budget + 15 ))s)"
  s=$(date +%s)
  cd "$HERE" || exit 2   # python -m ncclharness.* runs from the harness folder
  step timeout -k 10 $(( bench_budget + 15 )) "$PY" -m ncclharness.kitbench "${args[@]}" --budget "$bench_budget"
  RC[bench]=$?
  cd - >/dev/null || exit 2
  SECS[bench]=$(( $(date +%s) - s ))
else
  if [ $QUICK = 1 ]; then MAXSIZE=64M; STEPS=10; else MAXSIZE=1G; STEPS=30; fi
  # Reserve ~150 s for DDP (3 short runs) and the summary; the rest is the two
  # sweep runs. Each sweep run: ~20-30 s of python/torch start-up and NCCL init,
  # then the sweep loop, which skips larger sizes once its budget is spent.
  per_net=$(min 170 $(( ($(left) - 150) / 2 )))
  sweep_budget=$(( per_net - 50 ))
  if [ "$sweep_budget" -lt 30 ]; then say "FAIL: not enough time left for the sweep"; exit 2; fi
  say "torch sweep: 2 ranks on GPU 0, 1K..$MAXSIZE, per network ${per_net}s hard limit, ${sweep_budget}s sweep budget"
  s=$(date +%s)
  step timeout -k 10 $(( 2 * per_net + 30 )) "$PY" "$HERE/torch_sweep.py" --plugin-dir "$PLUGIN" --nranks 2 \
    --rustnet-transport "$TRANSPORT" --min-size 1K --max-size "$MAXSIZE" "${EXTRA_ENV[@]}" \
    --target-time 0.15 --budget "$sweep_budget" --timeout "$per_net" --out "$OUT/sweep"
  RC[bench]=$?
  SECS[bench]=$(( $(date +%s) - s ))
  per_run=$(min 90 $(( ($(left) - 25) / 3 )))
  if [ "$per_run" -lt 30 ]; then
    say "SKIPPED: DDP check (only $(left)s left)"; RC[ddp]=2; SECS[ddp]=0
  else
    say "DDP check: 2 ranks, $STEPS steps, ${per_run}s per run"
    s=$(date +%s)
    step timeout -k 10 $(( 3 * per_run + 20 )) "$PY" "$HERE/ddp_check.py" --plugin-dir "$PLUGIN" --nranks 2 \
      --rustnet-transport "$TRANSPORT" --steps "$STEPS" --timeout "$per_run" --out "$OUT/ddp"
    RC[ddp]=$?
    SECS[ddp]=$(( $(date +%s) - s ))
  fi
fi

# ---- 3. MPS evidence: the ranks must have been MPS clients
MPS_OK=0
MPS_LINE="MPS: off (--no-mps)"
if [ "$USE_MPS" = 1 ]; then
  servers=$(mpsctl 5 get_server_list 2>/dev/null | tr '\n' ' ')
  if MPS_LINE=$(cd "$HERE" && timeout -k 2 20 "$PY" -m ncclharness.mps evidence "$CUDA_MPS_LOG_DIRECTORY" \
                --server-list "$servers"); then
    MPS_OK=1
  fi
fi

# ---- 4. summary
{
  echo "== gpu-check summary ($(date -u +%FT%TZ), $(( $(date +%s) - T0 ))s total, mode $MODE)"
  echo "timings: preflight ${SECS[preflight]}s, measurement ${SECS[bench]}s (rc ${RC[bench]})" \
       "$([ "$MODE" = torch ] && echo ", ddp ${SECS[ddp]}s (rc ${RC[ddp]})")"
  echo "$MPS_LINE"
  if [ "$MODE" = kit ]; then
    rep="$OUT/nccl-tests/report.txt"
    if [ -f "$rep" ]; then
      awk '/^median busbw ratio/{on=1} on&&/^$/{exit} on' "$rep"
      grep -E '^(runs:|MPS:|GOAL|A/B RUN|STRETCH|PARTIAL|  below|  incomplete|  lowest|  failed|  timeout|  skipped)' "$rep"
    else
      echo "nccl-tests: no report (see $OUT/gpu-check.log)"
    fi
    echo "files: $OUT/nccl-tests/{report.txt,summary.csv,results.csv,runs.csv,busbw.svg} logs in nccl-tests/logs, MPS logs in mps/"
  else
    if [ -f "$OUT/sweep/report.txt" ]; then
      awk '/^busbw ratio/{on=1} on&&/^$/{exit} on' "$OUT/sweep/report.txt"
      grep -E '^(rustnet|Socket): |^GOAL|^  below|^  missing|^  lowest' "$OUT/sweep/report.txt"
    else
      echo "sweep: no report (see $OUT/gpu-check.log)"
    fi
    [ -f "$OUT/ddp/ddp-report.txt" ] && grep -E 'DDP CHECK|rustnet vs Socket|^!!|^  - ' "$OUT/ddp/ddp-report.txt" | head -12
    echo "files: $OUT/sweep/{report.txt,comparison.csv,results.csv,busbw.svg} $OUT/ddp/{ddp-report.txt,losses.csv} logs in */logs"
  fi
  if [ "$MPS_OK" != 1 ]; then
    echo "NO VERDICT: MPS did not serve the ranks (or was off), so the busbw above measures the GPU scheduler; exit 4"
  fi
} | tee "$OUT/summary.txt"
[ "$MPS_OK" = 1 ] || exit 4
if [ "${RC[bench]}" -ge 2 ] || [ "${RC[ddp]}" -ne 0 ]; then exit 2; fi
exit "${RC[bench]}"
