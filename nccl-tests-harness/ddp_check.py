#!/usr/bin/env python3
"""DDP drop-in check: train a small MLP with DistributedDataParallel through
librustnet and through NCCL's built-in socket transport, prove from NCCL's
log which network each run used, and check that the losses match step by
step (and match a single-process reference that averages the per-rank
gradients itself, without NCCL).

The model and data are fixed by seeds and torch runs in deterministic
mode, so the two networks must give the same numbers; see
ncclharness/losses.py for the tolerances and why.

One host (default; ranks on GPU 0 with distinct NCCL_HOSTID, P2P/SHM off):
  python3 ddp_check.py --plugin-dir out/gpu-kit --nranks 2 --out out/ddp
Several nodes (environment in docs/pytorch-ddp.md):
  torchrun ... ddp_check.py --worker --net plugin  --result plugin.json
  torchrun ... ddp_check.py --worker --net builtin --result builtin.json
  python3 ddp_check.py --compare plugin.json builtin.json --out out/ddp

Exit status: 0 = both runs proven and all losses match; 2 = a run failed,
was refused, or the losses differ; 3 = torch missing.
"""

import argparse
import csv
import hashlib
import json
import os
import sys
import time

from ncclharness import PLUGIN_NET_NAME
from ncclharness.envs import expected_net_name, prepare_plugin_dir
from ncclharness.launch import run_group, tail
from ncclharness.losses import NET_ATOL, NET_RTOL, REF_ATOL, REF_RTOL, compare_losses
from ncclharness.nccllog import ProcessLog, check_network
from ncclharness.ranks import NO_TORCH, own_log_summary, run_local_job, torch_available, worker_setup

# The script each rank process runs (this file; the tests put a stand-in here).
WORKER_SCRIPT = os.path.abspath(__file__)


IN, HIDDEN, OUT_CLASSES = 256, 1024, 10


# ------------------------------------------------------------ model, data

def import_torch():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # needed for deterministic cuBLAS
    try:
        import torch
    except ImportError:
        print("error: " + NO_TORCH.format(py=sys.executable), file=sys.stderr, flush=True)
        sys.exit(3)
    # warn_only: an op without a deterministic kernel warns instead of aborting the check
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def make_model(torch, seed):
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT_CLASSES))


def make_batch(torch, seed, rank, step, batch):
    """Rank `rank`'s batch at `step`: inputs from a generator seeded by
    (seed, rank, step), labels from a fixed random linear teacher. Made on
    the CPU so every run and the reference see identical bytes."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(IN, OUT_CLASSES, generator=g)
    g.manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(batch, IN, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return x, y


def param_digest(model):
    """sha256 of every parameter's fp32 bytes (bitwise identity check)."""
    import torch
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach().float().cpu().contiguous().view(-1)
        try:
            h.update(t.numpy().tobytes())
        except (RuntimeError, ImportError, TypeError):   # torch without numpy
            h.update(bytes(t.view(torch.uint8).tolist()))
    return h.hexdigest()


# ------------------------------------------------------------------ worker

def worker_main(args):
    rank, world, local, outdir = worker_setup(args.result, args.one_gpu, f"ddp-{args.net}")
    torch = import_torch()
    import datetime
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev_index = int(os.environ.get("RUSTNET_HARNESS_DEVICE", local))
    torch.cuda.set_device(dev_index)
    device = torch.device("cuda", dev_index)
    kwargs = {"backend": "nccl", "timeout": datetime.timedelta(seconds=args.pg_timeout)}
    try:
        dist.init_process_group(device_id=device, **kwargs)
    except TypeError:
        dist.init_process_group(**kwargs)
    model = make_model(torch, args.seed).to(device)
    # Small buckets: several gradient all_reduces of ~1 MiB per step.
    ddp = DDP(model, device_ids=[dev_index], bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    losses = []
    t0 = time.monotonic()
    for step in range(args.steps):
        x, y = make_batch(torch, args.seed, rank, step, args.batch)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = lossf(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    secs = time.monotonic() - t0
    digest = param_digest(model)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "losses": losses, "digest": digest,
                                      "logs": own_log_summary(PLUGIN_NET_NAME)})
    if rank == 0:
        gathered.sort(key=lambda g: g["rank"])
        result = {"kind": "ddp_check", "net": args.net, "network": expected_net_name(args.net),
                  "world_size": world, "steps": args.steps, "seed": args.seed, "batch": args.batch,
                  "lr": args.lr, "torch": torch.__version__, "train_seconds": secs,
                  "losses": [g["losses"] for g in gathered], "digests": [g["digest"] for g in gathered],
                  "rank_logs": [d for g in gathered for d in g["logs"]], "errors": []}
        if len(set(result["digests"])) != 1:
            result["errors"].append("ranks ended with different parameters: " + ", ".join(
                d[:12] for d in result["digests"]))
        _write_json(args.result, result)
        print(f"DDP over {result['network']}: {args.steps} steps in {secs:.1f}s, final losses "
              + ", ".join(f"{ls[-1]:.6f}" for ls in result["losses"]), flush=True)
    dist.destroy_process_group()
    return 0


