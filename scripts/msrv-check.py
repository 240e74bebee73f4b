#!/usr/bin/env python3
"""The MSRV check that can run with one toolchain.

Each workspace crate declares `rust-version` in its Cargo.toml. Building with
that old rustc would prove it; this machine (and CI's) has one toolchain and
rustup cannot fetch another, so scripts/test.sh checks two things instead:

1. here: no package in a crate's build closure (normal and build
   dependencies, as locked in Cargo.lock; dev-dependencies are left out, they
   only build the tests) declares a `rust-version` newer than the crate's.
   Cargo of the declared version would refuse such a package.
2. in the style step: clippy's `incompatible_msrv` lint (on by default,
   made fatal by -D warnings) refuses std items stabilised after the crate's
   `rust-version`.

What this does NOT prove: that rustc of that version accepts the syntax and
language features we use (clippy does not check those), that dependencies
without a `rust-version` build with it, nor that Cargo.lock's format is
readable by that cargo. A real MSRV build (`cargo +1.88 build --locked`) is
still the proof; run it where a second toolchain can be installed.

  scripts/msrv-check.py     prints each crate's MSRV and its newest dependency; exit 1 on a violation
"""
import json
import subprocess
import sys


def ver(s):
    v = [int(x) for x in s.split(".")]
    return tuple(v + [0] * (3 - len(v)))  # "1.88" == "1.88.0"


def main():
    out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--locked"],
                         check=True, capture_output=True, text=True).stdout
    meta = json.loads(out)
    pkgs = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    bad = 0
    for member in meta["workspace_members"]:
        me = pkgs[member]
        want = me.get("rust_version")
        if not want:
            print(f"FAIL: {me['name']} declares no rust-version")
            bad += 1
            continue
        # the build closure: normal and build edges only, from this crate down
        seen, todo = set(), [member]
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            for d in nodes[pid]["deps"]:
                if {k["kind"] for k in d["dep_kinds"]} != {"dev"}:
                    todo.append(d["pkg"])
        seen.discard(member)
        newest = max(((ver(pkgs[p]["rust_version"]), pkgs[p]) for p in seen if pkgs[p].get("rust_version")),
                     key=lambda t: t[0], default=None)
        for p in sorted(seen, key=lambda p: pkgs[p]["name"]):
            rv = pkgs[p].get("rust_version")
            if rv and ver(rv) > ver(want):
                print(f"FAIL: {me['name']} declares rust-version {want}, but its dependency "
                      f"{pkgs[p]['name']} {pkgs[p]['version']} needs rustc {rv} (Cargo.lock)")
                bad += 1
        top = f"{newest[1]['name']} {newest[1]['version']} needs {newest[1]['rust_version']}" if newest else "none declares one"
        print(f"{me['name']}: rust-version {want}; {len(seen)} packages in its build closure, newest: {top}")
    if bad:
        sys.exit(1)
    print("MSRV: every build dependency fits its crate's rust-version (syntax is not proven: see the header)")


if __name__ == "__main__":
    main()
