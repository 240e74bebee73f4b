#!/bin/bash
# The main job on a machine without RDMA: build the plugin and compare it, over
# loopback on this host, with what NCCL would use instead.
#   scripts/bench.sh [opts]          the comparison (rustnet bench compare --help):
#                                    NCCL's pattern beside nccl-socket(0 threads) at 32K-512K,
#                                    bandwidth 1M-64M beside a raw TCP stream (1 MiB writes),
#                                    8-byte latency beside a polling ping-pong -> out/bench.{csv,svg}
#   scripts/bench.sh --classic [opts] the older table: one-way/bidirectional/latency 1K-64M
#                                    beside a blocking socket (rustnet bench --help) -> out/bench-classic.csv
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
  --classic)
    shift
    exec target/release/rustnet bench --csv out/bench-classic.csv "$@"
    ;;
esac
exec target/release/rustnet bench compare --csv out/bench.csv --svg out/bench.svg "$@"
