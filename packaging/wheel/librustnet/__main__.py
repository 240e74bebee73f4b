"""``python -m librustnet``: where the plugin is, the environment for NCCL, and the bundled tool.

    python -m librustnet plugin-path       absolute path for NCCL_NET_PLUGIN (NCCL 2.21+)
    python -m librustnet lib-dir           directory for LD_LIBRARY_PATH (NCCL 2.18-2.20, NCCL_NET_PLUGIN=rustnet)
    python -m librustnet env [--legacy]    export lines for this node (rustnet doctor --export-env, plugin path filled in);
                                           exit status as rustnet doctor: 0 pass, 1 warnings, 2 failures
    python -m librustnet check             dlopen the plugin in this Python process, as NCCL would, and list its vtables
    python -m librustnet tool-path         absolute path of the bundled rustnet tool
    python -m librustnet <rustnet command> runs the bundled tool (doctor, bench, agent, bisect, knobs), plugin preset
"""

import ctypes
import os
import sys

from . import env_lines, lib_dir, plugin_path, tool_path, _tool_env

TOOL_COMMANDS = ("doctor", "bench", "agent", "bisect", "knobs")


def check():
    p = plugin_path()
    # RTLD_LOCAL | RTLD_NOW, as NCCL opens plugins.
    lib = ctypes.CDLL(p, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    found = []
    for v in range(6, 13):
        try:
            getattr(lib, f"ncclNetPlugin_v{v}")
            found.append(v)
        except AttributeError:
            pass
    if not found:
        print(f"{p}: loads but exports no ncclNetPlugin_vN table", file=sys.stderr)
        return 1
    print(f"{p}: loaded; exports ncclNetPlugin_v{', v'.join(map(str, found))}")
    return 0


def tool_main():
    """Console script ``rustnet``: the bundled binary with the package's plugin preset."""
    os.execve(tool_path(), [tool_path(), *sys.argv[1:]], _tool_env())


def main(argv):
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "plugin-path":
        print(plugin_path())
        return 0
    if cmd == "lib-dir":
        print(lib_dir())
        return 0
    if cmd == "tool-path":
        print(tool_path())
        return 0
    if cmd == "env":
        legacy = "--legacy" in rest
        extra = [a for a in rest if a != "--legacy"]
        lines, rc = env_lines(legacy=legacy, doctor_args=extra)
        print("\n".join(lines))
        return rc
    if cmd == "check":
        return check()
    if cmd in TOOL_COMMANDS:
        os.execve(tool_path(), [tool_path(), cmd, *rest], _tool_env())
    print(f"python -m librustnet: unknown command {cmd!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
