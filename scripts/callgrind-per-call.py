#!/usr/bin/env python3
"""Instructions per call of one function, from a valgrind callgrind output file.

    scripts/callgrind-per-call.py callgrind.out.PID 'REGEX' [--depth 2] [--min 2]

REGEX names the function (matched against callgrind's demangled names,
e.g. 'rustnet::abi::v[0-9]+::test$' or '^ncclIbTest$'). Prints the calls,
the inclusive instructions per call, and a tree of where they go: each
callee's inclusive instructions per call of the function, down to --depth
levels, hiding entries under --min per call. A callee also called from
elsewhere is scaled by the share of its calls made from here.

tests/rxe-vm/callgrind-test.sh runs a plugin's receiving end under callgrind
in the soft-RoCE VM and calls this (docs/verbs-cost.md).
"""
import argparse
import re
import sys
from collections import defaultdict


def parse(path):
    names = {"fn": {}, "cfn": {}}
    self_ir = defaultdict(int)
    # callee edges: calls[caller][callee] = [count, inclusive Ir]
    calls = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    cur = None
    callee = None
    pending = None
    events = None
    npos = 1

    def name(kind, rest):
        # "(id) name" defines, "(id)" refers, "name" is plain
        m = re.match(r"\((\d+)\)\s*(.*)", rest)
        if not m:
            return rest
        i, n = m.group(1), m.group(2)
        table = names["fn"]  # fn and cfn share one id space
        if n:
            table[i] = n
        return table.get(i, "?" + i)

    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            if line.startswith("positions:"):
                # "line", or "instr line" with --dump-instr=yes
                npos = len(line.split()) - 1
                continue
            if line.startswith("events:"):
                events = line.split()[1:]
                continue
            if line.startswith("fn="):
                cur = name("fn", line[3:])
                continue
            if line.startswith("cfn="):
                callee = name("cfn", line[4:])
                continue
            if line.startswith("calls="):
                pending = int(line[6:].split()[0])
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                if len(parts) <= npos:
                    continue
                ir = int(parts[npos])
                if pending is not None:
                    e = calls[cur][callee]
                    e[0] += pending
                    e[1] += ir
                    pending = None
                else:
                    self_ir[cur] += ir
                continue
            # ob=, fl=, fi=, fe=, cob=, cfi=, cfl=, summary:, totals:, headers
    if events and events[0] != "Ir":
        sys.exit(f"expected Ir as the first event, got {events}")
    return self_ir, calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("regex")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--min", type=float, default=2.0)
    a = ap.parse_args()
    self_ir, calls = parse(a.file)
    rx = re.compile(a.regex)
    # calls into each function, from anywhere
    into = defaultdict(lambda: [0, 0])
    for caller, es in calls.items():
        for callee, (n, ir) in es.items():
            into[callee][0] += n
            into[callee][1] += ir
    targets = [f for f in into if rx.search(f)]
    if not targets:
        sys.exit(f"no function matching {a.regex!r} was called")
    n = sum(into[f][0] for f in targets)
    ir = sum(into[f][1] for f in targets)
    print(f"{' + '.join(targets)}: {n} calls, {ir / n:.1f} instructions per call (inclusive)")

    def tree(f, share, depth, indent):
        # share: the fraction of f's cost that belongs to the target's calls
        own = self_ir.get(f, 0) * share / n
        if own >= a.min:
            print(f"{indent}{own:8.1f}  (self)")
        kids = sorted(calls.get(f, {}).items(), key=lambda kv: -kv[1][1])
        for callee, (cn, cir) in kids:
            per = cir * share / n
            if per < a.min:
                continue
            print(f"{indent}{per:8.1f}  {callee}  ({cn * share / n:.2f} calls per call)")
            if depth > 1 and callee in into and into[callee][0]:
                tree(callee, share * cn / into[callee][0], depth - 1, indent + "    ")

    for f in targets:
        print(f"{into[f][1] / n:8.1f}  {f}")
        tree(f, 1.0, a.depth, "    ")


if __name__ == "__main__":
    main()
