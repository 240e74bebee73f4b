#!/usr/bin/env bash
# One run on a GPU machine (no Rust, no network, no RDMA NIC needed):
#   1. preflight: GPU, torch, NCCL, and the plugin file opens and exports "rustnet"
#   2. torch sweep, 2 ranks on one GPU, through the plugin's TCP transport and
#      through NCCL's built-in socket transport (each proven from NCCL's log)
#   3. DDP check both ways, losses compared step by step (+ a reference)
#   4. verdict on the goal: busbw through the plugin >= built-in socket at
#      every size >= 1 MiB
# Everything (table, plot, CSV, logs) goes to $OUT (default ./out/gpu-check).
# Whole run kept under 8 minutes: each step gets a share of what is left and
# a hard timeout.
#
# usage: gpu-check.sh [--plugin-dir DIR] [--quick]
#   DIR holds librustnet.so (made by make-gpu-kit.sh: out/gpu-kit). Default:
#   the kit this script sits in, else <repo>/out/gpu-kit, else target/release.
#   --quick: sizes up to 64 MiB, fewer DDP steps (a smoke test, ~3 min).
# env: PYTHON (default: the first of python3, python, python3.12 that imports
#      torch), GPU_CHECK_BUDGET_S (default 450),
#      RUSTNET_TRANSPORT for the plugin run (default socket: the TCP transport).
# exit: 0 all proven and goal met; 1 goal not met; 2 a failure or refusal;
#       3 torch/GPU missing.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-450}
DEADLINE=$((T0 + BUDGET))
OUT=${OUT:-$PWD/out/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
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
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --plugin-dir) PLUGIN=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$PLUGIN" ]; then
  for d in "$HERE/.." "$HERE/../out/gpu-kit" "$HERE/../target/release"; do
    if [ -f "$d/librustnet.so" ] || [ -f "$d/libnccl-net-rustnet.so" ]; then PLUGIN=$(cd "$d" && pwd); break; fi
  done
fi
say() { printf '[%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
declare -A SECS RC

say "gpu-check: out=$OUT budget=${BUDGET}s plugin=${PLUGIN:-<none>} transport=$TRANSPORT quick=$QUICK python=$PY"
[ -n "$PLUGIN" ] || { say "FAIL: no librustnet.so found; run make-gpu-kit.sh first or pass --plugin-dir"; exit 2; }
[ -f "$PLUGIN/BUILD-INFO" ] && sed 's/^/  build: /' "$PLUGIN/BUILD-INFO"

# ---- 1. preflight
s=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
  | sed 's/^/  gpu: /'
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
(cd "$HERE" && timeout -k 5 30 "$PY" -m ncclharness.pluginprobe "$PLUGIN") | sed 's/^/  /'
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "FAIL: the plugin does not load here"; exit 2; }
SECS[preflight]=$(( $(date +%s) - s ))

# ---- 2. sweep
if [ $QUICK = 1 ]; then MAXSIZE=64M; STEPS=10; else MAXSIZE=1G; STEPS=30; fi
# Reserve ~150 s for DDP (3 short runs) and the summary; the rest is the two
# sweep runs. Each sweep run: ~20-30 s of python/torch start-up and NCCL init,
# then the sweep loop, which skips larger sizes once its budget is spent.
per_net=$(min 170 $(( ($(left) - 150) / 2 )))
sweep_budget=$(( per_net - 50 ))
if [ "$sweep_budget" -lt 30 ]; then say "FAIL: not enough time left for the sweep"; exit 2; fi
say "torch sweep: 2 ranks on GPU 0, 1K..$MAXSIZE, per network ${per_net}s hard limit, ${sweep_budget}s sweep budget"
s=$(date +%s)
timeout -k 10 $(( 2 * per_net + 30 )) "$PY" "$HERE/torch_sweep.py" --plugin-dir "$PLUGIN" --nranks 2 \
  --rustnet-transport "$TRANSPORT" --min-size 1K --max-size "$MAXSIZE" \
  --target-time 0.15 --budget "$sweep_budget" --timeout "$per_net" --out "$OUT/sweep"
RC[sweep]=$?
SECS[sweep]=$(( $(date +%s) - s ))

# ---- 3. DDP
per_run=$(min 90 $(( ($(left) - 15) / 3 )))
if [ "$per_run" -lt 30 ]; then
  say "SKIPPED: DDP check (only $(left)s left)"; RC[ddp]=2; SECS[ddp]=0
else
  say "DDP check: 2 ranks, $STEPS steps, ${per_run}s per run"
  s=$(date +%s)
  timeout -k 10 $(( 3 * per_run + 20 )) "$PY" "$HERE/ddp_check.py" --plugin-dir "$PLUGIN" --nranks 2 \
    --rustnet-transport "$TRANSPORT" --steps "$STEPS" --timeout "$per_run" --out "$OUT/ddp"
  RC[ddp]=$?
  SECS[ddp]=$(( $(date +%s) - s ))
fi

# ---- 4. summary
{
  echo "== gpu-check summary ($(date -u +%FT%TZ), $(( $(date +%s) - T0 ))s total)"
  echo "timings: preflight ${SECS[preflight]}s, sweep ${SECS[sweep]}s (rc ${RC[sweep]}), ddp ${SECS[ddp]}s (rc ${RC[ddp]})"
  if [ -f "$OUT/sweep/report.txt" ]; then
    awk '/^busbw ratio/{on=1} on&&/^$/{exit} on' "$OUT/sweep/report.txt"
    grep -E '^(rustnet|Socket): |^GOAL|^  below|^  missing|^  lowest' "$OUT/sweep/report.txt"
  else
    echo "sweep: no report (see $OUT/gpu-check.log)"
  fi
  [ -f "$OUT/ddp/ddp-report.txt" ] && grep -E 'DDP CHECK|rustnet vs Socket|^!!|^  - ' "$OUT/ddp/ddp-report.txt" | head -12
  echo "files: $OUT/sweep/{report.txt,comparison.csv,results.csv,busbw.svg} $OUT/ddp/{ddp-report.txt,losses.csv} logs in */logs"
} | tee "$OUT/summary.txt"
if [ "${RC[sweep]}" -ge 2 ] || [ "${RC[ddp]}" -ne 0 ]; then exit 2; fi
exit "${RC[sweep]}"
