"""Repeated, interleaved runs: median and range per point, and the verdict.

A single one-GPU run is noisy (sendrecv moved between 0.84x and 1.57x from
run to run of the same build), so every point is measured several times,
the two networks taking turns, and judged on the median.

A measurement here is a dict like report.py's, plus "rep" (1, 2, 3...):
  {"net": "plugin"|"builtin", "collective": "all_reduce", "nranks": 8,
   "size": bytes, "busbw": GB/s, "rep": 1, ...}
A point is (collective, nranks, size).
"""

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .collectives import DEFAULT_ORDER
from .sizes import format_size

GOAL_MIN_SIZE = 1 << 20
STRETCH_MIN_SIZE = 16 << 20
STRETCH_RATIO = 1.2


@dataclass
class Spread:
    """Median, range and the values (in repeat order) of one side of a point."""
    values: List[float]
    reps: List[int]

    @property
    def n(self):
        return len(self.values)

    @property
    def median(self):
        return statistics.median(self.values) if self.values else None

    @property
    def lo(self):
        return min(self.values) if self.values else None

    @property
    def hi(self):
        return max(self.values) if self.values else None


@dataclass
class Point:
    collective: str
    nranks: int
    size: int
    plugin: Spread
    builtin: Spread
    paired: List[float] = field(default_factory=list)   # per-repeat plugin/builtin

    @property
    def ratio(self):
        """Ratio of the medians (what the verdict uses)."""
        p, b = self.plugin.median, self.builtin.median
        if p is None or b is None or b <= 0:
            return None
        return p / b

    @property
    def key(self):
        return (self.collective, self.nranks, self.size)


def spread_of(values_by_rep):
    reps = sorted(values_by_rep)
    return Spread(values=[values_by_rep[r] for r in reps], reps=reps)


def aggregate(measurements):
    """Group measurements into points, sorted by collective, ranks, size."""
    by: Dict[Tuple[str, int, int], Dict[str, Dict[int, float]]] = {}
    for m in measurements:
        if m.get("busbw") is None:
            continue
        key = (m["collective"], int(m["nranks"]), int(m["size"]))
        by.setdefault(key, {}).setdefault(m["net"], {})[int(m.get("rep") or 1)] = float(m["busbw"])
    order = {c: i for i, c in enumerate(DEFAULT_ORDER)}
    points = []
    for key in sorted(by, key=lambda k: (order.get(k[0], 99), k[0], k[1], k[2])):
        sides = by[key]
        p, b = sides.get("plugin", {}), sides.get("builtin", {})
        paired = [p[r] / b[r] for r in sorted(set(p) & set(b)) if b[r] > 0]
        points.append(Point(key[0], key[1], key[2], spread_of(p), spread_of(b), paired))
    return points


@dataclass
class Verdict:
    ok: bool
    checked: int
    below: List[Point]
    incomplete: List[Tuple[Tuple[str, int, int], str]]   # (point key or group, why)
    worst: Optional[Point]
    stretch_ok: bool
    stretch_checked: int
    stretch_below: List[Point]
    min_size: int
    repeats: int

    @property
    def shown(self):
        return self.checked > 0 and not self.incomplete


