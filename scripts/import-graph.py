#!/usr/bin/env python3
"""The module import graph of the workspace, and a check that it has no circle.

Edges: a module (one .rs file) -> every module of the workspace it names
through `crate::`, `super::`, `self::`, `rustnet::`, `rustnet_proto::` or
`rustnet_tools::` paths, in `use` lines and in code; test modules
(`#[cfg(test)] mod tests` to the end of the file) are left out, since
tests may reach anywhere. A parent module (mod.rs / lib.rs) counts as one
node with its own items.

  scripts/import-graph.py            the edges, per module, then the verdict
  scripts/import-graph.py --check    only the verdict; exit 1 on a circle
  scripts/import-graph.py --dot      Graphviz

Circles are reported as strongly connected components; any circle fails
--check (scripts/test.sh runs it). Crate edges are listed last: the tool
binary (rustnet_tools_bin) -> rustnet_tools -> rustnet -> rustnet_proto.

The rings (docs/architecture.md) are checked too: an edge that points the
wrong way (RULES below: NCCL's types outside abi/, one transport importing
the other, the core importing the plugin, ...) fails --check with a line
naming the edge and the rule.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = {  # crate name in paths -> source root
    "rustnet": "src",
    "rustnet_proto": "crates/rustnet-proto/src",
    "rustnet_tools": "crates/rustnet-tools/src",
}
def modules():
    """Module path -> file, for every .rs file under each crate's source root."""
    out = {}
    for crate, src in CRATES.items():
        base = os.path.join(ROOT, src)
        for d, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".rs"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), base)[:-3].split(os.sep)
                if rel[0] == "bin":  # the tool binary: a crate of its own
                    path = ["rustnet_tools_bin"] + rel[2:]
                else:
                    path = [crate] + rel
                if path[-1] in ("mod", "lib", "main"):
                    path = path[:-1]
                out["::".join(path)] = os.path.join(d, f)
    return out


PATH = re.compile(r"\b(crate|super|self|rustnet|rustnet_proto|rustnet_tools)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self|rustnet|rustnet_proto|rustnet_tools)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\};", re.S)


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)
    m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))?\s+)?mod\s", text)  # the test module, not a test-only fn
    return text if m is None else text[:m.start()]


