"""Side-by-side table, goal verdict, CSV files and the busbw-vs-size plot.

A measurement is a dict:
  {"source": "torch"|"nccl-tests", "net": "plugin"|"builtin",
   "network": "rustnet"|"Socket", "collective": "all_reduce", "nranks": 2,
   "size": bytes, "time_us": float, "algbw": GB/s, "busbw": GB/s, ...}
"""

import csv
import math
import os
from xml.sax.saxutils import escape

from .collectives import DEFAULT_ORDER
from .sizes import format_size, short_size

MEASUREMENT_FIELDS = ["source", "net", "network", "collective", "nranks", "size", "count",
                      "time_us", "algbw", "busbw", "iters", "wrong",
                      "inplace_time_us", "inplace_algbw", "inplace_busbw", "inplace_wrong"]
COMPARISON_FIELDS = ["collective", "size", "plugin_busbw", "builtin_busbw", "ratio",
                     "plugin_algbw", "builtin_algbw", "plugin_time_us", "builtin_time_us"]
GOAL_MIN_SIZE = 1 << 20


def _order(colls):
    known = [c for c in DEFAULT_ORDER if c in colls]
    return known + sorted(c for c in colls if c not in DEFAULT_ORDER)


def compare(measurements):
    """Pair plugin and built-in measurements by (collective, size)."""
    by = {}
    for m in measurements:
        by.setdefault((m["collective"], int(m["size"])), {})[m["net"]] = m
    rows = []
    for coll in _order({c for c, _ in by}):
        for size in sorted(s for c, s in by if c == coll):
            pair = by[(coll, size)]
            p, b = pair.get("plugin"), pair.get("builtin")
            row = {"collective": coll, "size": size,
                   "plugin_busbw": p["busbw"] if p else None,
                   "builtin_busbw": b["busbw"] if b else None,
                   "plugin_algbw": p["algbw"] if p else None,
                   "builtin_algbw": b["algbw"] if b else None,
                   "plugin_time_us": p["time_us"] if p else None,
                   "builtin_time_us": b["time_us"] if b else None,
                   "ratio": None}
            if p and b and b["busbw"] > 0:
                row["ratio"] = p["busbw"] / b["busbw"]
            rows.append(row)
    return rows


def verdict(rows, min_size=GOAL_MIN_SIZE):
    """The goal: plugin busbw >= built-in busbw at every size >= min_size, for
    every collective measured. A size measured by only one side counts as not
    met (nothing to compare is not a pass)."""
    checked, below, missing = 0, [], []
    worst = None
    for r in rows:
        if r["size"] < min_size:
            continue
        if r["plugin_busbw"] is None or r["builtin_busbw"] is None:
            missing.append((r["collective"], r["size"]))
            continue
        checked += 1
        ratio = r["ratio"] if r["ratio"] is not None else (math.inf if r["plugin_busbw"] > 0 else 1.0)
        if worst is None or ratio < worst[2]:
            worst = (r["collective"], r["size"], ratio)
        if r["plugin_busbw"] < r["builtin_busbw"]:
            below.append((r["collective"], r["size"], r["plugin_busbw"], r["builtin_busbw"], ratio))
    ok = checked > 0 and not below and not missing
    return {"ok": ok, "checked": checked, "below": below, "missing": missing, "worst": worst,
            "min_size": min_size}


def describe_verdict(v, plugin="rustnet", builtin="Socket"):
    goal = f"busbw through {plugin} >= {builtin} at every size >= {format_size(v['min_size'])}"
    lines = []
    if v["ok"]:
        lines.append(f"GOAL MET: {goal} ({v['checked']} collective/size points)")
    elif v["checked"] == 0:
        lines.append(f"GOAL NOT SHOWN: {goal}: no size >= {format_size(v['min_size'])} measured on both")
    else:
        lines.append(f"GOAL NOT MET: {goal}: {len(v['below'])} of {v['checked']} points below"
                     + (f", {len(v['missing'])} missing" if v["missing"] else ""))
        for coll, size, p, b, ratio in v["below"]:
            lines.append(f"  below: {coll:<15} {format_size(size):>9}  {p:8.3f} < {b:8.3f} GB/s  ({ratio:.3f}x)")
        for coll, size in v["missing"]:
            lines.append(f"  missing: {coll:<13} {format_size(size):>9} (measured on one side only)")
    if v["worst"]:
        coll, size, ratio = v["worst"]
        lines.append(f"  lowest ratio {plugin}/{builtin}: {ratio:.3f} ({coll}, {format_size(size)})")
    return "\n".join(lines)