def reference_main(args):
    """Same training in one process, no NCCL: per step, every rank's batch
    gives a gradient; their mean is what DDP's all_reduce produces."""
    torch = import_torch()
    device = torch.device("cuda", args.device) if torch.cuda.is_available() else torch.device("cpu")
    model = make_model(torch, args.seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    losses = [[] for _ in range(args.nranks)]
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        for r in range(args.nranks):
            x, y = make_batch(torch, args.seed, r, step, args.batch)
            loss = lossf(model(x.to(device)), y.to(device))
            (loss / args.nranks).backward()
            losses[r].append(loss.item())
        opt.step()
    _write_json(args.result, {"kind": "ddp_reference", "world_size": args.nranks, "steps": args.steps,
                              "losses": losses, "digest": param_digest(model), "device": str(device)})
    return 0


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ------------------------------------------------------------ comparison

def compare_runs(runs, reference=None):
    """runs: {"plugin": result, "builtin": result}; reference: result or None.
    Returns (ok, lines, csv_rows)."""
    lines, ok = [], True
    p, b = runs.get("plugin"), runs.get("builtin")
    if p is None or b is None:
        return False, ["need both a plugin and a built-in run to compare"], []
    if p["world_size"] != b["world_size"] or p["steps"] != b["steps"]:
        return False, [f"runs differ in shape: {p['world_size']}x{p['steps']} vs "
                       f"{b['world_size']}x{b['steps']}"], []
    world = p["world_size"]
    for r in range(world):
        c = compare_losses(p["losses"][r], b["losses"][r], NET_RTOL, NET_ATOL)
        lines.append(f"rank {r}: " + c.describe(p["network"], b["network"], NET_RTOL, NET_ATOL))
        ok &= c.ok
        if reference is not None:
            for res in (p, b):
                c = compare_losses(res["losses"][r], reference["losses"][r], REF_RTOL, REF_ATOL)
                lines.append(f"rank {r}: " + c.describe(res["network"], "reference", REF_RTOL, REF_ATOL))
                ok &= c.ok
    same_params = p["digests"][0] == b["digests"][0]
    lines.append(f"final parameters {'bitwise identical' if same_params else 'differ in some bits'} "
                 f"between {p['network']} and {b['network']} (informational)")
    for res in (p, b):
        for e in res.get("errors", []):
            lines.append(f"{res['network']}: {e}")
            ok = False
    rows = []
    for r in range(world):
        for s in range(p["steps"]):
            rows.append({"step": s, "rank": r, p["network"]: repr(p["losses"][r][s]),
                         b["network"]: repr(b["losses"][r][s]),
                         "reference": repr(reference["losses"][r][s]) if reference else ""})
    return ok, lines, rows


def write_outputs(outdir, ok, lines, rows, header_extra=()):
    os.makedirs(outdir, exist_ok=True)
    if rows:
        with open(os.path.join(outdir, "losses.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    verdict = ("DDP CHECK PASSED: losses match step by step" if ok else
               "DDP CHECK FAILED: see the lines above")
    body = "\n".join(list(header_extra) + lines + [verdict])
    with open(os.path.join(outdir, "ddp-report.txt"), "w") as f:
        f.write(body + "\n")
    print(body, flush=True)
    print(f"files: {os.path.join(outdir, 'losses.csv')}, {os.path.join(outdir, 'ddp-report.txt')}", flush=True)


def worker_args(args):
    return ["--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr), "--seed", str(args.seed),
            "--bucket-mb", str(args.bucket_mb), "--pg-timeout", str(args.pg_timeout)]


def orchestrate(args):
    if not torch_available():
        print("error: " + NO_TORCH.format(py=sys.executable), file=sys.stderr)
        return 3
    os.makedirs(args.out, exist_ok=True)
    plugin_dir = prepare_plugin_dir(args.plugin_dir, args.out) if args.plugin_dir else None
    if plugin_dir is None:
        print("error: --plugin-dir is needed", file=sys.stderr)
        return 2
    runs, failures, header = {}, [], []
    for net in ("plugin", "builtin"):
        name = expected_net_name(net)
        print(f"\n== DDP over {name}", flush=True)
        job = run_local_job(WORKER_SCRIPT, worker_args(args), net, args.nranks, args, plugin_dir,
                            args.out, f"ddp-{net}", args.timeout)
        print(f"   {name}: {job['seconds']:.1f}s", flush=True)
        header.append(f"{name}: {job['proof'].summary()}")
        if job["ok"]:
            runs[net] = job["result"]
        else:
            failures.append(f"DDP over {name}: " + "; ".join(job["errors"]))
    reference = None
    if not args.no_reference:
        print("\n== single-process reference (no NCCL)", flush=True)
        ref_path = os.path.join(args.out, "ddp-reference.json")
        argv = [sys.executable, WORKER_SCRIPT, "--reference", "--result", ref_path,
                "--nranks", str(args.nranks), "--device", str(args.device)] + worker_args(args)
        log = os.path.join(args.out, "logs", "ddp-reference.out")
        (proc,) = run_group([(argv, dict(os.environ), log)], timeout_s=args.timeout)
        if proc.rc == 0 and os.path.exists(ref_path):
            reference = _read_json(ref_path)
        else:
            failures.append(f"reference run failed (exit {proc.rc}): {tail(log, 5)}")
    ok, lines, rows = compare_runs(runs, reference) if len(runs) == 2 else (False, [], [])
    lines += [f"!! {f}" for f in failures]
    write_outputs(args.out, ok and not failures, lines, rows, header)
    return 0 if ok and not failures else 2


def compare_main(args):
    runs, header, failures = {}, [], []
    for path in args.compare:
        res = _read_json(path)
        procs = {d["host"] + ":" + str(d["pid"]): ProcessLog.from_dict(d) for d in res.get("rank_logs", [])}
        proof = check_network(procs, res["network"], expected_processes=res["world_size"],
                              forbid_local=args.forbid_local)
        header.append(f"{res['network']}: {proof.summary()}")
        if not proof.ok:
            failures.append(f"{path}: network not proven")
        runs[res["net"]] = res
    reference = _read_json(args.reference_json) if args.reference_json else None
    ok, lines, rows = compare_runs(runs, reference)
    lines += [f"!! {f}" for f in failures]
    write_outputs(args.out, ok and not failures, lines, rows, header)
    return 0 if ok and not failures else 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugin-dir")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--gpus", choices=["one", "many"], default="one")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--ifname", default="lo")
    ap.add_argument("--rustnet-transport", choices=["auto", "socket", "ib"], default=None)
    ap.add_argument("--no-force-net", action="store_true")
    ap.add_argument("--env", action="append", default=[], metavar="K=V")
    ap.add_argument("--no-reference", action="store_true", help="skip the single-process reference")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--pg-timeout", type=float, default=180)
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "ddp") if os.environ.get("OUT")
                    else os.path.join("out", "ddp"))
    ap.add_argument("--compare", nargs=2, metavar="JSON", help="compare two --worker results (torchrun)")
    ap.add_argument("--reference-json", help="--compare: also compare with this --reference result")
    ap.add_argument("--forbid-local", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--reference", action="store_true", help="run the single-process reference")
    ap.add_argument("--net", choices=["plugin", "builtin"])
    ap.add_argument("--result")
    ap.add_argument("--one-gpu", action="store_true",
                    help="worker under torchrun with every rank on GPU 0: NCCL_HOSTID per rank")
    args = ap.parse_args(argv)
    if args.worker or args.reference:
        if not args.result or (args.worker and not args.net):
            ap.error("--worker needs --net and --result; --reference needs --result")
        return worker_main(args) if args.worker else reference_main(args)
    if args.compare:
        return compare_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
