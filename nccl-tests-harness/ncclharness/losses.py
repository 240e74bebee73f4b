"""Step-by-step comparison of training losses from two runs.

Tolerances (used by ddp_check.py, stated here once):

- plugin vs built-in network: rtol 1e-5, atol 1e-6. The two runs execute the
  same kernels on the same data; only the network moving the gradient bytes
  differs. With 2 ranks every gradient reduction is one IEEE addition a+b,
  which is commutative, so the runs are expected to be bitwise identical and
  the report says whether they are. More ranks may let NCCL pick a different
  algorithm or chunking on each network (its tuning reads the network's
  reported speed), i.e. a different summation order: fp32 rounding of
  ~6e-8 relative per addition, which over a few dozen SGD steps of a small
  MLP stays orders of magnitude below 1e-5. A transport fault (a lost,
  duplicated, stale or misplaced chunk) perturbs whole gradient blocks and
  shows up as a difference >= 1e-3 within a step or two, or as NaN.
- each network vs a single-process reference that averages the per-rank
  gradients itself (no NCCL): rtol 1e-3, atol 1e-5, because the reference
  sums gradients in a different order and its rounding drifts with the
  steps; it proves both runs train correctly, not just alike.
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional

NET_RTOL, NET_ATOL = 1e-5, 1e-6
REF_RTOL, REF_ATOL = 1e-3, 1e-5


@dataclass
class LossComparison:
    ok: bool
    steps: int
    bitwise_equal: bool
    max_abs: float
    max_rel: float
    first_bad_step: Optional[int]
    problems: List[str] = field(default_factory=list)

    def describe(self, a_name, b_name, rtol, atol):
        head = (f"{a_name} vs {b_name}: {'MATCH' if self.ok else 'MISMATCH'} over {self.steps} steps "
                f"(rtol {rtol:g}, atol {atol:g}; max |diff| {self.max_abs:.3g}, max rel {self.max_rel:.3g}; "
                f"bitwise identical: {'yes' if self.bitwise_equal else 'no'})")
        return "\n".join([head] + [f"  - {p}" for p in self.problems])


def compare_losses(a, b, rtol=NET_RTOL, atol=NET_ATOL, max_report=5):
    """a, b: sequences of per-step losses (floats). Equal length required;
    every step must satisfy |a-b| <= atol + rtol*|b|; NaN/inf never match."""
    problems = []
    if len(a) != len(b):
        problems.append(f"different number of steps: {len(a)} vs {len(b)}")
    n = min(len(a), len(b))
    if n == 0:
        problems.append("no steps to compare")
        return LossComparison(False, 0, False, math.inf, math.inf, None, problems)
    max_abs = max_rel = 0.0
    first_bad = None
    bitwise = len(a) == len(b)
    for i in range(n):
        x, y = float(a[i]), float(b[i])
        if x != y or (math.isnan(x) or math.isnan(y)):
            bitwise = False
        if not (math.isfinite(x) and math.isfinite(y)):
            if first_bad is None:
                first_bad = i
            if len(problems) < max_report:
                problems.append(f"step {i}: non-finite loss ({x!r} vs {y!r})")
            max_abs = max_rel = math.inf
            continue
        d = abs(x - y)
        rel = d / abs(y) if y != 0 else (0.0 if d == 0 else math.inf)
        max_abs, max_rel = max(max_abs, d), max(max_rel, rel)
        if d > atol + rtol * abs(y):
            if first_bad is None:
                first_bad = i
            if len(problems) < max_report:
                problems.append(f"step {i}: {x!r} vs {y!r} (|diff| {d:.3g} > {atol:g} + {rtol:g}*|{y:.6g}|)")
    ok = not problems
    return LossComparison(ok, n, bitwise and ok, max_abs, max_rel, first_bad, problems)
