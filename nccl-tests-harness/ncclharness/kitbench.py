"""nccl-tests from a prebuilt kit on one GPU: the plugin against NCCL's
Socket transport at several rank counts, interleaved and repeated, judged
on the median.

  python3 -m ncclharness.kitbench --kit .gpu/nccl-kit --plugin-dir out/gpu-kit --out out/gpu-check/nccl-tests

The kit (../shared/gpu/nccl-kit, copied into the checkout as .gpu/nccl-kit)
holds MPI builds of nccl-tests in bin/, MPICH's mpiexec, env.sh (source it
first: it puts that mpiexec on PATH and finds libnccl) and rank-wrap.sh,
which gives every rank its own NCCL_HOSTID and NCCL_TESTS_DEVICE=0. Each
run is `mpiexec -n N rank-wrap.sh bin/<test>_perf -b .. -e .. -f .. -n .. -w ..
-c 1 -g 1` with the network's environment (envs.py: NCCL_NET_PLUGIN +
NCCL_NET=rustnet for the plugin, NCCL_NET_PLUGIN=none + NCCL_NET=Socket for
the built-in one; P2P/SHM off, loopback).

The plan (defaults):
  main:   all_reduce_perf and sendrecv_perf at 2, 4 and 8 ranks, 3 repeats.
          Repeat by repeat over every (test, ranks) group, the two networks
          back to back, the first of the pair alternating with the repeat
          (plugin first in odd repeats, Socket first in even ones), so slow
          drift and warm-up favour neither network.
  extras: all_gather_perf and alltoall_perf once at 8 ranks (plugin, Socket).
Every run is proven from NCCL's log (nccllog.py: which network carried it,
no P2P/SHM), must list N ranks and have #wrong 0 everywhere.

Time: a budget for all runs; each run has a hard timeout (the cap of its
rank count, or 3x the slowest run of its group so far, else of any test at
that rank count, at least --min-cap), never more than what is left. A run starts only if its estimate (the
slowest run of its group so far, else a default per rank count) fits in
what is left; otherwise it is skipped and listed. After a failure or a
timeout, the later repeats of that (test, ranks, network) are skipped, and
after two timeouts over one network all its remaining runs: a hang would
only repeat.

Verdict (repstats.py): median busbw plugin >= Socket at every size >= 1 MiB
for all_reduce and sendrecv at every rank count, each point with all
repeats on both sides. Stretch: >= 1.2x at >= 16 MiB (printed, not judged).

MPS is not started here: gpu-check.sh starts it, proves from its logs that
the ranks were its clients, and refuses a verdict otherwise. Run alone, this
module reports how many ranks of each run the MPS logs saw when
CUDA_MPS_LOG_DIRECTORY is set, and nothing about MPS otherwise.

Exit: 0 goal met; 1 goal not met; 2 a run failed, was refused, got wrong
data, or the verdict is incomplete (skipped or missing runs).
"""

import argparse
import csv
import glob
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from . import BUILTIN_NET_NAME, PLUGIN_NET_NAME
from .collectives import COLLECTIVES, parse_collectives
from .envs import apply_overrides, describe_env, expected_net_name, network_env, one_host_env, prepare_plugin_dir
from .launch import read_text, run_group, tail
from .mps import read_evidence
from .nccllog import check_network, merge_logs, parse_nccl_log
from .perfparse import parse_perf_output, run_problems
from .repstats import (SUMMARY_FIELDS, aggregate, describe_verdict, format_points, format_ratio_matrix,
                       plot_series, summary_rows, verdict)
from .report import MEASUREMENT_FIELDS, svg_plot
from .sizes import format_size, parse_size, size_sweep
from .threadcpu import KINDS as CPU_KINDS, ThreadCpu, describe as describe_cpu, summary_table as cpu_summary_table

# Seconds, per rank count: hard cap of one run, and the estimate used before
# a group has run once (mpiexec + N CUDA contexts under MPS + NCCL init +
# the sweep; see the budget plan in nccl-tests-harness/README.md).
DEFAULT_CAPS = {2: 60, 4: 75, 8: 100}
DEFAULT_ESTIMATES = {2: 8, 4: 12, 8: 20}
# After this many timed-out runs over one network, its remaining runs are
# skipped: a systemic hang would otherwise eat the whole budget, cap by cap.
MAX_TIMEOUTS_PER_NET = 2
# What the goal asks for (a run with less says PARTIAL PLAN next to its verdict).
FULL_PLAN = {"tests": ("all_reduce", "sendrecv"), "ranks": (2, 4, 8), "repeats": 3}