def resolve(mods, me, root, rest, is_dir):
    """The longest module path `root::rest` names, seen from module `me`."""
    crate = me.split("::")[0]
    if root == "crate":
        base = [crate if crate != "rustnet_tools_bin" else "rustnet_tools_bin"]
    elif root in ("super", "self"):
        base = me.split("::")
        if not is_dir:  # a file module's `super` is its parent
            base = base[:-1]
        if root == "super" and is_dir:
            base = base[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    else:
        base = [root]
    parts = base + [r for r in rest if r != "self"]
    if parts[:2] == ["rustnet", "proto"]:  # the plugin re-exports the core: `pub use rustnet_proto as proto`
        parts = ["rustnet_proto"] + parts[2:]
    while parts:
        p = "::".join(parts)
        if p in mods:
            return p
        parts = parts[:-1]
    return None


def graph():
    mods = modules()
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        is_dir = os.path.basename(f) in ("mod.rs", "lib.rs", "main.rs")
        text = strip(open(f, encoding="utf-8").read())
        names = []
        for g in USE_GROUP.finditer(text):
            prefix = [x for x in g.group(2).split("::") if x]
            for item in re.split(r"[,\s]+", re.sub(r"\{[^}]*\}", "", g.group(3))):
                item = item.split(" as ")[0].strip()
                if item:
                    names.append((g.group(1), prefix + item.split("::")))
        for p in PATH.finditer(text):
            names.append((p.group(1), [x for x in p.group(2).split("::") if x and x != "{"]))
        for root, rest in names:
            t = resolve(mods, m, root, rest, is_dir)
            if t and t != m and not m.startswith(t + "::"):  # a child naming its parent's items is no edge
                edges[m].add(t)
    return edges


# (from, to, exempt, why): an edge from a module under `from` to one under
# `to` is refused unless its source is under one of `exempt`.
RULES = [
    ("rustnet", "rustnet::abi::sys", ["rustnet::abi", "rustnet::for_tools"],
     "only abi/ may name NCCL's C types (the core gets its own types, converted at the boundary;"
     " for_tools re-exports them for the tools' stand-in for NCCL)"),
    ("rustnet::transport", "rustnet::abi", [], "the system ring must not reach the C boundary"),
    ("rustnet::transport", "rustnet::plugin", [], "transports must not import the plugin that dispatches to them"),
    ("rustnet::transport", "rustnet::context", [], "transports must not import the plugin's contexts"),
    ("rustnet::context", "rustnet::plugin", [], "contexts must not import the plugin (it passes what they need)"),
    ("rustnet::context", "rustnet::transport", [], "contexts are transport-neutral"),
    ("rustnet::abi", "rustnet::transport::ib", [], "abi/ reaches a transport only through plugin"),
    ("rustnet::abi", "rustnet::transport::tcp", [], "abi/ reaches a transport only through plugin"),
    ("rustnet::transport::ib", "rustnet::transport::tcp", [],
     "the verbs transport must not import the TCP one (shared socket code lives in transport::{sock,oob,netif})"),
    ("rustnet::transport::tcp", "rustnet::transport::ib", [], "the TCP transport must not import the verbs one"),
    ("rustnet::transport::sock", "rustnet::transport::ib", [], "the shared socket ring must not import a transport"),
    ("rustnet::transport::sock", "rustnet::transport::tcp", [], "the shared socket ring must not import a transport"),
    ("rustnet::transport::oob", "rustnet::transport::ib", [], "the shared socket ring must not import a transport"),
    ("rustnet::transport::oob", "rustnet::transport::tcp", [], "the shared socket ring must not import a transport"),
    ("rustnet::transport::netif", "rustnet::transport::ib", [], "the shared socket ring must not import a transport"),
    ("rustnet::transport::netif", "rustnet::transport::tcp", [], "the shared socket ring must not import a transport"),
    ("rustnet_proto", "rustnet", [], "the sans-IO core imports nothing of the plugin"),
    ("rustnet_proto", "rustnet_tools", [], "the sans-IO core imports nothing of the tools"),
    ("rustnet", "rustnet_tools", [], "the plugin must not import the tools (they stay out of the .so)"),
]


def under(m, prefix):
    return m == prefix or m.startswith(prefix + "::")


def ring_violations(edges):
    """(edge source, edge target, why) for every edge a rule refuses."""
    out = []
    for m in sorted(edges):
        for t in sorted(edges[m]):
            for src, dst, exempt, why in RULES:
                if under(m, src) and under(t, dst) and not any(under(m, e) for e in exempt):
                    out.append((m, t, why))
    return out


def sccs(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    edges = graph()
    if "--dot" in sys.argv:
        print("digraph imports {")
        for m in sorted(edges):
            for t in sorted(edges[m]):
                print(f'  "{m}" -> "{t}";')
        print("}")
        return 0
    if "--check" not in sys.argv:
        for m in sorted(edges):
            print(f"{m} -> {', '.join(sorted(edges[m])) or '(nothing)'}")
    bad = 0
    for comp in sccs(edges):
        bad += 1
        print(f"CIRCLE: {', '.join(sorted(comp))}")
    wrong = ring_violations(edges)
    for m, t, why in wrong:
        print(f"WRONG-WAY EDGE: {m} -> {t}: {why}")
    crates = {}
    for m, ts in edges.items():
        for t in ts:
            a, b = m.split("::")[0], t.split("::")[0]
            if a != b:
                crates.setdefault(a, set()).add(b)
    print("crates: " + "; ".join(f"{a} -> {', '.join(sorted(b))}" for a, b in sorted(crates.items())))
    verdict = f"acyclic ({len(edges)} modules, {sum(map(len, edges.values()))} edges)" if not bad else f"{bad} circle(s)"
    rings = f"rings kept ({len(RULES)} rules)" if not wrong else f"{len(wrong)} wrong-way edge(s)"
    print(f"import graph: {verdict}; {rings}")
    return 1 if bad or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
