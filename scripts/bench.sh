#!/bin/bash
# The main job on a machine without RDMA: build the plugin and run the
# two-process benchmark through it over loopback, beside raw TCP.
# Extra arguments go to `rustnet bench` (see `rustnet bench --help`).
#   scripts/bench.sh                 one-way/bidirectional/latency -> out/bench.csv
#   scripts/bench.sh step [opts]     NCCL's pattern, 2 ranks       -> out/step.{csv,svg}
#   scripts/bench.sh ring [opts]     N ranks in a ring (2,4,8)     -> out/ring.{csv,svg}
# (step/ring: docs/tcp-performance.md)
set -eu
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --release --quiet
mkdir -p out
case "${1:-}" in
  step|ring)
    mode=$1
    shift
    exec target/release/rustnet bench "$mode" --csv "out/$mode.csv" --svg "out/$mode.svg" "$@"
    ;;
esac
exec target/release/rustnet bench --csv out/bench.csv "$@"
