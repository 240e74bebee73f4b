#!/usr/bin/env bash
# Build the release plugin here and stage what gpu-check.sh needs into a
# kit folder (default out/gpu-kit, git-ignored):
#   librustnet.so   the plugin (gpu-check.sh gives it NCCL's file name)
#   BUILD-INFO      commit, dirty files, sha256, exports, needed libs, glibc
#   nccl-tests-harness/   a copy of the harness, so the kit also works alone
# Then, with the device tool:  command "bash nccl-tests-harness/gpu-check.sh",
# carry ["out/gpu-kit"]  (or copy the kit anywhere and run
# bash <kit>/nccl-tests-harness/gpu-check.sh).
#   --nccl-kit SRC  also copy the prebuilt nccl-tests kit (e.g.
#                   ../shared/gpu/nccl-kit) to .gpu/nccl-kit (git-ignored),
#                   where gpu-check.sh finds it; then carry [".gpu", "out/gpu-kit"].
set -eu
cd "$(dirname "$0")/.."
NCCL_KIT_SRC=""
if [ "${1:-}" = --nccl-kit ]; then NCCL_KIT_SRC=$2; shift 2; fi
KIT=${1:-out/gpu-kit}
if [ -n "$NCCL_KIT_SRC" ]; then
  [ -x "$NCCL_KIT_SRC/bin/all_reduce_perf" ] || { echo "make-gpu-kit.sh: no nccl-kit at $NCCL_KIT_SRC" >&2; exit 2; }
  rm -rf .gpu/nccl-kit
  mkdir -p .gpu
  cp -a "$NCCL_KIT_SRC" .gpu/nccl-kit
  chmod -R u+w .gpu/nccl-kit   # the shared copy is read-only; a later rm -rf must work
  echo "nccl-kit: .gpu/nccl-kit ($(du -sh .gpu/nccl-kit | cut -f1))"
fi
cargo build --release --quiet
rm -rf "$KIT"
mkdir -p "$KIT/nccl-tests-harness"
cp target/release/librustnet.so "$KIT/"
cp -r nccl-tests-harness/ncclharness nccl-tests-harness/*.py nccl-tests-harness/*.sh nccl-tests-harness/README.md \
  "$KIT/nccl-tests-harness/"
find "$KIT" -name __pycache__ -prune -exec rm -rf {} +
so="$KIT/librustnet.so"
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "uncommitted changes: $(git status --porcelain 2>/dev/null | grep -vc '^??' || true) tracked file(s)"
  echo "built: $(date -u +%FT%TZ) on $(uname -srm), $(ldd --version 2>/dev/null | head -1)"
  echo "sha256: $(sha256sum "$so" | cut -d' ' -f1)  size: $(stat -c %s "$so")"
  echo "exports: $(nm -D --defined-only "$so" | awk '/ncclNetPlugin/{print $3}' | sort | tr '\n' ' ')"
  echo "needs: $(readelf -d "$so" | awk '/NEEDED/{print $5}' | tr -d '[]' | tr '\n' ' ')"
  echo "newest glibc symbol: $(objdump -T "$so" | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)"
} > "$KIT/BUILD-INFO"
cat "$KIT/BUILD-INFO"
echo "kit: $KIT ($(du -sh "$KIT" | cut -f1)); run on the GPU machine: bash nccl-tests-harness/gpu-check.sh (carry $KIT)"