def _f(v, fmt="{:8.3f}"):
    return fmt.format(v) if v is not None else f"{'-':>8}"


def format_table(rows, plugin="rustnet", builtin="Socket", title=None):
    out = []
    if title:
        out.append(title)
    for coll in _order({r["collective"] for r in rows}):
        out.append("")
        out.append(f"{coll}: busbw (GB/s)")
        out.append(f"{'size':>10}  {plugin:>10}  {builtin:>10}  {'ratio':>7}  "
                   f"{'t ' + plugin + ' (us)':>16}  {'t ' + builtin + ' (us)':>16}")
        for r in rows:
            if r["collective"] != coll:
                continue
            ratio = f"{r['ratio']:7.3f}" if r["ratio"] is not None else f"{'-':>7}"
            mark = ""
            if r["ratio"] is not None and r["size"] >= GOAL_MIN_SIZE and r["ratio"] < 1.0:
                mark = "  <"
            out.append(f"{format_size(r['size']):>10}  {_f(r['plugin_busbw'], '{:10.3f}'):>10}  "
                       f"{_f(r['builtin_busbw'], '{:10.3f}'):>10}  {ratio}  "
                       f"{_f(r['plugin_time_us'], '{:16.1f}'):>16}  {_f(r['builtin_time_us'], '{:16.1f}'):>16}{mark}")
    return "\n".join(out)


def format_ratio_matrix(rows, plugin="rustnet", builtin="Socket"):
    """Compact view: one line per size, one column per collective, the
    busbw ratio plugin/built-in ('<' marks a point below the goal)."""
    colls = _order({r["collective"] for r in rows})
    sizes = sorted({r["size"] for r in rows})
    by = {(r["collective"], r["size"]): r for r in rows}
    out = [f"busbw ratio {plugin}/{builtin}", f"{'size':>10}" + "".join(f"  {c:>14}" for c in colls)]
    for size in sizes:
        cells = []
        for c in colls:
            r = by.get((c, size))
            if r is None or r["ratio"] is None:
                cells.append(f"  {'-':>14}")
            else:
                mark = "<" if size >= GOAL_MIN_SIZE and r["ratio"] < 1.0 else " "
                cells.append(f"  {r['ratio']:13.3f}{mark}")
        out.append(f"{format_size(size):>10}" + "".join(cells))
    return "\n".join(out)


def write_measurements_csv(path, measurements):
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=MEASUREMENT_FIELDS, extrasaction="ignore")
        w.writeheader()
        for m in measurements:
            w.writerow({k: m.get(k, "") if m.get(k) is not None else "" for k in MEASUREMENT_FIELDS})
    os.replace(tmp, path)


def write_comparison_csv(path, rows):
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COMPARISON_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in COMPARISON_FIELDS})
    os.replace(tmp, path)


def read_measurements_csv(path):
    out = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            m = {}
            for k, v in rec.items():
                if v == "" or v is None:
                    m[k] = None
                elif k in ("size", "count", "nranks", "iters", "wrong", "inplace_wrong"):
                    m[k] = int(float(v))
                elif k in ("time_us", "algbw", "busbw", "inplace_time_us", "inplace_algbw", "inplace_busbw"):
                    m[k] = float(v)
                else:
                    m[k] = v
            out.append(m)
    return out


# ---------------------------------------------------------------- plotting

_STYLE = {"plugin": {"color": "#c0392b", "dash": "", "marker": "circle"},
          "builtin": {"color": "#2c3e50", "dash": "6,4", "marker": "square"}}


def _nice_step(span, target=5):
    if span <= 0:
        return 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _series(measurements):
    """{collective: {net: [(size, busbw), ...]}}"""
    out = {}
    for m in measurements:
        if m.get("busbw") is None:
            continue
        out.setdefault(m["collective"], {}).setdefault(m["net"], []).append((int(m["size"]), float(m["busbw"])))
    for nets in out.values():
        for pts in nets.values():
            pts.sort()
    return out


def _ranges(measurements):
    """{(collective, net, size): (lo, hi)} for measurements that carry a
    range (busbw_lo/busbw_hi: repeated runs, busbw being their median)."""
    out = {}
    for m in measurements:
        if m.get("busbw_lo") is not None and m.get("busbw_hi") is not None:
            out[(m["collective"], m["net"], int(m["size"]))] = (float(m["busbw_lo"]), float(m["busbw_hi"]))
    return out


