"""Stands in for the rank processes of torch_sweep.py / ddp_check.py in the
tests (no torch, no GPU): reads the environment the harness gave the rank,
writes the NCCL log NCCL would write (network decided as NCCL would), and
rank 0 writes a result file shaped like the real one.

Knobs: FAKE_FALLBACK=1 (plugin silently not used), FAKE_SLOW_PLUGIN=1
(plugin busbw below Socket at 4 MiB), FAKE_DDP_DRIFT=1 (plugin losses drift
from step 5), FAKE_RC=n."""

import argparse
import json
import os
import socket
import sys
import time

from fake_perf import mps_connect   # same folder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--net")
    ap.add_argument("--result")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--steps", type=int)
    args, _rest = ap.parse_known_args()
    env = os.environ
    if args.reference:
        losses = [[2.3 - 0.01 * s - 0.001 * r for s in range(args.steps)] for r in range(args.nranks)]
        with open(args.result, "w") as f:
            json.dump({"kind": "ddp_reference", "world_size": args.nranks, "steps": args.steps,
                       "losses": losses, "digest": "abc"}, f)
        return 0
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    host, pid = socket.gethostname().split(".")[0], os.getpid()
    mps_connect(env, pid)   # a CUDA process finds MPS as in fake_perf.py
    plugin_ok = any(os.path.exists(os.path.join(d, "libnccl-net-rustnet.so"))
                    for d in env.get("LD_LIBRARY_PATH", "").split(":") if d)
    plugin = env.get("NCCL_NET_PLUGIN") == "rustnet" and plugin_ok and not env.get("FAKE_FALLBACK")
    net = "rustnet" if plugin else "Socket"
    p = f"{host}:{pid}:{pid} [0] NCCL INFO "
    lines = [p + f"NCCL_HOSTID set by environment to {env.get('NCCL_HOSTID')}",
             p + f"MASTER {env['MASTER_ADDR']}:{env['MASTER_PORT']} device {env.get('RUSTNET_HARNESS_DEVICE')}"]
    if plugin:
        lines.append(p + "NET/Plugin: Loaded net plugin rustnet (v10)")
    lines += [p + f"Using network {net}",
              p + f"Channel 00/0 : {rank}[0] -> {(rank + 1) % world}[0] [send] via NET/{net}/0",
              p + f"Channel 00/0 : {(rank - 1) % world}[0] -> {rank}[0] [receive] via NET/{net}/0"]
    with open(env["NCCL_DEBUG_FILE"], "w") as f:
        f.write("\n".join(lines) + "\n")
    if rank == 0:
        logdir = os.path.dirname(env["NCCL_DEBUG_FILE"])
        stem = os.path.basename(env["NCCL_DEBUG_FILE"]).split("-rank")[0]
        deadline = time.time() + 20
        while time.time() < deadline and sum(1 for n in os.listdir(logdir)
                                             if n.startswith(stem + "-rank") and n.endswith(".nccl.log")) < world:
            time.sleep(0.02)
        if args.steps is None:      # torch_sweep worker
            meas = []
            for i, size in enumerate((1 << 20, 2 << 20, 4 << 20)):
                bw = (2.2 if plugin else 2.0) + 0.1 * i
                if plugin and env.get("FAKE_SLOW_PLUGIN") and size == 4 << 20:
                    bw = 1.5
                meas.append({"source": "torch", "net": args.net, "network": net, "collective": "all_reduce",
                             "nranks": world, "size": size, "time_us": size / bw / 1e3, "algbw": bw, "busbw": bw,
                             "iters": 3})
            res = {"kind": "torch_sweep", "net": args.net, "network": "rustnet" if args.net == "plugin" else "Socket",
                   "world_size": world, "measurements": meas, "skipped": [], "errors": [], "rank_logs": []}
        else:
            drift = 1e-3 if (plugin and env.get("FAKE_DDP_DRIFT")) else 0.0
            losses = [[2.3 - 0.01 * s - 0.001 * r + (drift if s >= 5 else 0.0) for s in range(args.steps)]
                      for r in range(world)]
            res = {"kind": "ddp_check", "net": args.net, "network": "rustnet" if args.net == "plugin" else "Socket",
                   "world_size": world, "steps": args.steps, "losses": losses, "digests": ["d"] * world,
                   "rank_logs": [], "errors": []}
        with open(args.result, "w") as f:
            json.dump(res, f)
    return int(env.get("FAKE_RC", "0"))


if __name__ == "__main__":
    sys.exit(main())
