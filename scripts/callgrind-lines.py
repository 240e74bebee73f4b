#!/usr/bin/env python3
"""Where one function's own instructions go, through its inlined calls.

    scripts/callgrind-lines.py callgrind.out LIB.so 'REGEX' [--min 2] [--calls N]

callgrind-per-call.py stops at the function NCCL calls: a release build
inlines almost everything below it, so its "self" is most of the cost.
This reads a callgrind file written with --dump-instr=yes
(tests/rxe-vm/callgrind-test.sh with INSTR=1), takes the self cost of each
machine instruction of the function REGEX names, asks addr2line for the
chain of inlined frames at that instruction, and prints the tree of those
frames with instructions per call (every call counted once; --calls N
divides by N instead of the number of calls callgrind recorded).

The addresses in the file are where the library was loaded; the function's
lowest executed address is taken as its symbol's address (its entry runs
on every call) to map them back.
"""
import argparse
import re
import subprocess
import sys
from collections import defaultdict


def num(s):
    return int(s, 16) if s.startswith("0x") else int(s)


def parse(path, pat):
    """{address: self Ir} of the functions matching pat, and their calls."""
    names = {}
    rx = re.compile(pat)
    cur = None
    in_call = False
    last = [0, 0]
    cost = defaultdict(int)
    ncalls = defaultdict(int)
    callee = None
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if not line:
            continue
        # (fl=, ob= and the like start with a letter: skipped below)
        m = re.match(r"^(c?fn)=(.*)", line)
        if m:
            k, rest = m.groups()
            n = re.match(r"\((\d+)\)\s*(.*)", rest)
            if n:
                if n.group(2):
                    names[n.group(1)] = n.group(2)
                name = names.get(n.group(1), "?")
            else:
                name = rest
            if k == "fn":
                cur = name
            else:
                callee = name
            continue
        if line.startswith("calls="):
            in_call = True
            c = int(line.split("=")[1].split()[0])
            if callee and rx.search(callee):
                ncalls[callee] += c
            continue
        if not (line[0].isdigit() or line[0] in "+-*"):
            continue
        parts = line.split()
        pos = []
        for i, p in enumerate(parts[:2]):
            if p == "*":
                v = last[i]
            elif p[0] == "+":
                v = last[i] + num(p[1:])
            elif p[0] == "-":
                v = last[i] - num(p[1:])
            else:
                v = num(p)
            pos.append(v)
        last[: len(pos)] = pos
        if in_call:
            in_call = False
            continue
        if cur and rx.search(cur) and len(parts) > 2:
            cost[pos[0]] += int(parts[2])
    return cost, ncalls


def symbol_addr(lib, pat):
    out = subprocess.run(["nm", "-C", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    rx = re.compile(pat)
    for line in out.splitlines():
        a, _, n = line.split(" ", 2)
        if rx.search(n):
            return int(a, 16)
    sys.exit(f"callgrind-lines.py: no symbol matching {pat!r} in {lib}")


def chains(lib, addrs):
    """addr -> [outermost frame, ..., innermost frame] as 'function (file:line)'."""
    q = subprocess.run(
        ["addr2line", "-a", "-i", "-f", "-C", "-e", lib] + [hex(a) for a in addrs], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    # -a: each address's line, then (function, file:line) per frame, innermost first
    out = {}
    k = 0
    while k < len(q):
        a = int(q[k], 16)
        k += 1
        frames = []
        while k + 1 < len(q) and not q[k].startswith("0x"):
            fn = re.sub(r"::h[0-9a-f]{16}$", "", q[k])
            loc = q[k + 1].split("/work/main/")[-1].split("/library/")[-1]
            frames.append(f"{fn} ({loc})")
            k += 2
        out[a] = list(reversed(frames))
    return out


def short(frame):
    # 'a::b::<impl X>::f (src/x.rs:12)' -> keep it readable
    fn, loc = frame.rsplit(" (", 1)
    fn = re.sub(r"<impl [^>]*>::", "", fn)
    parts = fn.split("::")
    return "::".join(parts[-2:]) + " (" + loc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cg")
    ap.add_argument("lib")
    ap.add_argument("pat")
    ap.add_argument("--min", type=float, default=2.0)
    ap.add_argument("--calls", type=int, default=0)
    a = ap.parse_args()
    cost, ncalls = parse(a.cg, a.pat)
    if not cost:
        sys.exit("callgrind-lines.py: no instruction-level costs for that function (was --dump-instr=yes given?)")
    calls = a.calls or max(ncalls.values() or [1])
    base = min(cost) - symbol_addr(a.lib, a.pat)
    ch = chains(a.lib, sorted(x - base for x in cost))
    tree = {}

    def add(node, path, c):
        node.setdefault("_c", 0)
        node["_c"] += c
        if path:
            add(node.setdefault(path[0], {}), path[1:], c)

    for addr, c in cost.items():
        frames = ch[addr - base]
        # one level per source location: inlined frames name where they were called from
        add(tree, [short(f) for f in frames[1:]] or ["(the function itself)"], c)
    total = tree["_c"]
    print(f"{a.pat}: {calls} calls, {total / calls:.1f} own instructions per call (inlined code included)")

    def show(node, depth):
        kids = sorted(((k, v) for k, v in node.items() if k != "_c"), key=lambda kv: -kv[1]["_c"])
        for k, v in kids:
            per = v["_c"] / calls
            if per < a.min:
                continue
            print(f"{'  ' * depth}{per:7.1f}  {k}")
            show(v, depth + 1)

    show(tree, 0)


if __name__ == "__main__":
    main()
