"""The size sweep loop of torch_sweep.py, written against a small `ops`
interface so it can be tested without torch or a GPU.

ops must provide:
  prepare(coll, size) -> (reported_bytes, run, check) or None if the size is
      too small for this many ranks; run() launches one collective,
      check() fills a known pattern, runs once and returns True if every
      received byte is what it must be
  sync()                  wait for the GPU
  agree_max(values)       element-wise max over all ranks (list of floats)
  agree_sum(values)       element-wise sum over all ranks
  barrier()

Every decision that changes how many collectives a rank issues (iteration
counts, skipping for time) is taken from values agreed over all ranks, so
the ranks never disagree about what comes next.
"""

import math
import time

from .collectives import COLLECTIVES, algbw_gbps, busbw_gbps


class SweepOptions:
    def __init__(self, warmup=1, min_iters=2, max_iters=100, target_s=0.2, budget_s=None, check=True):
        self.warmup = warmup
        self.min_iters = min_iters
        self.max_iters = max_iters
        self.target_s = target_s
        self.budget_s = budget_s
        self.check = check


def choose_iters(op_seconds, opts):
    if op_seconds <= 0:
        return opts.max_iters
    return int(min(opts.max_iters, max(opts.min_iters, math.ceil(opts.target_s / op_seconds))))


def estimate_seconds(prev_op_seconds, prev_size, size, opts):
    """Rough cost of measuring `size` from the op time at the previous size
    (bandwidth-bound: time grows with size)."""
    if prev_op_seconds is None:
        return 0.0
    t = prev_op_seconds * max(1.0, size / prev_size)
    ops = (1 if opts.check else 0) + opts.warmup
    return t * ops + max(opts.target_s, opts.min_iters * t)


def run_sweep(ops, colls, sizes, nranks, opts, clock=time.perf_counter, log=None, source="torch",
              net=None, network=None):
    """Returns (measurements, skipped, errors)."""
    measurements, skipped, errors = [], [], []
    start = clock()
    for ci, coll in enumerate(colls):
        # Cumulative budget: collective ci must be done by budget*(ci+1)/n, so
        # time one collective leaves unused goes to the next.
        coll_end = None if opts.budget_s is None else start + opts.budget_s * (ci + 1) / len(colls)
        prev_t, prev_size = None, None
        out_of_time = False
        for size in sizes:
            if out_of_time:
                skipped.append({"collective": coll, "size": size, "why": "time budget"})
                continue
            if coll_end is not None and prev_t is not None:
                late = clock() + estimate_seconds(prev_t, prev_size, size, opts) > coll_end
                if ops.agree_max([1.0 if late else 0.0])[0] > 0:
                    out_of_time = True
                    skipped.append({"collective": coll, "size": size, "why": "time budget"})
                    continue
            prep = ops.prepare(coll, size)
            if prep is None:
                skipped.append({"collective": coll, "size": size, "why": f"too small for {nranks} ranks"})
                continue
            reported, run, check = prep
            if opts.check:
                good = check()
                bad = ops.agree_max([0.0 if good else 1.0])[0]
                if bad > 0:
                    errors.append(f"{coll} at {reported} bytes: received data differs from what was sent "
                                  f"(on {'this rank' if not good else 'another rank'})")
                    break
            t0 = clock()
            for _ in range(opts.warmup):
                run()
            ops.sync()
            warm = (clock() - t0) / max(1, opts.warmup) if opts.warmup else None
            if warm is None:
                t0 = clock()
                run()
                ops.sync()
                warm = clock() - t0
            warm = ops.agree_max([warm])[0]
            iters = choose_iters(warm, opts)
            ops.barrier()
            t0 = clock()
            for _ in range(iters):
                run()
            ops.sync()
            per_op = (clock() - t0) / iters
            # nccl-tests' default (-a 1) reports the time averaged over ranks.
            per_op = ops.agree_sum([per_op])[0] / nranks
            prev_t, prev_size = per_op, size
            m = {"source": source, "net": net, "network": network, "collective": coll, "nranks": nranks,
                 "size": reported, "requested_size": size, "time_us": per_op * 1e6,
                 "algbw": algbw_gbps(reported, per_op), "busbw": busbw_gbps(coll, reported, per_op, nranks),
                 "iters": iters}
            measurements.append(m)
            if log:
                log(f"{coll:>15} {reported:>12} B  {per_op * 1e6:12.1f} us  algbw {m['algbw']:8.3f}  "
                    f"busbw {m['busbw']:8.3f} GB/s  ({iters} iters)")
    return measurements, skipped, errors


def check_patterns():
    """Which values the correctness check puts in and expects back, in words
    (the torch code implements exactly this). p[i] = i mod 251, r = rank,
    n = ranks; all values are small integers, exact in fp32."""
    return {
        "all_reduce": "in: p + 1000(r+1); out: n*p + 1000*n(n+1)/2",
        "all_gather": "in: p + 1000(r+1); out chunk j: p + 1000(j+1)",
        "reduce_scatter": "in: P + 1000(r+1) over all n chunks; out: n*P[chunk r] + 1000*n(n+1)/2",
        "alltoall": "in chunk j: p + 1000(r+1) + 100j; out chunk j: p + 1000(j+1) + 100r",
        "sendrecv": "send p + 1000(r+1) to r+1; receive p + 1000(((r-1) mod n)+1) from r-1",
    }


assert set(check_patterns()) == set(COLLECTIVES)
