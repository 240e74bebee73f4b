"""Open the plugin file the way NCCL does (dlopen) and read the vtable
names it exports, without calling into it. Catches a wrong file, a glibc
too old for the build, or missing exports before any GPU time is spent.

  python3 -m ncclharness.pluginprobe <dir or .so>
"""

import ctypes
import os
import sys

VERSIONS = (12, 11, 10, 9, 8, 7, 6)


def probe(path):
    """Returns {"path", "exports": {version: name}} or raises OSError."""
    p = path
    if os.path.isdir(p):
        for cand in ("libnccl-net-rustnet.so", "librustnet.so"):
            if os.path.exists(os.path.join(p, cand)):
                p = os.path.join(p, cand)
                break
    lib = ctypes.CDLL(os.path.abspath(p), mode=getattr(os, "RTLD_NOW", 2) | getattr(os, "RTLD_LOCAL", 0))
    exports = {}
    for v in VERSIONS:
        try:
            # The exported symbol is a struct whose first member is `const char* name`.
            name = ctypes.c_char_p.in_dll(lib, f"ncclNetPlugin_v{v}").value
        except ValueError:
            continue
        exports[v] = name.decode() if name else None
    return {"path": os.path.abspath(p), "exports": exports}


def main(argv):
    if len(argv) != 2:
        print("usage: python3 -m ncclharness.pluginprobe <plugin dir or .so>", file=sys.stderr)
        return 2
    try:
        info = probe(argv[1])
    except OSError as e:
        print(f"FAIL: cannot dlopen the plugin: {e}")
        return 1
    if not info["exports"]:
        print(f"FAIL: {info['path']} exports no ncclNetPlugin_vN symbol")
        return 1
    names = sorted(set(info["exports"].values()))
    print(f"plugin {info['path']}: exports " +
          ", ".join(f"v{v}" for v in sorted(info["exports"])) + f"; vtable name(s): {', '.join(map(str, names))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