def verdict(points, collectives=("all_reduce", "sendrecv"), nranks=(2, 4, 8), repeats=3,
            min_size=GOAL_MIN_SIZE, stretch_min_size=STRETCH_MIN_SIZE, stretch_ratio=STRETCH_RATIO,
            sizes=None):
    """The goal: for every collective in `collectives` at every rank count in
    `nranks`, median plugin busbw >= median built-in busbw at every size >=
    min_size. A point needs `repeats` values on both sides; fewer (a failed,
    refused or skipped run) makes the verdict incomplete, never a pass.
    `sizes`: the sizes the plan asked for (so a group with no data at all is
    reported as missing, not silently passed)."""
    want = {(c, n) for c in collectives for n in nranks}
    mine = [pt for pt in points if (pt.collective, pt.nranks) in want and pt.size >= min_size]
    incomplete = []
    have_groups = {(pt.collective, pt.nranks) for pt in mine}
    for c, n in sorted(want - have_groups):
        incomplete.append(((c, n, 0), "no measurement >= " + format_size(min_size)))
    if sizes:
        need = [s for s in sizes if s >= min_size]
        present = {pt.key for pt in mine}
        for c, n in sorted(want & have_groups):
            for s in need:
                if (c, n, s) not in present:
                    incomplete.append(((c, n, s), "not measured"))
    checked, below, worst = 0, [], None
    for pt in mine:
        if pt.plugin.n < repeats or pt.builtin.n < repeats:
            incomplete.append((pt.key, f"{pt.plugin.n} plugin / {pt.builtin.n} built-in value(s) "
                                       f"of {repeats}"))
            continue
        checked += 1
        r = pt.ratio if pt.ratio is not None else float("inf")
        if worst is None or r < (worst.ratio if worst.ratio is not None else float("inf")):
            worst = pt
        if pt.plugin.median < pt.builtin.median:
            below.append(pt)
    st = [pt for pt in mine if pt.size >= stretch_min_size and pt.plugin.n >= repeats
          and pt.builtin.n >= repeats]
    st_below = [pt for pt in st if pt.ratio is None or pt.ratio < stretch_ratio]
    ok = checked > 0 and not below and not incomplete
    return Verdict(ok=ok, checked=checked, below=below, incomplete=incomplete, worst=worst,
                   stretch_ok=bool(st) and not st_below, stretch_checked=len(st),
                   stretch_below=st_below, min_size=min_size, repeats=repeats)


def describe_verdict(v, plugin="rustnet", builtin="Socket"):
    goal = (f"median busbw {plugin} >= {builtin} at every size >= {format_size(v.min_size)} "
            f"({v.repeats} interleaved repeats)")
    lines = []
    if v.ok:
        lines.append(f"GOAL MET: {goal}: {v.checked} points")
    elif v.checked == 0 or (v.incomplete and not v.below):
        lines.append(f"GOAL NOT SHOWN: {goal}: {len(v.incomplete)} point(s) incomplete"
                     + (f", {v.checked} complete and none below" if v.checked else ""))
    else:
        lines.append(f"GOAL NOT MET: {goal}: {len(v.below)} of {v.checked} points below"
                     + (f", {len(v.incomplete)} incomplete" if v.incomplete else ""))
    for pt in v.below:
        lines.append(f"  below: {pt.collective:<11} n={pt.nranks} {format_size(pt.size):>9}  "
                     f"median {pt.plugin.median:.3f} < {pt.builtin.median:.3f} GB/s ({pt.ratio:.3f}x)")
    for (c, n, s), why in v.incomplete:
        where = format_size(s) if s else "all sizes"
        lines.append(f"  incomplete: {c:<11} n={n} {where:>9}  {why}")
    if v.worst is not None and v.worst.ratio is not None:
        w = v.worst
        lines.append(f"  lowest median ratio {plugin}/{builtin}: {w.ratio:.3f} "
                     f"({w.collective}, n={w.nranks}, {format_size(w.size)})")
    if v.stretch_checked:
        tag = "STRETCH MET" if v.stretch_ok else "STRETCH NOT MET"
        lines.append(f"{tag}: median ratio >= {STRETCH_RATIO:.1f}x at every size >= "
                     f"{format_size(STRETCH_MIN_SIZE)}: {v.stretch_checked - len(v.stretch_below)} of "
                     f"{v.stretch_checked} points")
    else:
        lines.append(f"STRETCH NOT SHOWN: no complete point >= {format_size(STRETCH_MIN_SIZE)}")
    return "\n".join(lines)


def _fmt(v, w=7, d=3):
    return f"{v:{w}.{d}f}" if v is not None else f"{'-':>{w}}"


def _range(s):
    if not s.n:
        return f"{'-':>13}"
    return f"{s.lo:6.3f}-{s.hi:<6.3f}"


def _groups(points):
    """The (collective, ranks) pairs of `points`, in first-seen order."""
    return list(dict.fromkeys((pt.collective, pt.nranks) for pt in points))


