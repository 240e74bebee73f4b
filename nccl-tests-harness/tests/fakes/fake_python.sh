#!/bin/sh
# Stands in for the GPU machine's python in the gpu-check.sh test: the
# preflight (script on stdin) "finds" torch and a GPU; torch_sweep.py and
# ddp_check.py run for real but with fake_torch_worker.py as their ranks.
HERE=$(cd "$(dirname "$0")" && pwd)
case "$1" in
  -) cat >/dev/null; echo "  python (fake), torch (fake), NCCL (fake), cuda available: True"; exit 0 ;;
  */torch_sweep.py|*/ddp_check.py) exec "$REAL_PYTHON" "$HERE/run_with_fake_worker.py" "$@" ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
