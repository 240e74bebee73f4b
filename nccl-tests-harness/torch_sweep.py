#!/usr/bin/env python3
"""nccl-tests' sweep written on PyTorch: all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single and send/recv over sizes, with
nccl-tests' algbw/busbw definitions, through librustnet and through NCCL's
built-in socket transport; proves from NCCL's log which network carried each
run; prints the table and writes CSV and the plot.

One host (the default): the script starts the ranks itself, one process
each, all on GPU 0 with a distinct NCCL_HOSTID (so NCCL treats them as
separate hosts), P2P and SHM off, on loopback:

  python3 torch_sweep.py --plugin-dir out/gpu-kit --nranks 2 --out out/torch-sweep

Several nodes: run the worker under torchrun once per network with the
environment from README.md, then build the comparison:

  torchrun --nnodes 2 --nproc-per-node 8 ... torch_sweep.py --worker --net plugin  --result plugin.json
  torchrun --nnodes 2 --nproc-per-node 8 ... torch_sweep.py --worker --net builtin --result builtin.json
  python3 torch_sweep.py --report-from plugin.json builtin.json --out out/torch-sweep

Exit status: 0 = proven and goal met; 1 = goal not met; 2 = a run failed,
got wrong data or was refused; 3 = torch missing.
"""

import argparse
import json
import os
import sys
import time

from ncclharness import BUILTIN_NET_NAME, PLUGIN_NET_NAME
from ncclharness.collectives import COLLECTIVES, parse_collectives
from ncclharness.envs import expected_net_name, prepare_plugin_dir
from ncclharness.nccllog import ProcessLog, check_network
from ncclharness.ranks import NO_TORCH, own_log_summary, run_local_job, torch_available, worker_setup
from ncclharness.report import write_report
from ncclharness.sizes import format_size, parse_size, size_sweep
from ncclharness.sweep import SweepOptions, run_sweep

# The script each rank process runs (this file; the tests put a stand-in here).
WORKER_SCRIPT = os.path.abspath(__file__)


# ------------------------------------------------------------------ worker

def import_torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("error: " + NO_TORCH.format(py=sys.executable), file=sys.stderr, flush=True)
        sys.exit(3)
    return torch, dist


def init_distributed(torch, dist, device, timeout_s):
    import datetime
    kwargs = {"backend": "nccl", "timeout": datetime.timedelta(seconds=timeout_s)}
    try:   # eager NCCL init where torch supports it (2.3+)
        dist.init_process_group(device_id=device, **kwargs)
    except TypeError:
        dist.init_process_group(**kwargs)


class TorchOps:
    """The sweep's ops interface (see ncclharness/sweep.py) on torch.distributed."""

    def __init__(self, torch, dist, device, max_bytes):
        self.torch, self.dist, self.device = torch, dist, device
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        elems = max(4, max_bytes // 4)
        self.a = torch.empty(elems, dtype=torch.float32, device=device)
        self.b = torch.empty(elems, dtype=torch.float32, device=device)
        # int32 index (exact), reduced mod 251, then float: small integers are exact in fp32
        self.pat = (torch.arange(elems, device=device, dtype=torch.int32) % 251).to(torch.float32)
        self.small = torch.zeros(8, dtype=torch.float64, device=device)

    def sync(self):
        self.torch.cuda.synchronize(self.device)

    def _agree(self, values, op):
        t = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=op)
        return t.tolist()

    def agree_max(self, values):
        return self._agree(values, self.dist.ReduceOp.MAX)

    def agree_sum(self, values):
        return self._agree(values, self.dist.ReduceOp.SUM)

    def barrier(self):
        self.dist.all_reduce(self.small)
        self.sync()

    def prepare(self, coll, size):
        torch, dist, n, r = self.torch, self.dist, self.n, self.rank
        count, reported = COLLECTIVES[coll].buffer_elements(size, n)
        if count == 0:
            return None
        a, b, pat = self.a, self.b, self.pat
        tri = 1000.0 * n * (n + 1) / 2
        if coll == "all_reduce":
            x = a[:count]

            def run():
                dist.all_reduce(x)

            def check():
                x.copy_(pat[:count] + 1000.0 * (r + 1))
                run()
                ok = torch.equal(x, n * pat[:count] + tri)
                x.zero_()   # keep later in-place sums finite
                return ok
        elif coll == "all_gather":
            src, dst = a[:count], b[:count * n]

            def run():
                dist.all_gather_into_tensor(dst, src)

            def check():
                src.copy_(pat[:count] + 1000.0 * (r + 1))
                run()
                want = pat[:count].repeat(n) + (1000.0 * (torch.arange(n, device=self.device) + 1)
                                                ).to(torch.float32).repeat_interleave(count)
                return torch.equal(dst, want)
        elif coll == "reduce_scatter":
            src, dst = a[:count * n], b[:count]

            def run():
                dist.reduce_scatter_tensor(dst, src)

            def check():
                src.copy_(pat[:count * n] + 1000.0 * (r + 1))
                run()
                ok = torch.equal(dst, n * pat[r * count:(r + 1) * count] + tri)
                src.zero_()
                return ok
        elif coll == "alltoall":
            src, dst = a[:count * n], b[:count * n]

            def run():
                dist.all_to_all_single(dst, src)

            def check():
                j = torch.arange(n, device=self.device).to(torch.float32)
                src.copy_(pat[:count].repeat(n) + 1000.0 * (r + 1) + (100.0 * j).repeat_interleave(count))
                run()
                want = pat[:count].repeat(n) + (1000.0 * (j + 1)).repeat_interleave(count) + 100.0 * r
                return torch.equal(dst, want)
        elif coll == "sendrecv":
            src, dst = a[:count], b[:count]
            to, frm = (r + 1) % n, (r - 1) % n

            def run():
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, src, to),
                                               dist.P2POp(dist.irecv, dst, frm)])
                for q in reqs:
                    q.wait()

            def check():
                src.copy_(pat[:count] + 1000.0 * (r + 1))
                run()
                return torch.equal(dst, pat[:count] + 1000.0 * (frm + 1))
        else:
            raise ValueError(coll)

        def checked():
            ok = check()
            self.sync()
            return bool(ok)
        return reported, run, checked