@dataclass
class RunSpec:
    idx: int
    collective: str
    nranks: int
    net: str
    rep: int
    extra: bool = False
    # the network's name in reports (None: the name NCCL prints for it);
    # an A/B run names its second plugin setting here
    name: Optional[str] = None

    @property
    def shown(self):
        return self.name or expected_net_name(self.net)

    @property
    def group(self):
        return (self.collective, self.nranks)

    @property
    def tag(self):
        return f"r{self.idx:02d}-{self.collective}-n{self.nranks}-{self.net}-rep{self.rep}"

    def label(self):
        return f"{self.collective} n={self.nranks} {self.shown} rep {self.rep}"


@dataclass
class RunResult:
    spec: RunSpec
    status: str                      # ok | failed | timeout | skipped
    seconds: float = 0.0
    errors: List[str] = field(default_factory=list)
    proof: str = ""
    mps_clients: str = ""            # "8/8" ranks seen as MPS clients, "" if unknown
    measurements: List[dict] = field(default_factory=list)
    timeout_s: float = 0.0
    cpu: dict = field(default_factory=dict)  # threadcpu.ThreadCpu.result(): where the CPU went


def build_plan(collectives=("all_reduce", "sendrecv"), ranks=(2, 4, 8), repeats=3,
               extras=("all_gather", "alltoall"), extra_ranks=(8,), b_name=None):
    """The run order. Repeat-major, so a budget cut leaves fewer repeats of
    everything rather than no data for some groups; within a group the two
    networks run back to back, the first alternating with the repeat.
    `b_name`: an A/B run, whose second network ("builtin") is the plugin
    again with other settings, shown under this name."""
    plan = []
    for rep in range(1, repeats + 1):
        pair = ("plugin", "builtin") if rep % 2 == 1 else ("builtin", "plugin")
        for coll in collectives:
            for n in ranks:
                for net in pair:
                    plan.append(RunSpec(len(plan) + 1, coll, n, net, rep, name=b_name if net == "builtin" else None))
    for coll in extras:
        for n in extra_ranks:
            for net in ("plugin", "builtin"):
                plan.append(RunSpec(len(plan) + 1, coll, n, net, 1, extra=True,
                                    name=b_name if net == "builtin" else None))
    return plan


def ab_name(pairs):
    """The name of an A/B run's second network: the plugin and its settings."""
    return f"{PLUGIN_NET_NAME}[{','.join(pairs)}]"


class Scheduler:
    """Decides, before each run, whether it may start and its timeout."""

    def __init__(self, budget_s, caps=None, estimates=None, min_cap=30.0, clock=time.monotonic):
        self.clock = clock
        self.deadline = clock() + budget_s
        self.caps = dict(DEFAULT_CAPS)
        self.caps.update(caps or {})
        self.estimates = dict(DEFAULT_ESTIMATES)
        self.estimates.update(estimates or {})
        self.min_cap = min_cap
        self.slowest: Dict[tuple, float] = {}     # group -> slowest successful run
        self.slowest_n: Dict[int, float] = {}     # ranks -> slowest successful run of any test
        self.dead = {}                            # (coll, n, net) -> why
        self.timeouts: Dict[str, int] = {}        # net -> runs that timed out

    def left(self):
        return self.deadline - self.clock()

    def _cap(self, n):
        return self.caps.get(n, max(self.caps.values()))

    def estimate(self, spec):
        if spec.group in self.slowest:
            return self.slowest[spec.group]
        return self.estimates.get(spec.nranks, max(self.estimates.values()))

    def decide(self, spec):
        """(timeout_s, None) to run, or (0, reason) to skip."""
        key = (spec.collective, spec.nranks, spec.net)
        if key in self.dead:
            return 0, f"skipped: an earlier repeat {self.dead[key]}"
        if self.timeouts.get(spec.net, 0) >= MAX_TIMEOUTS_PER_NET:
            return 0, (f"skipped: {self.timeouts[spec.net]} runs over {expected_net_name(spec.net)} "
                       f"timed out already (a hang that would only repeat)")
        left = self.left()
        est = self.estimate(spec)
        if left < est:
            return 0, f"skipped: budget ({left:.0f}s left, this run needs ~{est:.0f}s)"
        cap = self._cap(spec.nranks)
        seen = self.slowest.get(spec.group, self.slowest_n.get(spec.nranks))
        if seen is not None:
            cap = min(cap, max(self.min_cap, 3 * seen))
        return min(cap, left), None

    def record(self, spec, status, seconds):
        if status == "ok":
            self.slowest[spec.group] = max(self.slowest.get(spec.group, 0.0), seconds)
            self.slowest_n[spec.nranks] = max(self.slowest_n.get(spec.nranks, 0.0), seconds)
        elif status in ("failed", "timeout"):
            if status == "timeout":
                self.timeouts[spec.net] = self.timeouts.get(spec.net, 0) + 1
            self.dead[(spec.collective, spec.nranks, spec.net)] = (
                "timed out" if status == "timeout" else "failed")