def format_points(points, plugin="rustnet", builtin="Socket", min_size=GOAL_MIN_SIZE):
    """One table per (collective, ranks): median and range for both networks,
    ratio of medians and the range of the per-repeat ratios."""
    out = []
    groups = _groups(points)
    for c, n in groups:
        out.append("")
        out.append(f"{c}, {n} ranks: busbw GB/s, median [min-max] over repeats (n = values)")
        out.append(f"{'size':>10}  {plugin + ' median':>15} {'range':>13} {'n':>2}  "
                   f"{builtin + ' median':>14} {'range':>13} {'n':>2}  {'ratio':>6} {'per-repeat':>13}")
        for pt in points:
            if (pt.collective, pt.nranks) != (c, n):
                continue
            mark = "  <" if pt.size >= min_size and pt.ratio is not None and pt.ratio < 1.0 else ""
            pr = (f"{min(pt.paired):6.3f}-{max(pt.paired):<6.3f}" if pt.paired else f"{'-':>13}")
            out.append(f"{format_size(pt.size):>10}  {_fmt(pt.plugin.median, 15)} {_range(pt.plugin)} "
                       f"{pt.plugin.n:>2}  {_fmt(pt.builtin.median, 14)} {_range(pt.builtin)} "
                       f"{pt.builtin.n:>2}  {_fmt(pt.ratio, 6)} {pr}{mark}")
    return "\n".join(out).lstrip("\n")


def format_ratio_matrix(points, plugin="rustnet", builtin="Socket", min_size=GOAL_MIN_SIZE):
    """Sizes down, (collective, ranks) across: the ratio of the medians."""
    groups = _groups(points)
    sizes = sorted({pt.size for pt in points})
    by = {pt.key: pt for pt in points}
    heads = [f"{c} n={n}" for c, n in groups]
    width = max([14] + [len(h) for h in heads])
    out = [f"median busbw ratio {plugin}/{builtin} ('<' below 1 at >= {format_size(min_size)})",
           f"{'size':>10}" + "".join(f"  {h:>{width}}" for h in heads)]
    for s in sizes:
        cells = []
        for c, n in groups:
            pt = by.get((c, n, s))
            if pt is None or pt.ratio is None:
                cells.append(f"  {'-':>{width}}")
            else:
                mark = "<" if s >= min_size and pt.ratio < 1.0 else " "
                cells.append(f"  {pt.ratio:{width - 1}.3f}{mark}")
        out.append(f"{format_size(s):>10}" + "".join(cells))
    return "\n".join(out)


SUMMARY_FIELDS = ["collective", "nranks", "size", "plugin_median", "plugin_min", "plugin_max", "plugin_n",
                  "builtin_median", "builtin_min", "builtin_max", "builtin_n", "ratio_of_medians",
                  "ratio_min", "ratio_max", "goal_point", "below_goal"]


def summary_rows(points, min_size=GOAL_MIN_SIZE, goal_collectives=("all_reduce", "sendrecv")):
    rows = []
    for pt in points:
        goal = pt.size >= min_size and pt.collective in goal_collectives
        rows.append({"collective": pt.collective, "nranks": pt.nranks, "size": pt.size,
                     "plugin_median": pt.plugin.median, "plugin_min": pt.plugin.lo,
                     "plugin_max": pt.plugin.hi, "plugin_n": pt.plugin.n,
                     "builtin_median": pt.builtin.median, "builtin_min": pt.builtin.lo,
                     "builtin_max": pt.builtin.hi, "builtin_n": pt.builtin.n,
                     "ratio_of_medians": pt.ratio,
                     "ratio_min": min(pt.paired) if pt.paired else None,
                     "ratio_max": max(pt.paired) if pt.paired else None,
                     "goal_point": int(goal),
                     "below_goal": int(goal and pt.ratio is not None and pt.ratio < 1.0)})
    return rows


def plot_series(points):
    """Measurements for report.svg_plot: one panel per (collective, ranks),
    the median as the line and the range as a bar."""
    out = []
    for pt in points:
        for net, s in (("plugin", pt.plugin), ("builtin", pt.builtin)):
            if s.n:
                out.append({"collective": f"{pt.collective} n={pt.nranks}", "net": net, "size": pt.size,
                            "busbw": s.median, "busbw_lo": s.lo, "busbw_hi": s.hi})
    return out