def svg_plot(path, measurements, title, labels=None, goal_min_size=GOAL_MIN_SIZE, order=None):
    """busbw (y, linear) against size (x, log2), one panel per collective
    (or per `order` entry, in that order). A measurement with busbw_lo and
    busbw_hi gets a vertical bar for that range around its point.
    Written by hand so no plotting library is needed."""
    labels = labels or {"plugin": "rustnet", "builtin": "Socket"}
    series = _series(measurements)
    ranges = _ranges(measurements)
    colls = [c for c in order if c in series] if order else _order(series.keys())
    if not colls:
        raise ValueError("nothing to plot")
    ncols = min(3, len(colls))
    nrows = math.ceil(len(colls) / ncols)
    pw, ph = 420, 300              # panel size
    ml, mr, mt, mb = 62, 24, 30, 46  # panel margins
    top = 64
    width, height = ncols * pw, top + nrows * ph + 10
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
          f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
          f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
          f'<text x="{width / 2:.1f}" y="22" text-anchor="middle" font-size="16" font-weight="bold">'
          f'{escape(title)}</text>']
    # legend
    lx = width / 2 - 150
    for i, net in enumerate(("plugin", "builtin")):
        st = _STYLE[net]
        x = lx + i * 170
        dash = f' stroke-dasharray="{st["dash"]}"' if st["dash"] else ""
        el.append(f'<line x1="{x:.1f}" y1="42" x2="{x + 30:.1f}" y2="42" stroke="{st["color"]}" stroke-width="2"{dash}/>')
        el.append(_marker(st["marker"], x + 15, 42, st["color"]))
        el.append(f'<text x="{x + 38:.1f}" y="46">{escape(labels[net])} busbw</text>')
    for idx, coll in enumerate(colls):
        ox = (idx % ncols) * pw
        oy = top + (idx // ncols) * ph
        x0, x1 = ox + ml, ox + pw - mr
        y0, y1 = oy + ph - mb, oy + mt   # y0 bottom, y1 top
        pts_all = [pt for pts in series[coll].values() for pt in pts]
        sizes = sorted({s for s, _ in pts_all})
        lo, hi = math.log2(sizes[0]), math.log2(sizes[-1])
        if hi == lo:
            lo, hi = lo - 1, hi + 1
        ymax = max([v for _, v in pts_all] + [hi for (c, _n, _s), (_lo, hi) in ranges.items() if c == coll])
        step = _nice_step(ymax if ymax > 0 else 1.0)
        ytop = step * max(1, math.ceil((ymax if ymax > 0 else 1.0) / step))

        def X(s):
            return x0 + (math.log2(s) - lo) / (hi - lo) * (x1 - x0)

        def Y(v):
            return y0 - v / ytop * (y0 - y1)

        el.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{oy + 18:.1f}" text-anchor="middle" font-weight="bold">'
                  f'{escape(coll)}</text>')
        # grid and y ticks
        v = 0.0
        while v <= ytop + 1e-9:
            y = Y(v)
            el.append(f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
            el.append(f'<text x="{x0 - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">{_tick(v, step)}</text>')
            v += step
        # x ticks: every power of two if few, else every other one
        every = 1 if len(sizes) <= 11 else 2
        lo_i, hi_i = math.ceil(lo), math.floor(hi)
        for i in range(lo_i, hi_i + 1):
            x = X(2 ** i)
            el.append(f'<line x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y0 + 4:.1f}" stroke="#333"/>')
            if (i - lo_i) % every == 0:
                el.append(f'<text x="{x:.1f}" y="{y0 + 17:.1f}" text-anchor="middle" font-size="10">'
                          f'{short_size(2 ** i)}</text>')
        if goal_min_size and sizes[0] <= goal_min_size <= sizes[-1]:
            gx = X(goal_min_size)
            el.append(f'<line x1="{gx:.1f}" y1="{y0:.1f}" x2="{gx:.1f}" y2="{y1:.1f}" stroke="#999" '
                      f'stroke-dasharray="2,3"/>')
            el.append(f'<text x="{gx + 3:.1f}" y="{y1 + 10:.1f}" font-size="9" fill="#777">'
                      f'goal from {short_size(goal_min_size)}</text>')
        el.append(f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y0:.1f}" stroke="#333"/>')
        el.append(f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x0:.1f}" y2="{y1:.1f}" stroke="#333"/>')
        el.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y0 + 36:.1f}" text-anchor="middle">message size (bytes)</text>')
        el.append(f'<text x="{ox + 16:.1f}" y="{(y0 + y1) / 2:.1f}" text-anchor="middle" '
                  f'transform="rotate(-90 {ox + 16:.1f} {(y0 + y1) / 2:.1f})">busbw (GB/s)</text>')
        for net in ("builtin", "plugin"):
            pts = series[coll].get(net)
            if not pts:
                continue
            st = _STYLE[net]
            dash = f' stroke-dasharray="{st["dash"]}"' if st["dash"] else ""
            poly = " ".join(f"{X(s):.1f},{Y(b):.1f}" for s, b in pts)
            el.append(f'<polyline points="{poly}" fill="none" stroke="{st["color"]}" stroke-width="2"{dash}/>')
            for s, b in pts:
                rng = ranges.get((coll, net, s))
                if rng:
                    dx = 3 if net == "plugin" else -3   # side by side, not on top of each other
                    el.append(f'<line class="range" x1="{X(s) + dx:.1f}" y1="{Y(rng[0]):.1f}" '
                              f'x2="{X(s) + dx:.1f}" y2="{Y(rng[1]):.1f}" stroke="{st["color"]}" '
                              f'stroke-width="1.5" opacity="0.7"/>')
                el.append(_marker(st["marker"], X(s), Y(b), st["color"],
                                  tip=f"{labels[net]} {format_size(s)}: {b:.3f} GB/s"))
    el.append("</svg>")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(el) + "\n")
    os.replace(tmp, path)
    return path