def kit_paths(kit):
    kit = os.path.abspath(kit)
    return {"kit": kit, "bin": os.path.join(kit, "bin"), "rank_wrap": os.path.join(kit, "rank-wrap.sh")}


def find_kit_binary(kit, coll):
    p = os.path.join(kit_paths(kit)["bin"], COLLECTIVES[coll].binary)
    return p if os.path.isfile(p) and os.access(p, os.X_OK) else None


def run_command(args, spec, binary, rank_wrap):
    return [args.mpiexec, "-n", str(spec.nranks), rank_wrap, binary,
            "-b", str(args.min_bytes), "-e", str(args.max_bytes), "-f", str(args.step_factor),
            "-n", str(args.iters), "-w", str(args.warmup), "-c", "1", "-g", "1"]


def run_env(args, spec, plugin_dir, logdir):
    ab = bool(args.ab_env) and spec.net == "builtin"
    env = network_env("plugin" if ab else spec.net, plugin_dir, dict(os.environ), force_net=True,
                      rustnet_transport=args.rustnet_transport)
    env.update(one_host_env(args.ifname))
    env["NCCL_DEBUG_FILE"] = os.path.join(logdir, f"{spec.tag}.%h.%p.nccl.log")
    env["NCCL_TESTS_DEVICE"] = "0"
    # NCCL names its threads only when asked; threadcpu tells the proxy
    # thread from the benchmark's main thread by that name
    env["NCCL_SET_THREAD_NAME"] = "1"
    apply_overrides(env, args.env)
    if ab:
        apply_overrides(env, args.ab_env)
    return env


def mps_coverage(pids):
    """'k/n' rank pids seen as MPS clients, when MPS logs are in reach."""
    log_dir = os.environ.get("CUDA_MPS_LOG_DIRECTORY")
    if not log_dir or not pids:
        return ""
    ev = read_evidence(log_dir)
    return f"{len(pids) - len(ev.missing(pids))}/{len(pids)}"


