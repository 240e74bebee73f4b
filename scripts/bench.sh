#!/bin/bash
# The main job on a machine without RDMA: build the plugin and run the
# two-process benchmark through it over loopback, beside raw TCP.
# Extra arguments go to `rustnet bench` (see `rustnet bench --help`).
set -eu
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --release --quiet
mkdir -p out
exec target/release/rustnet bench --csv out/bench.csv "$@"