def worker_main(args):
    rank, world, local, outdir = worker_setup(args.result, args.one_gpu, f"torch-{args.net}")
    torch, dist = import_torch()
    if not torch.cuda.is_available():
        print("error: torch sees no CUDA device", file=sys.stderr)
        return 2
    if world < 2:
        print("error: the sweep needs at least 2 ranks", file=sys.stderr)
        return 2
    dev_index = int(os.environ.get("RUSTNET_HARNESS_DEVICE", local))
    torch.cuda.set_device(dev_index)
    device = torch.device("cuda", dev_index)
    init_distributed(torch, dist, device, args.pg_timeout)
    colls = parse_collectives(args.collectives)
    sizes = size_sweep(parse_size(args.min_size), parse_size(args.max_size), args.step_factor)
    opts = SweepOptions(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters,
                        target_s=args.target_time, budget_s=args.budget, check=not args.no_check)
    ops = TorchOps(torch, dist, device, max(sizes))
    net_name = expected_net_name(args.net)
    log = (lambda s: print(s, flush=True)) if rank == 0 else None
    t0 = time.monotonic()
    meas, skipped, errors = run_sweep(ops, colls, sizes, world, opts, log=log,
                                      net=args.net, network=net_name)
    secs = time.monotonic() - t0
    ops.sync()
    mine = own_log_summary(PLUGIN_NET_NAME)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "logs": mine})
    if rank == 0:
        nccl_ver = None
        try:
            nccl_ver = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            pass
        result = {"kind": "torch_sweep", "net": args.net, "network": net_name, "world_size": world,
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda, "nccl": nccl_ver,
                  "gpu": torch.cuda.get_device_name(device), "sweep_seconds": secs,
                  "measurements": meas, "skipped": skipped, "errors": errors,
                  "rank_logs": [d for g in gathered for d in g["logs"]],
                  "env": {k: v for k, v in os.environ.items()
                          if k.startswith(("NCCL_", "RUSTNET_")) or k == "LD_LIBRARY_PATH"}}
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.result)
        print(f"sweep over {net_name}: {len(meas)} points in {secs:.1f}s, {len(skipped)} skipped, "
              f"{len(errors)} errors -> {args.result}", flush=True)
    dist.destroy_process_group()
    return 0 if not errors else 2


# ------------------------------------------------------------ orchestrator

def worker_args(args):
    out = ["--collectives", args.collectives, "--min-size", str(args.min_size), "--max-size", str(args.max_size),
           "--step-factor", str(args.step_factor), "--warmup", str(args.warmup),
           "--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters),
           "--target-time", str(args.target_time), "--pg-timeout", str(args.pg_timeout)]
    if args.budget is not None:
        out += ["--budget", str(args.budget)]
    if args.no_check:
        out.append("--no-check")
    return out


def finish(outdir, results, failures, args, title):
    """Common end of the orchestrated and --report-from paths."""
    measurements, proofs = [], []
    for res, proof in results:
        measurements += res["measurements"]
        proofs.append(f"{res['network']}: {proof.summary()}")
        if res.get("skipped"):
            sk = res["skipped"]
            proofs.append(f"{res['network']}: {len(sk)} point(s) skipped, e.g. {sk[0]['collective']} "
                          f"{format_size(sk[0]['size'])} ({sk[0]['why']})")
    v = write_report(outdir, measurements, title, proofs=proofs, min_size=parse_size(args.goal_min_size))
    if failures:
        print("\n!! FAILED OR REFUSED RUNS (their numbers are not in the table):")
        for what, errors in failures:
            print(f"!! {what}: " + "; ".join(errors))
        return 2
    return 0 if v["ok"] else 1