def run_one(args, spec, binary, rank_wrap, plugin_dir, logdir, timeout_s):
    cmd = run_command(args, spec, binary, rank_wrap)
    env = run_env(args, spec, plugin_dir, logdir)
    stdout_log = os.path.join(logdir, f"{spec.tag}.stdout.log")
    for old in glob.glob(os.path.join(logdir, f"{spec.tag}.*.nccl.log")):
        os.unlink(old)
    print(f"\n== [{spec.idx}] {spec.label()} (timeout {timeout_s:.0f}s)\n   cmd: {shlex.join(cmd)}", flush=True)
    if spec.idx == 1 or args.verbose:
        print(f"   env: {describe_env(env)}", flush=True)
    t0 = time.monotonic()
    sampler = ThreadCpu(os.path.basename(binary)).start()
    try:
        (proc,) = run_group([(cmd, env, stdout_log)], timeout_s=timeout_s, fail_fast_grace=10.0)
    finally:
        cpu = sampler.stop()
    secs = time.monotonic() - t0
    text = read_text(stdout_log)
    perf = parse_perf_output(text)
    logs = [parse_nccl_log(text)]
    for path in sorted(glob.glob(os.path.join(logdir, f"{spec.tag}.*.nccl.log"))):
        logs.append(parse_nccl_log(read_text(path)))
    want = PLUGIN_NET_NAME if args.ab_env else expected_net_name(spec.net)
    expected_procs = [(r["host"], r["pid"]) for r in perf.ranks] or spec.nranks
    proof = check_network(merge_logs(*logs), want, expected_processes=expected_procs, forbid_local=True)
    errors = run_problems(perf, timed_out=proc.timed_out, rc=proc.rc, timeout_desc=f"{timeout_s:.0f}s",
                          nranks=spec.nranks, require_validation=True)
    if not proof.ok:
        errors.append("network not proven: " + "; ".join(proof.problems[:2]))
    cover = mps_coverage([r["pid"] for r in perf.ranks])
    status = "timeout" if proc.timed_out else ("failed" if errors else "ok")
    line = (f"   {status.upper()}: {len(perf.rows)} sizes in {secs:.1f}s; {proof.summary()}"
            + (f"; MPS clients {cover}" if cover else ""))
    print(line, flush=True)
    print(f"   {describe_cpu(cpu)}", flush=True)
    res = RunResult(spec, status, secs, errors, proof.summary(), cover, timeout_s=timeout_s, cpu=cpu)
    if errors:
        print(f"!! {spec.label()}: " + "; ".join(errors), flush=True)
        t = tail(stdout_log, 12)
        if t:
            print("\n".join("   | " + ln for ln in t.splitlines()), flush=True)
        return res
    for r in perf.rows:
        res.measurements.append({
            "source": "nccl-tests", "net": spec.net, "network": want, "collective": spec.collective,
            "nranks": spec.nranks, "rep": spec.rep, "size": r.size, "count": r.count,
            "time_us": r.oop_time_us, "algbw": r.oop_algbw, "busbw": r.oop_busbw, "iters": args.iters,
            "wrong": r.oop_wrong, "inplace_time_us": r.ip_time_us, "inplace_algbw": r.ip_algbw,
            "inplace_busbw": r.ip_busbw, "inplace_wrong": r.ip_wrong})
    return res


RESULT_FIELDS = ["rep"] + MEASUREMENT_FIELDS
RUN_FIELDS = ["idx", "collective", "nranks", "net", "network", "rep", "extra", "status", "seconds",
              "timeout_s", "mps_clients", "errors", "proof", "idle_pct", "cpu_total_s"] + \
    [f"cpu_{k}_s" for k in CPU_KINDS]


def cpu_fields(cpu):
    """runs.csv columns from a ThreadCpu result (empty when none was taken)."""
    if not cpu or not cpu.get("ranks"):
        return {}
    out = {k: f"{cpu[k]:.2f}" for k in ["cpu_total_s"] + [f"cpu_{k}_s" for k in CPU_KINDS]}
    out["idle_pct"] = "" if cpu.get("idle_pct") is None else f"{cpu['idle_pct']:.1f}"
    return out


def _write_csv(path, fields, rows):
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in fields})
    os.replace(tmp, path)


