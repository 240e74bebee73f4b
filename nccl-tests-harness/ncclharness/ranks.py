"""Start the ranks of one torch job on this host, one process per rank, and
check from their NCCL logs which network carried it.

One process per rank (rather than torch.multiprocessing inside one
interpreter) because what matters must be in place when each process
starts: LD_LIBRARY_PATH is read by the dynamic loader at start-up, and
NCCL_HOSTID / NCCL_DEBUG_FILE must differ per rank before NCCL initialises.
The rank processes see the same variables torchrun would give them (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so the worker code is the
same under torchrun.
"""

import glob
import json
import os
import sys
import time

from .envs import (apply_overrides, describe_env, expected_net_name, hostid_for_rank,
                   network_env, one_host_env)
from .launch import free_port, read_text, run_group, tail
from .nccllog import ProcessLog, check_network, merge_logs, parse_nccl_log


def torch_available():
    import importlib.util
    return importlib.util.find_spec("torch") is not None


NO_TORCH = ("PyTorch is not importable by {py}. This script needs torch with CUDA and the nccl "
            "backend on a machine with a GPU (e.g. pip install torch). Nothing was run.")


def rank_env(net, rank, nranks, port, opts, plugin_dir, logdir, tag):
    """Environment of one rank. opts: namespace with ifname, gpus ('one' or
    'many'), device, env (K=V list), no_force_net, rustnet_transport."""
    env = network_env(net, plugin_dir, force_net=not opts.no_force_net,
                      rustnet_transport=opts.rustnet_transport)
    env.update(one_host_env(opts.ifname))
    env.update({"RANK": str(rank), "WORLD_SIZE": str(nranks), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "NCCL_DEBUG_FILE": os.path.join(logdir, f"{tag}-rank{rank}.nccl.log"),
                "PYTHONUNBUFFERED": "1"})
    if opts.gpus == "one":
        env["NCCL_HOSTID"] = hostid_for_rank(rank)
        env["RUSTNET_HARNESS_DEVICE"] = str(opts.device)
    else:
        env["RUSTNET_HARNESS_DEVICE"] = str(rank)
    apply_overrides(env, opts.env)
    return env


def run_local_job(script, worker_args, net, nranks, opts, plugin_dir, outdir, tag, timeout_s):
    """Run `python script --worker <worker_args>` as nranks processes.

    Returns dict(ok, errors, proof, result (rank 0's JSON or None), seconds)."""
    logdir = os.path.join(outdir, "logs")
    os.makedirs(logdir, exist_ok=True)
    for old in glob.glob(os.path.join(logdir, f"{tag}-rank*")):
        os.unlink(old)
    result_path = os.path.join(outdir, f"{tag}.json")
    if os.path.exists(result_path):
        os.unlink(result_path)
    port = free_port()
    specs = []
    for r in range(nranks):
        env = rank_env(net, r, nranks, port, opts, plugin_dir, logdir, tag)
        argv = [sys.executable, script, "--worker", "--net", net, "--result", result_path] + list(worker_args)
        specs.append((argv, env, os.path.join(logdir, f"{tag}-rank{r}.out")))
    print(f"   env (rank 0): {describe_env(specs[0][1])}", flush=True)
    print(f"   {nranks} rank processes: {' '.join(specs[0][0][1:])}", flush=True)
    t0 = time.monotonic()
    procs = run_group(specs, timeout_s=timeout_s, follow=0)
    secs = time.monotonic() - t0
    errors = []
    for r, p in enumerate(procs):
        if p.timed_out:
            errors.append(f"rank {r} timed out after {timeout_s:.0f}s")
        elif p.rc != 0:
            errors.append(f"rank {r} exit status {p.rc}")
    logs = []
    for path in sorted(glob.glob(os.path.join(logdir, f"{tag}-rank*.nccl.log"))):
        logs.append(parse_nccl_log(read_text(path)))
    for _argv, _env, out in specs:   # NCCL lines that went to stdout (no DEBUG_FILE honoured)
        logs.append(parse_nccl_log(read_text(out)))
    procs_log = merge_logs(*logs)
    result = None
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if not procs_log and result.get("rank_logs"):
            procs_log = {d["host"] + ":" + str(d["pid"]): ProcessLog.from_dict(d) for d in result["rank_logs"]}
        errors += result.get("errors", [])
    elif not errors:
        errors.append("rank 0 wrote no result file")
    proof = check_network(procs_log, expected_net_name(net), expected_processes=nranks, forbid_local=True)
    if not proof.ok:
        errors.append("network not proven")
    print(proof.describe(), flush=True)
    if errors:
        for r, (_a, _e, out) in enumerate(specs):
            if r == 0:
                continue     # rank 0's output was shown as it ran
            t = tail(out, 15)
            if t:
                print(f"   rank {r} output ({out}):\n" + "\n".join("   | " + ln for ln in t.splitlines()), flush=True)
    return {"ok": not errors, "errors": errors, "proof": proof, "result": result, "seconds": secs}


def nccl_debug_file_path(pattern):
    """Expand NCCL's %h (host name up to the first dot) and %p (pid)."""
    import socket
    host = socket.gethostname().split(".")[0]
    return pattern.replace("%h", host).replace("%p", str(os.getpid()))


def own_log_summary(plugin_name="rustnet"):
    """This process's NCCL log summary, read from its NCCL_DEBUG_FILE."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return []
    path = nccl_debug_file_path(pattern)
    text = read_text(path)
    if not text:
        return []
    return [p.to_dict() for p in parse_nccl_log(text, plugin_name).values()]


def worker_setup(result_path, one_gpu, log_prefix):
    """Per-rank set-up shared by the torch workers: rank facts from the
    launcher's environment, the one-GPU NCCL_HOSTID trick, and NCCL's log
    into a file we read back (under torchrun nobody else sets it).
    Returns (rank, world, local_rank, outdir)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    outdir = os.path.dirname(os.path.abspath(result_path))
    if one_gpu:
        # torchrun on one GPU: what the built-in launcher sets per rank.
        os.environ["NCCL_HOSTID"] = hostid_for_rank(rank)
        os.environ.setdefault("RUSTNET_HARNESS_DEVICE", "0")
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    if "NCCL_DEBUG_FILE" not in os.environ:
        os.makedirs(os.path.join(outdir, "logs"), exist_ok=True)
        os.environ["NCCL_DEBUG_FILE"] = os.path.join(outdir, "logs", f"{log_prefix}-rank{rank}.%h.%p.nccl.log")
    return rank, world, local, outdir
