#!/usr/bin/env python3
"""Run nccl-tests through librustnet and through NCCL's built-in socket
transport, prove from NCCL's log which network carried each run, and print
busbw side by side (plus CSV and a plot).

  python3 run_nccl_tests.py --nccl-tests-dir ~/nccl-tests/build \\
      --plugin-dir /opt/rustnet/lib --nranks 2 --out out/nccl-tests

Layouts (--layout):
  one-gpu   N ranks, one process each, all on GPU 0 (an MPI build of
            nccl-tests, launched with mpirun; a distinct NCCL_HOSTID per rank;
            P2P/SHM off; loopback). The default when the binaries use MPI.
  gpus      one process driving N GPUs (-g N), P2P/SHM off so even these
            intra-node ranks talk over the network. Works with non-MPI builds.
  launcher  your own launcher for several nodes, e.g.
            --launcher "mpirun -np 16 -H node1:8,node2:8"; the harness adds the
            network's environment (forwarded with -x for Open MPI).
Without MPI, nccl-tests runs every rank as a thread of one process: one host
to NCCL, so ranks cannot share a GPU (NCCL refuses that) and NCCL_HOSTID
cannot differ per rank. On a one-GPU machine use an MPI build or
torch_sweep.py.

Exit status: 0 = every run proven and the goal met; 1 = goal not met;
2 = a run failed, returned wrong data or was refused (log does not prove
the expected network).
"""

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import time

from ncclharness import BUILTIN_NET_NAME, PLUGIN_NET_NAME
from ncclharness.collectives import COLLECTIVES, parse_collectives
from ncclharness.envs import (apply_overrides, describe_env, expected_net_name,
                              network_env, one_host_env, prepare_plugin_dir)
from ncclharness.launch import read_text, run_group
from ncclharness.nccllog import check_network, merge_logs, parse_nccl_log
from ncclharness.perfparse import parse_perf_output, run_problems
from ncclharness.report import write_report
from ncclharness.sizes import parse_size


HERE = os.path.dirname(os.path.abspath(__file__))


def find_binary(coll, tests_dir):
    """The nccl-tests binary for a collective: in tests_dir (or its build/),
    else on PATH. Also accepts the NAME_SUFFIX=_mpi variant."""
    names = [COLLECTIVES[coll].binary, COLLECTIVES[coll].binary + "_mpi"]
    if tests_dir:
        for d in (tests_dir, os.path.join(tests_dir, "build"), os.path.join(tests_dir, "bin")):
            for n in names:
                p = os.path.join(d, n)
                if os.path.isfile(p) and os.access(p, os.X_OK):
                    return os.path.abspath(p)
        return None
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def is_mpi_build(binary):
    """nccl-tests built with MPI=1 links libmpi and calls MPI_Init."""
    try:
        with open(binary, "rb") as f:
            data = f.read()
    except OSError:
        return False
    return b"MPI_Init" in data or b"libmpi" in data


def mpi_flavor(mpirun):
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "Open MPI" in text or "OpenRTE" in text or "Open RTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel" in text:
        return "mpich"
    return "unknown"


def count_gpus():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def forwarded_vars(env, base):
    """Variables the run sets or changes (what a remote launcher must forward)."""
    return sorted(k for k, v in env.items() if base.get(k) != v and
                  (k.startswith(("NCCL_", "RUSTNET_")) or k == "LD_LIBRARY_PATH"))


def build_command(args, coll, binary, net, mpi, flavor, logdir, plugin_dir):
    base = dict(os.environ)
    env = network_env(net, plugin_dir, base, force_net=not args.no_force_net,
                      rustnet_transport=args.rustnet_transport)
    bench = [binary, "-b", str(args.min_bytes), "-e", str(args.max_bytes), "-f", str(args.step_factor),
             "-n", str(args.iters), "-w", str(args.warmup), "-c", str(args.check)]
    tag = f"{coll}-{net}"
    if args.layout in ("one-gpu", "gpus"):
        env.update(one_host_env(args.ifname))
        env["NCCL_DEBUG_FILE"] = os.path.join(logdir, f"{tag}.%h.%p.nccl.log")
    if args.layout == "one-gpu":
        env["NCCL_TESTS_DEVICE"] = str(args.device)
        bench += ["-g", "1"]
        cmd = [args.mpirun, "-np", str(args.nranks)] + shlex.split(args.mpirun_args)
        if flavor == "openmpi":
            if os.geteuid() == 0 and "--allow-run-as-root" not in cmd:
                cmd.append("--allow-run-as-root")
            for k in forwarded_vars(env, base):
                cmd += ["-x", k]
        cmd += [os.path.join(HERE, "rank-env.sh")] + bench
    elif args.layout == "gpus":
        bench += ["-g", str(args.nranks)]
        cmd = bench
    else:  # launcher
        bench += ["-g", str(args.gpus_per_proc)]
        cmd = shlex.split(args.launcher)
        if flavor == "openmpi":
            for k in forwarded_vars(env, base):
                cmd += ["-x", k]
        cmd += bench
    apply_overrides(env, args.env)
    return cmd, env, tag