def write_outputs(out, results, args, elapsed):
    meas = [m for r in results for m in r.measurements]
    judged = set(args.tests)
    # the judged tests first, then the extras (each group keeps its order)
    points = sorted(aggregate(meas), key=lambda pt: pt.collective not in judged)
    v = verdict(points, collectives=args.tests, nranks=args.ranks, repeats=args.repeats,
                sizes=size_sweep(args.min_bytes, args.max_bytes, args.step_factor))
    _write_csv(os.path.join(out, "results.csv"), RESULT_FIELDS, meas)
    _write_csv(os.path.join(out, "summary.csv"), SUMMARY_FIELDS,
               summary_rows(points, goal_collectives=args.tests))
    _write_csv(os.path.join(out, "runs.csv"), RUN_FIELDS, [
        {"idx": r.spec.idx, "collective": r.spec.collective, "nranks": r.spec.nranks, "net": r.spec.net,
         "network": r.spec.shown, "rep": r.spec.rep, "extra": int(r.spec.extra),
         "status": r.status, "seconds": f"{r.seconds:.1f}", "timeout_s": f"{r.timeout_s:.0f}",
         "mps_clients": r.mps_clients, "errors": "; ".join(r.errors), "proof": r.proof,
         **cpu_fields(r.cpu)} for r in results])
    files = ["results.csv", "summary.csv", "runs.csv"]
    b = ab_name(args.ab_env) if args.ab_env else BUILTIN_NET_NAME
    title = (f"nccl-tests busbw, one GPU: {PLUGIN_NET_NAME} vs {b if args.ab_env else 'NCCL ' + b} "
             f"(median of {args.repeats}, bar = range)")
    series = plot_series(points)
    if series:
        order = []
        for pt in points:
            k = f"{pt.collective} n={pt.nranks}"
            if k not in order:
                order.append(k)
        svg_plot(os.path.join(out, "busbw.svg"), series, title, order=order)
        files.append("busbw.svg")
    text = [title, "", format_points(points, builtin=b), ""] if points else [title, "", "no measurements", ""]
    if points:
        text += [format_ratio_matrix(points, builtin=b), ""]
    ok_runs = sum(r.status == "ok" for r in results)
    text.append(f"runs: {ok_runs} ok, {sum(r.status in ('failed', 'timeout') for r in results)} failed or "
                f"timed out, {sum(r.status == 'skipped' for r in results)} skipped, of {len(results)}; "
                f"{elapsed:.0f}s")
    for r in results:
        if r.status != "ok":
            text.append(f"  {r.status}: [{r.spec.idx}] {r.spec.label()}: " + "; ".join(r.errors))
    covers = [r.mps_clients for r in results if r.mps_clients]
    if covers:
        full = sum(1 for c in covers if c.split("/")[0] == c.split("/")[1])
        text.append(f"MPS: every rank a client in {full} of {len(covers)} runs")
    cpu_rows = [(r.spec.collective, r.spec.nranks, r.spec.shown, r.cpu)
                for r in results if r.status == "ok" and r.cpu.get("ranks")]
    if cpu_rows:
        text += ["", cpu_summary_table(cpu_rows), ""]
    if args.ab_env:
        text.append(f"A/B RUN: {PLUGIN_NET_NAME} as set against {b}, interleaved; no goal verdict "
                    f"(the goal compares with NCCL's {BUILTIN_NET_NAME})")
    else:
        text.append(describe_verdict(v))
    if not args.ab_env and (list(args.tests) != list(FULL_PLAN["tests"]) or list(args.ranks) != list(FULL_PLAN["ranks"])
            or args.repeats < FULL_PLAN["repeats"]):
        text.append(f"PARTIAL PLAN: {','.join(args.tests)} at {','.join(map(str, args.ranks))} ranks, "
                    f"{args.repeats} repeat(s): the verdict above covers only that; the goal needs "
                    f"all_reduce,sendrecv at 2,4,8 ranks with 3 repeats")
    text.append("files: " + ", ".join(os.path.join(out, f) for f in files + ["report.txt"]))
    body = "\n".join(text)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(body + "\n")
    print("\n" + body, flush=True)
    return v