def _tick(v, step):
    """Label with as many decimals as the tick step needs (0.25 -> 2)."""
    for d in range(0, 5):
        if abs(round(step, d) - step) <= 1e-9 * max(1.0, step):
            return f"{v:.{d}f}"
    return f"{v:.4f}"


def _marker(kind, x, y, color, tip=None):
    t = f"<title>{escape(tip)}</title>" if tip else ""
    if kind == "square":
        return (f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" fill="white" '
                f'stroke="{color}" stroke-width="1.5">{t}</rect>')
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.2" fill="{color}">{t}</circle>'


def png_plot(path, measurements, title, labels=None):
    """The same plot through matplotlib, if it is importable. Returns the path
    or None (never raises for a missing matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    labels = labels or {"plugin": "rustnet", "builtin": "Socket"}
    series = _series(measurements)
    colls = _order(series.keys())
    ncols = min(3, len(colls))
    nrows = math.ceil(len(colls) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.8 * ncols, 3.6 * nrows), squeeze=False)
    for idx, coll in enumerate(colls):
        ax = axes[idx // ncols][idx % ncols]
        for net in ("plugin", "builtin"):
            pts = series[coll].get(net)
            if not pts:
                continue
            st = _STYLE[net]
            ax.plot([s for s, _ in pts], [b for _, b in pts], color=st["color"],
                    linestyle="--" if st["dash"] else "-", marker="s" if st["marker"] == "square" else "o",
                    markersize=3, label=labels[net])
        ax.set_xscale("log", base=2)
        ax.set_title(coll)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for idx in range(len(colls), nrows * ncols):
        axes[idx // ncols][idx % ncols].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(outdir, measurements, title, proofs=(), min_size=GOAL_MIN_SIZE,
                 labels=None, stem="busbw", echo=True):
    """Print the table and verdict, write results.csv, comparison.csv,
    <stem>.svg (+ .png) and report.txt into outdir. Returns the verdict."""
    labels = labels or {"plugin": "rustnet", "builtin": "Socket"}
    os.makedirs(outdir, exist_ok=True)
    rows = compare(measurements)
    v = verdict(rows, min_size)
    text = [format_table(rows, labels["plugin"], labels["builtin"], title), ""]
    if rows:
        text += [format_ratio_matrix(rows, labels["plugin"], labels["builtin"]), ""]
    for p in proofs:
        text.append(p)
    text.append(describe_verdict(v, labels["plugin"], labels["builtin"]))
    files = []
    write_measurements_csv(os.path.join(outdir, "results.csv"), measurements)
    files.append("results.csv")
    write_comparison_csv(os.path.join(outdir, "comparison.csv"), rows)
    files.append("comparison.csv")
    if any(m.get("busbw") is not None for m in measurements):
        svg_plot(os.path.join(outdir, stem + ".svg"), measurements, title, labels, min_size)
        files.append(stem + ".svg")
        if png_plot(os.path.join(outdir, stem + ".png"), measurements, title, labels):
            files.append(stem + ".png")
    text.append("files: " + ", ".join(os.path.join(outdir, f) for f in files + ["report.txt"]))
    body = "\n".join(text)
    with open(os.path.join(outdir, "report.txt"), "w") as f:
        f.write(body + "\n")
    if echo:
        print(body, flush=True)
    v["rows"] = rows
    return v
