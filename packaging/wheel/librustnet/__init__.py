"""librustnet for Python users: the NCCL network plugin and its tool, installed by pip.

NCCL (and so PyTorch's ``torch.distributed`` with the ``nccl`` backend) loads a
network plugin named by ``NCCL_NET_PLUGIN``. NCCL 2.21 and later accept an
absolute path, so after ``pip install`` one line is enough::

    export NCCL_NET_PLUGIN=$(python -m librustnet plugin-path)

``python -m librustnet env`` prints the whole environment block that
``rustnet doctor --export-env`` computes on this node (``NCCL_IB_HCA``,
``NCCL_IB_GID_INDEX``, ``NCCL_SOCKET_IFNAME``), with ``NCCL_NET_PLUGIN`` set to
this package's plugin. Nothing here is imported by the plugin itself: the
package only carries the files and says where they are.
"""

import os
import subprocess
import sys

__all__ = ["plugin_path", "lib_dir", "tool_path", "env_lines", "run_tool"]

_HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_FILE = "libnccl-net-rustnet.so"


def lib_dir():
    """The directory holding the plugin as ``libnccl-net-rustnet.so``.

    For NCCL 2.18-2.20, which only look up ``libnccl-net-<name>.so`` through the
    dynamic linker: put it on ``LD_LIBRARY_PATH`` and set ``NCCL_NET_PLUGIN=rustnet``.
    """
    return os.path.join(_HERE, "lib")


def plugin_path():
    """Absolute path of the plugin, the value for ``NCCL_NET_PLUGIN`` (NCCL 2.21+)."""
    p = os.path.join(lib_dir(), PLUGIN_FILE)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"the librustnet wheel is incomplete: {p} is missing")
    return p


def tool_path():
    """Absolute path of the bundled ``rustnet`` tool."""
    return os.path.join(_HERE, "bin", "rustnet")


def _tool_env(base=None):
    env = dict(os.environ if base is None else base)
    # The tool looks for librustnet.so beside itself; point it at this package's copy.
    env.setdefault("RUSTNET_PLUGIN", plugin_path())
    return env


def run_tool(args, **kw):
    """Run the bundled ``rustnet`` with ``args``; returns ``subprocess.CompletedProcess``."""
    return subprocess.run([tool_path(), *args], env=_tool_env(kw.pop("env", None)), **kw)


def env_lines(legacy=False, doctor_args=()):
    """The ``export`` lines for this node, and the doctor's exit status (0 pass, 1 warn, 2 fail).

    The lines are those of ``rustnet doctor --export-env`` with ``NCCL_NET_PLUGIN``
    pointing at this package's plugin by absolute path (NCCL 2.21+). With
    ``legacy=True`` (NCCL 2.18-2.20) it stays ``rustnet`` and an ``LD_LIBRARY_PATH``
    line puts :func:`lib_dir` first instead.
    """
    r = run_tool(["doctor", "--export-env", *doctor_args], stdout=subprocess.PIPE, text=True)
    if r.returncode not in (0, 1, 2) or not r.stdout.strip():
        raise RuntimeError(f"rustnet doctor --export-env failed (exit {r.returncode})")
    out = []
    for line in r.stdout.splitlines():
        if line.startswith("export NCCL_NET_PLUGIN="):
            continue
        out.append(line)
    if legacy:
        out.append(f'export LD_LIBRARY_PATH="{lib_dir()}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"')
        out.append("export NCCL_NET_PLUGIN=rustnet")
    else:
        out.append(f"export NCCL_NET_PLUGIN={plugin_path()}")
    return out, r.returncode


def _version():
    try:
        from importlib.metadata import version

        return version("librustnet")
    except Exception:  # running from a source tree
        return "unknown"


__version__ = _version()

if sys.platform != "linux":  # pragma: no cover - the wheel is tagged manylinux
    raise ImportError("librustnet is an NCCL plugin for Linux")