def parse_int_map(text, what):
    """'2:60,4:75' -> {2: 60.0, 4: 75.0}"""
    out = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        try:
            k, v = part.split(":")
            out[int(k)] = float(v)
        except ValueError:
            raise ValueError(f"{what} wants RANKS:SECONDS,..., got {part!r}")
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python3 -m ncclharness.kitbench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kit", required=True, help="the nccl-kit folder (bin/, rank-wrap.sh; source its env.sh first)")
    ap.add_argument("--plugin-dir", required=True, help="folder with librustnet.so or libnccl-net-rustnet.so")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tests", default="all_reduce,sendrecv", help="judged tests (default all_reduce,sendrecv)")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--extras", default="all_gather,alltoall", help="run once, not judged ('none' for none)")
    ap.add_argument("--extra-ranks", default="8")
    ap.add_argument("-b", "--min-bytes", default="256K")
    ap.add_argument("-e", "--max-bytes", default="64M")
    ap.add_argument("-f", "--step-factor", type=int, default=4)
    # -n 10 left the same binary's busbw 25% apart between repeats at 8 ranks
    # (an iteration of 1 MiB takes about a millisecond); -n 40 brought that to
    # about 10% for about 3 s more per 8-rank run (H200, 2026-11-30)
    ap.add_argument("-n", "--iters", type=int, default=40)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("--budget", type=float, default=420, help="seconds for all runs (default 420)")
    ap.add_argument("--caps", default="", help="hard timeout per run by ranks, e.g. 2:60,4:75,8:100")
    ap.add_argument("--estimates", default="", help="expected seconds per run by ranks, e.g. 2:8,4:12,8:20")
    ap.add_argument("--min-cap", type=float, default=30.0)
    ap.add_argument("--mpiexec", default="mpiexec")
    ap.add_argument("--ifname", default="lo")
    ap.add_argument("--rustnet-transport", default="socket", choices=["auto", "socket", "ib"])
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra variable for both networks")
    ap.add_argument("--ab-env", action="append", default=[], metavar="K=V",
                    help="an A/B run of two plugin settings: the second network is the plugin again with these "
                         "variables, in place of NCCL's Socket (interleaved the same way; no goal verdict)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.tests = parse_collectives(args.tests)
        args.extras = [] if args.extras.strip() in ("", "none") else parse_collectives(args.extras)
        args.ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
        args.extra_ranks = [int(x) for x in args.extra_ranks.split(",") if x.strip()]
        args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
        size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
        args.caps = parse_int_map(args.caps, "--caps")
        args.estimates = parse_int_map(args.estimates, "--estimates")
        if args.repeats < 1 or any(n < 2 for n in args.ranks + args.extra_ranks):
            raise ValueError("--repeats must be >= 1 and rank counts >= 2")
    except ValueError as e:
        ap.error(str(e))
    return args


def _sigterm(_signo, _frame):
    # Become an exception so run_group ends the rank processes it started.
    raise KeyboardInterrupt("SIGTERM")


def main(argv=None):
    args = parse_args(argv)
    t0 = time.monotonic()
    kp = kit_paths(args.kit)
    plan = build_plan(args.tests, args.ranks, args.repeats, args.extras, args.extra_ranks,
                      b_name=ab_name(args.ab_env) if args.ab_env else None)
    sizes = size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
    print(f"kitbench: kit {kp['kit']}; {len(plan)} runs; sizes {format_size(sizes[0])}..{format_size(sizes[-1])} "
          f"x{args.step_factor} ({len(sizes)}), -n {args.iters} -w {args.warmup} -c 1; budget {args.budget:.0f}s",
          flush=True)
    binaries = {}
    for coll in dict.fromkeys(args.tests + args.extras):
        b = find_kit_binary(args.kit, coll)
        if not b:
            print(f"error: {COLLECTIVES[coll].binary} is not an executable file in {kp['bin']} "
                  f"(kit copied without execute bits? chmod +x {kp['bin']}/*)", file=sys.stderr)
            return 2
        binaries[coll] = b
    if not os.access(kp["rank_wrap"], os.X_OK):
        print(f"error: {kp['rank_wrap']} missing or not executable", file=sys.stderr)
        return 2
    if args.dry_run:
        for s in plan:
            print(f"  [{s.idx:2d}] {s.label()}{' (extra)' if s.extra else ''}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    try:
        plugin_dir = prepare_plugin_dir(args.plugin_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logdir = os.path.join(args.out, "logs")
    os.makedirs(logdir, exist_ok=True)
    sched = Scheduler(args.budget, args.caps, args.estimates, args.min_cap)
    results = []
    old = signal.signal(signal.SIGTERM, _sigterm)
    interrupted = False
    try:
        for spec in plan:
            timeout_s, why = sched.decide(spec)
            if why:
                print(f"-- [{spec.idx}] {spec.label()}: {why}", flush=True)
                results.append(RunResult(spec, "skipped", errors=[why]))
                continue
            res = run_one(args, spec, binaries[spec.collective], kp["rank_wrap"], plugin_dir, logdir, timeout_s)
            sched.record(spec, res.status, res.seconds)
            results.append(res)
    except KeyboardInterrupt:
        interrupted = True
        print("!! interrupted: writing what was measured so far", flush=True)
    finally:
        signal.signal(signal.SIGTERM, old)
    v = write_outputs(args.out, results, args, time.monotonic() - t0)
    if interrupted or any(r.status in ("failed", "timeout") for r in results) or not v.shown:
        return 2
    if args.ab_env:
        return 0
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
