#!/usr/bin/env python3
"""Builds the librustnet wheel from the release build, with the standard library only.

    packaging/wheel/build_wheel.py [--out out/pkg]      (cargo build --release first)

The wheel holds the Python package ``librustnet`` (this directory), the plugin as
``librustnet/lib/libnccl-net-rustnet.so`` and the tool as ``librustnet/bin/rustnet``
(both stripped), and a ``rustnet`` console script. The plugin is not a Python
extension, so the tag is ``py3-none-<platform>``. The platform tag is computed
from the ELF files: the newest GLIBC_x.y symbol version either needs gives
``manylinux_x_y_<arch>`` (PEP 600), so pip refuses the wheel exactly where the
files could not load. The only libraries they need are libc, libm, libgcc_s and
the dynamic loader, all on the manylinux allow-list (checked here; auditwheel
checks it again in CI). Timestamps come from SOURCE_DATE_EPOCH (the last
commit), so a rebuild of one commit gives the same bytes.
"""
import argparse
import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PKG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "librustnet")
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def cargo_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        for line in f:
            m = re.match(r'\s*version\s*=\s*"([^"]+)"', line)
            if m:
                return m.group(1)
    raise SystemExit("no version in Cargo.toml")


def elf_facts(path):
    """(newest GLIBC version as a tuple, NEEDED libraries) of one ELF file."""
    t = subprocess.run(["objdump", "-T", path], check=True, stdout=subprocess.PIPE, text=True).stdout
    vers = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"\bGLIBC_([0-9]+\.[0-9]+(?:\.[0-9]+)?)\b", t)}
    d = subprocess.run(["readelf", "-d", path], check=True, stdout=subprocess.PIPE, text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", d)
    return max(vers)[:2] if vers else (2, 17), needed


def platform_tag(glibc, arch):
    tag = f"manylinux_{glibc[0]}_{glibc[1]}_{arch}"
    if glibc <= (2, 17) and arch in ("x86_64", "aarch64", "i686"):
        tag = f"manylinux_2_17_{arch}.manylinux2014_{arch}"  # the legacy alias older pips know
    return tag


def b64hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "pkg"))
    ap.add_argument("--so", default=os.path.join(ROOT, "target", "release", "librustnet.so"))
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "rustnet"))
    a = ap.parse_args()
    for p in (a.so, a.bin):
        if not os.path.isfile(p):
            raise SystemExit(f"build_wheel: {p} missing: run cargo build --release first")
    version = cargo_version()
    arch = os.uname().machine
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or subprocess.run(
        ["git", "-C", ROOT, "log", "-1", "--format=%ct"], stdout=subprocess.PIPE, text=True).stdout.strip() or time.time())
    date_time = time.gmtime(max(epoch, 315532800))[:6]  # zip cannot hold dates before 1980

    tmp = tempfile.mkdtemp()
    try:
        so = os.path.join(tmp, "libnccl-net-rustnet.so")
        tool = os.path.join(tmp, "rustnet")
        shutil.copy(a.so, so)
        shutil.copy(a.bin, tool)
        subprocess.run(["strip", "--remove-section=.comment", "--remove-section=.note", "--strip-unneeded", so], check=True)
        subprocess.run(["strip", "--remove-section=.comment", "--remove-section=.note", tool], check=True)
        glibc = (0, 0)
        for p in (so, tool):
            g, needed = elf_facts(p)
            glibc = max(glibc, g)
            bad = [n for n in needed if n not in ALLOWED_NEEDED]
            if bad:
                raise SystemExit(f"build_wheel: {os.path.basename(p)} needs {bad}, outside the manylinux allow-list")
        plat = platform_tag(glibc, arch)
        tag = f"py3-none-{plat}"
        dist = f"librustnet-{version}"
        files = []  # (arcname, bytes, mode)
        for name in sorted(os.listdir(PKG)):
            if name.endswith(".py"):
                with open(os.path.join(PKG, name), "rb") as f:
                    files.append((f"librustnet/{name}", f.read(), 0o644))
        with open(so, "rb") as f:
            files.append(("librustnet/lib/libnccl-net-rustnet.so", f.read(), 0o755))
        with open(tool, "rb") as f:
            files.append(("librustnet/bin/rustnet", f.read(), 0o755))
        with open(os.path.join(ROOT, "docs", "pytorch-ddp.md"), "rb") as f:
            long_desc = f.read().decode()
        meta = (
            "Metadata-Version: 2.1\n"
            "Name: librustnet\n"
            f"Version: {version}\n"
            "Summary: NCCL network plugin (ibverbs and TCP) for PyTorch and other NCCL users, with its operator tool\n"
            "License: Apache-2.0\n"
            "Requires-Python: >=3.8\n"
            "Classifier: Operating System :: POSIX :: Linux\n"
            "Classifier: License :: OSI Approved :: Apache Software License\n"
            "Description-Content-Type: text/markdown\n\n" + long_desc
        )
        files.append((f"{dist}.dist-info/METADATA", meta.encode(), 0o644))
        wheel_meta = f"Wheel-Version: 1.0\nGenerator: librustnet build_wheel.py\nRoot-Is-Purelib: false\n"
        for t in plat.split("."):
            wheel_meta += f"Tag: py3-none-{t}\n"
        files.append((f"{dist}.dist-info/WHEEL", wheel_meta.encode(), 0o644))
        files.append((f"{dist}.dist-info/entry_points.txt", b"[console_scripts]\nrustnet = librustnet.__main__:tool_main\n", 0o644))
        files.append((f"{dist}.dist-info/top_level.txt", b"librustnet\n", 0o644))
        record = io.StringIO()
        for name, data, _ in files:
            record.write(f"{name},{b64hash(data)},{len(data)}\n")
        record.write(f"{dist}.dist-info/RECORD,,\n")
        files.append((f"{dist}.dist-info/RECORD", record.getvalue().encode(), 0o644))

        os.makedirs(a.out, exist_ok=True)
        whl = os.path.join(a.out, f"{dist}-{tag}.whl")
        with zipfile.ZipFile(whl + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
            for name, data, mode in files:
                zi = zipfile.ZipInfo(name, date_time=date_time)
                zi.external_attr = (0o100000 | mode) << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, data, compresslevel=9)
        os.replace(whl + ".tmp", whl)
        print(f"glibc symbols up to {glibc[0]}.{glibc[1]} -> {plat}", file=sys.stderr)
        print(whl)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