def orchestrate(args):
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    if not torch_available():
        print("error: " + NO_TORCH.format(py=sys.executable), file=sys.stderr)
        return 3
    os.makedirs(args.out, exist_ok=True)
    plugin_dir = None
    if "plugin" in nets:
        if not args.plugin_dir:
            print("error: --plugin-dir is needed for the plugin run", file=sys.stderr)
            return 2
        plugin_dir = prepare_plugin_dir(args.plugin_dir, args.out)
        print(f"plugin: {plugin_dir}")
    sizes = size_sweep(parse_size(args.min_size), parse_size(args.max_size), args.step_factor)
    print(f"sweep: {args.collectives} x {len(sizes)} sizes {format_size(sizes[0])}..{format_size(sizes[-1])}, "
          f"{args.nranks} ranks {'on GPU ' + str(args.device) if args.gpus == 'one' else 'one per GPU'}, "
          f"budget {args.budget}s per network", flush=True)
    results, failures = [], []
    for net in nets:
        name = expected_net_name(net)
        print(f"\n== torch sweep over {name}", flush=True)
        job = run_local_job(WORKER_SCRIPT, worker_args(args), net, args.nranks, args, plugin_dir,
                            args.out, f"torch-{net}", args.timeout)
        print(f"   {name}: {job['seconds']:.1f}s", flush=True)
        if job["ok"]:
            results.append((job["result"], job["proof"]))
        else:
            failures.append((f"torch sweep over {name}", job["errors"]))
    return finish(args.out, results, failures, args,
                  f"torch sweep busbw, {args.nranks} ranks: {PLUGIN_NET_NAME} vs NCCL {BUILTIN_NET_NAME}")


def report_from(args):
    results, failures = [], []
    for path in args.report_from:
        with open(path) as f:
            res = json.load(f)
        procs = {d["host"] + ":" + str(d["pid"]): ProcessLog.from_dict(d) for d in res.get("rank_logs", [])}
        proof = check_network(procs, res["network"], expected_processes=res["world_size"],
                              forbid_local=args.forbid_local)
        print(f"{path}:\n{proof.describe()}")
        errs = list(res.get("errors", [])) + ([] if proof.ok else ["network not proven"])
        if errs:
            failures.append((f"{path} ({res['network']})", errs))
        else:
            results.append((res, proof))
    return finish(args.out, results, failures, args,
                  f"torch sweep busbw: {PLUGIN_NET_NAME} vs NCCL {BUILTIN_NET_NAME}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugin-dir", help="folder with libnccl-net-rustnet.so or librustnet.so")
    ap.add_argument("--nets", default="plugin,builtin")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--gpus", choices=["one", "many"], default="one",
                    help="one: every rank on --device with its own NCCL_HOSTID (default); "
                         "many: rank r on GPU r, P2P/SHM off")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--collectives", default="all")
    ap.add_argument("--min-size", default="1K")
    ap.add_argument("--max-size", default="1G")
    ap.add_argument("--step-factor", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--min-iters", type=int, default=2)
    ap.add_argument("--max-iters", type=int, default=100)
    ap.add_argument("--target-time", type=float, default=0.2, help="seconds of timed loop per size (default 0.2)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole sweep of one network; larger sizes are skipped past it")
    ap.add_argument("--no-check", action="store_true", help="skip the data check before each size")
    ap.add_argument("--ifname", default="lo")
    ap.add_argument("--rustnet-transport", choices=["auto", "socket", "ib"], default=None)
    ap.add_argument("--no-force-net", action="store_true")
    ap.add_argument("--env", action="append", default=[], metavar="K=V")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per network run (hard limit)")
    ap.add_argument("--pg-timeout", type=float, default=300, help="torch process group timeout (s)")
    ap.add_argument("--goal-min-size", default="1M")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "torch-sweep") if os.environ.get("OUT")
                    else os.path.join("out", "torch-sweep"))
    ap.add_argument("--report-from", nargs="+", metavar="JSON", help="build the report from worker results")
    ap.add_argument("--forbid-local", action="store_true", help="--report-from: refuse P2P/SHM connections")
    ap.add_argument("--worker", action="store_true", help="act as one rank (set by the launcher or torchrun)")
    ap.add_argument("--net", choices=["plugin", "builtin"], help="worker: which network this run is")
    ap.add_argument("--result", help="worker: where rank 0 writes its JSON")
    ap.add_argument("--one-gpu", action="store_true",
                    help="worker under torchrun with every rank on GPU 0: NCCL_HOSTID per rank")
    args = ap.parse_args(argv)
    try:
        parse_collectives(args.collectives)
        size_sweep(parse_size(args.min_size), parse_size(args.max_size), args.step_factor)
        parse_size(args.goal_min_size)
    except ValueError as e:
        ap.error(str(e))
    if args.worker:
        if not args.net or not args.result:
            ap.error("--worker needs --net and --result")
        return worker_main(args)
    if args.report_from:
        return report_from(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
