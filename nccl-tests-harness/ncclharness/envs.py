"""Environments for the two networks and for several ranks on one GPU.

Plugin run:   NCCL_NET_PLUGIN=rustnet  (NCCL dlopens libnccl-net-rustnet.so)
              LD_LIBRARY_PATH=<plugin dir>:...
              NCCL_NET=rustnet         (NCCL errors out instead of falling back
                                        if the plugin does not come up; the log
                                        check proves it independently)
Built-in run: NCCL_NET_PLUGIN=none     (2.28+: load no plugin; older NCCL looks
                                        for libnccl-net-none.so, finds nothing
                                        and uses its internal transports)
              NCCL_NET=Socket          (NCCL's own TCP transport)
              NCCL_IB_DISABLE=1
Both:         NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET

One GPU, several ranks (each rank a process):
              NCCL_HOSTID=<distinct per rank>  NCCL then takes each rank for a
                                        separate host, so it neither refuses two
                                        ranks on one GPU nor looks for an
                                        intra-node path
              NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1   no shortcut around the network
              NCCL_SOCKET_IFNAME=lo    loopback for bootstrap, NCCL's socket
                                        transport and the plugin's TCP transport
              NCCL_MNNVL_ENABLE=0 NCCL_NVLS_ENABLE=0  no NVLink fabric features
"""

import os
import shutil
from pathlib import Path

from . import BUILTIN_NET_NAME, PLUGIN_LOAD_NAME, PLUGIN_NET_NAME

NETS = ("plugin", "builtin")
# Variables a previous setting could leak into a run; every run sets its own.
_CLEARED = ("NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_IB_DISABLE", "NCCL_HOSTID",
            "NCCL_DEBUG_FILE", "NCCL_COLLNET_ENABLE")


def expected_net_name(net):
    return PLUGIN_NET_NAME if net == "plugin" else BUILTIN_NET_NAME


def net_label(net):
    """Column title for a run: the name NCCL prints for that network."""
    return expected_net_name(net)


def debug_env():
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}


def network_env(net, plugin_dir=None, base=None, force_net=True, rustnet_transport=None):
    """Return a full environment (dict) for one network, starting from base
    (default os.environ)."""
    if net not in NETS:
        raise ValueError(f"net must be one of {NETS}, not {net!r}")
    env = dict(os.environ if base is None else base)
    for k in _CLEARED:
        env.pop(k, None)
    env.update(debug_env())
    if net == "plugin":
        if not plugin_dir:
            raise ValueError("the plugin run needs the plugin's directory (--plugin-dir)")
        env["NCCL_NET_PLUGIN"] = PLUGIN_LOAD_NAME
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = str(plugin_dir) + (":" + old if old else "")
        if force_net:
            env["NCCL_NET"] = PLUGIN_NET_NAME
        if rustnet_transport:
            env["RUSTNET_TRANSPORT"] = rustnet_transport
    else:
        env["NCCL_NET_PLUGIN"] = "none"
        env["NCCL_NET"] = BUILTIN_NET_NAME
        env["NCCL_IB_DISABLE"] = "1"
    return env


def one_host_env(ifname="lo"):
    """Settings shared by every rank of a one-host run forced onto the network."""
    return {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": ifname,
            "NCCL_MNNVL_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def hostid_for_rank(rank, prefix="rustnet-harness-rank"):
    return f"{prefix}{rank}"


def apply_overrides(env, pairs):
    """--env KEY=VALUE options, applied last (to both networks)."""
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--env wants KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        env[k] = v
    return env


def describe_env(env, keys_from=None):
    """The NCCL_/RUSTNET_/LD_LIBRARY_PATH part of an environment, sorted, for logs."""
    keys = sorted(k for k in env if k.startswith(("NCCL_", "RUSTNET_", "TORCH_NCCL_"))
                  or k in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NCCL_TESTS_DEVICE"))
    return " ".join(f"{k}={env[k]}" for k in keys)


def _is_elf(path):
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def prepare_plugin_dir(path, workdir):
    """Return a directory holding libnccl-net-rustnet.so, the file NCCL opens
    for NCCL_NET_PLUGIN=rustnet.

    path may be that directory already (an install's lib/), a directory with
    only librustnet.so (target/release, out/gpu-kit), or the .so itself; in the
    last two cases a private directory under workdir gets the NCCL name as a
    symlink (copied if symlinks are not possible)."""
    p = Path(path).expanduser().resolve()
    want = f"libnccl-net-{PLUGIN_LOAD_NAME}.so"
    if p.is_dir():
        if _is_elf(p / want):
            return p
        src = p / "librustnet.so"
    else:
        src = p
    if not _is_elf(src):
        raise FileNotFoundError(
            f"no plugin at {path}: expected {want} or librustnet.so there "
            f"(build it with 'make install PREFIX=...' or nccl-tests-harness/make-gpu-kit.sh)")
    lib = Path(workdir).resolve() / "plugin-lib"
    lib.mkdir(parents=True, exist_ok=True)
    for name in (want, "librustnet.so", f"libnccl-net-lib{PLUGIN_LOAD_NAME}.so"):
        dst = lib / name
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        try:
            dst.symlink_to(src)
        except OSError:
            shutil.copy2(src, dst)
    return lib
