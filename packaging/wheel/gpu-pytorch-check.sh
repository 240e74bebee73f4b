#!/bin/bash
# The PyTorch flow of docs/pytorch-ddp.md ("Installing with pip"), for a
# machine with a GPU and PyTorch: a venv that sees the system's torch, the
# wheel installed into it, NCCL_NET_PLUGIN from `python -m librustnet
# plugin-path` (NCCL 2.21+; older NCCL: `env --legacy`), two DDP ranks on GPU 0
# under torchrun (nccl-tests-harness/ddp_check.py --worker --one-gpu), then the
# ranks' NCCL logs must show the plugin loaded from the venv and used.
#   packaging/wheel/gpu-pytorch-check.sh [WHEEL] [OUTDIR]
# Without torch or a GPU it says SKIPPED and why, and exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHL=$(readlink -f "${1:-$(ls out/pkg/librustnet-*.whl | head -n 1)}")
OUT=$(mkdir -p "${2:-out/ddp-wheel}" && readlink -f "${2:-out/ddp-wheel}")
python3 -c 'import torch' 2>/dev/null || { echo "SKIPPED: PyTorch is not installed for $(command -v python3)"; exit 0; }
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || { echo "SKIPPED: no CUDA GPU visible to PyTorch"; exit 0; }
NCCLV=$(python3 -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))')
echo "torch $(python3 -c 'import torch; print(torch.__version__)'), NCCL $NCCLV, $(nvidia-smi -L 2>/dev/null | head -n 1)"
V=$(mktemp -d /tmp/rustnet-torch-venv.XXXXXX)
trap 'rm -rf "$V"' EXIT
python3 -m venv "$V"
PY="$V/bin/python"
# torch may itself live in a venv (--system-site-packages would not see it):
# a .pth file makes its site-packages visible to the new venv.
python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
  > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/system-torch.pth"
"$V/bin/pip" install -q --no-index --disable-pip-version-check "$WHL"
if python3 -c "import sys; sys.exit(0 if tuple(map(int, '$NCCLV'.split('.')[:2])) >= (2, 21) else 1)"; then
  NCCL_NET_PLUGIN=$("$PY" -m librustnet plugin-path)
  export NCCL_NET_PLUGIN
else
  eval "$("$PY" -m librustnet env --legacy | grep -E '^export (LD_LIBRARY_PATH|NCCL_NET_PLUGIN)=')"
fi
echo "NCCL_NET_PLUGIN=$NCCL_NET_PLUGIN"
export NCCL_NET=rustnet RUSTNET_TRANSPORT=socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo
export NCCL_MNNVL_ENABLE=0 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
rm -rf "$OUT/logs"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 nccl-tests-harness/ddp_check.py \
  --worker --one-gpu --net plugin --result "$OUT/ddp-plugin.json"
fail=0
for log in "$OUT"/logs/*.nccl.log; do
  echo "-- $(basename "$log")"
  grep -hE 'NET/Plugin|Using network|NET/rustnet : using|via NET/' "$log" | head -n 4 | sed 's/^/  /'
  grep -q 'Using network rustnet' "$log" || { echo "  FAIL: this rank did not use the plugin"; fail=1; }
  if grep -qE 'Using network (Socket|IB)' "$log"; then echo "  FAIL: NCCL's own network in use"; fail=1; fi
done
ls "$OUT"/logs/*.nccl.log >/dev/null 2>&1 || { echo "FAIL: no NCCL logs"; exit 1; }
[ $fail = 0 ] && echo "PyTorch DDP through the wheel's plugin: PASSED" || { echo "PyTorch DDP through the wheel's plugin: FAILED"; exit 1; }