def run_one(args, coll, binary, net, mpi, flavor, outdir, plugin_dir):
    logdir = os.path.join(outdir, "logs")
    os.makedirs(logdir, exist_ok=True)
    cmd, env, tag = build_command(args, coll, binary, net, mpi, flavor, logdir, plugin_dir)
    stdout_log = os.path.join(logdir, f"{tag}.stdout.log")
    for old in glob.glob(os.path.join(logdir, f"{tag}.*.nccl.log")):
        os.unlink(old)
    print(f"\n== {coll} over {expected_net_name(net)}\n   env: {describe_env(env)}\n   cmd: {shlex.join(cmd)}",
          flush=True)
    if args.dry_run:
        return [], None, None
    t0 = time.monotonic()
    (proc,) = run_group([(cmd, env, stdout_log)], timeout_s=args.timeout, follow=0)
    secs = time.monotonic() - t0
    text = read_text(stdout_log)
    perf = parse_perf_output(text)
    logs = [parse_nccl_log(text)]
    for path in sorted(glob.glob(os.path.join(logdir, f"{tag}.*.nccl.log"))):
        logs.append(parse_nccl_log(read_text(path)))
    procs = merge_logs(*logs)
    expected_procs = [(r["host"], r["pid"]) for r in perf.ranks] or None
    proof = check_network(procs, expected_net_name(net), expected_processes=expected_procs,
                          forbid_local=(args.layout != "launcher") or args.forbid_local)
    errors = run_problems(perf, timed_out=proc.timed_out, rc=proc.rc, timeout_desc=f"{args.timeout}s")
    if not proof.ok:
        errors.append("network not proven (see above)")
    print(proof.describe(), flush=True)
    print(f"   {len(perf.rows)} sizes, {secs:.1f}s, avg busbw {perf.avg_busbw}; output: {stdout_log}", flush=True)
    if errors:
        print(f"!! {coll} over {expected_net_name(net)}: " + "; ".join(errors), flush=True)
        return [], (f"{coll}/{expected_net_name(net)}", errors, proof), proof
    nranks = perf.nranks or args.nranks
    meas = []
    for r in perf.rows:
        meas.append({"source": "nccl-tests", "net": net, "network": expected_net_name(net), "collective": coll,
                     "nranks": nranks, "size": r.size, "count": r.count,
                     "time_us": r.time_us(args.placement), "algbw": r.algbw(args.placement),
                     "busbw": r.busbw(args.placement), "iters": args.iters, "wrong": r.oop_wrong,
                     "inplace_time_us": r.ip_time_us, "inplace_algbw": r.ip_algbw,
                     "inplace_busbw": r.ip_busbw, "inplace_wrong": r.ip_wrong})
    return meas, None, proof


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nccl-tests-dir", help="folder with the *_perf binaries (default: search PATH)")
    ap.add_argument("--plugin-dir", help="folder with libnccl-net-rustnet.so or librustnet.so "
                    "(e.g. PREFIX/lib after 'make install', or target/release)")
    ap.add_argument("--tests", default="all", help="comma list of all_reduce, all_gather, reduce_scatter, "
                    "alltoall, sendrecv (default all)")
    ap.add_argument("--nets", default="plugin,builtin", help="which networks to run (default plugin,builtin)")
    ap.add_argument("--layout", choices=["auto", "one-gpu", "gpus", "launcher"], default="auto")
    ap.add_argument("--nranks", type=int, default=2, help="ranks for one-gpu / gpus layouts (default 2)")
    ap.add_argument("--device", type=int, default=0, help="GPU for the one-gpu layout (default 0)")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--mpirun-args", default="", help="extra mpirun options for the one-gpu layout")
    ap.add_argument("--launcher", default="", help="launcher command line for the launcher layout")
    ap.add_argument("--gpus-per-proc", type=int, default=1, help="-g for the launcher layout")
    ap.add_argument("--forbid-local", action="store_true",
                    help="launcher layout: also refuse P2P/SHM connections (when you disabled them)")
    ap.add_argument("-b", "--min-bytes", default="1K")
    ap.add_argument("-e", "--max-bytes", default="1G")
    ap.add_argument("-f", "--step-factor", type=int, default=2)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("-c", "--check", type=int, default=1, help="nccl-tests data validation (default 1)")
    ap.add_argument("--placement", choices=["out", "in"], default="out",
                    help="compare out-of-place (default) or in-place columns")
    ap.add_argument("--ifname", default="lo", help="NCCL_SOCKET_IFNAME for one-host layouts (default lo)")
    ap.add_argument("--rustnet-transport", choices=["auto", "socket", "ib"], default=None,
                    help="RUSTNET_TRANSPORT for the plugin run (default: unset = plugin's auto)")
    ap.add_argument("--no-force-net", action="store_true",
                    help="do not set NCCL_NET=rustnet in the plugin run (the log check still applies)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra variable for both runs")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per binary per network")
    ap.add_argument("--goal-min-size", default="1M")
    ap.add_argument("--out", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "nccl-tests")
                    or os.path.join("out", "nccl-tests"))
    ap.add_argument("--dry-run", action="store_true", help="print what would run")
    args = ap.parse_args(argv)

    try:
        colls = parse_collectives(args.tests)
        nets = [n.strip() for n in args.nets.split(",") if n.strip()]
        for n in nets:
            if n not in ("plugin", "builtin"):
                raise ValueError(f"--nets takes plugin and/or builtin, not {n!r}")
        args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
        goal_min = parse_size(args.goal_min_size)
    except ValueError as e:
        ap.error(str(e))

    binaries = {}
    for c in colls:
        b = find_binary(c, args.nccl_tests_dir)
        if not b:
            where = args.nccl_tests_dir or "PATH"
            print(f"error: {COLLECTIVES[c].binary} not found in {where}. Build nccl-tests "
                  f"(see nccl-tests-harness/README.md) or pass --nccl-tests-dir.", file=sys.stderr)
            return 2
        binaries[c] = b
    mpi = is_mpi_build(next(iter(binaries.values())))
    print(f"nccl-tests: {os.path.dirname(next(iter(binaries.values())))} ({'MPI' if mpi else 'no MPI'} build)")

    if args.layout == "auto":
        if mpi:
            args.layout = "one-gpu"
        else:
            ngpu = count_gpus()
            if ngpu is not None and ngpu >= args.nranks:
                args.layout = "gpus"
            else:
                print("error: these nccl-tests binaries were built without MPI, so all ranks would be threads "
                      "of one process. NCCL sees one host then: it refuses two ranks on the same GPU and "
                      "NCCL_HOSTID cannot differ per thread. "
                      f"{'Found ' + str(ngpu) + ' GPU(s)' if ngpu is not None else 'nvidia-smi not found'}, "
                      f"need {args.nranks} for --layout gpus. Rebuild nccl-tests with MPI=1 "
                      "(README.md), or use torch_sweep.py, which spawns one process per rank.",
                      file=sys.stderr)
                return 2
    if args.layout == "one-gpu" and not mpi:
        print("error: --layout one-gpu needs nccl-tests built with MPI=1 (one process per rank)", file=sys.stderr)
        return 2
    if args.layout == "launcher" and not args.launcher:
        print("error: --layout launcher needs --launcher 'mpirun -np N ...'", file=sys.stderr)
        return 2
    flavor = "none"
    if args.layout == "one-gpu":
        flavor = mpi_flavor(args.mpirun)
    elif args.layout == "launcher":
        first = os.path.basename(shlex.split(args.launcher)[0])
        if first in ("mpirun", "mpiexec", "orterun", "prterun"):
            flavor = mpi_flavor(shlex.split(args.launcher)[0])
    print(f"layout: {args.layout}, ranks: {args.nranks if args.layout != 'launcher' else 'from launcher'}"
          + (f", MPI: {flavor}" if flavor != "none" else ""))

    os.makedirs(args.out, exist_ok=True)
    plugin_dir = None
    if "plugin" in nets:
        if not args.plugin_dir:
            ap.error("--plugin-dir is needed for the plugin run")
        try:
            plugin_dir = prepare_plugin_dir(args.plugin_dir, args.out)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"plugin: {plugin_dir}")

    measurements, failures, proofs = [], [], []
    t0 = time.monotonic()
    for c in colls:
        for net in nets:
            meas, failure, proof = run_one(args, c, binaries[c], net, mpi, flavor, args.out, plugin_dir)
            measurements += meas
            if failure:
                failures.append(failure)
            elif proof is not None:
                proofs.append(f"{c}/{expected_net_name(net)}: {proof.summary()}")
    if args.dry_run:
        return 0
    print(f"\n== all runs done in {time.monotonic() - t0:.0f}s")
    v = write_report(args.out, measurements,
                     f"nccl-tests busbw: {PLUGIN_NET_NAME} vs NCCL {BUILTIN_NET_NAME} ({args.layout})",
                     proofs=proofs, min_size=goal_min)
    if failures:
        print("\n!! FAILED OR REFUSED RUNS (their numbers are not in the table):")
        for what, errors, proof in failures:
            print(f"!! {what}: " + "; ".join(errors))
        return 2
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
