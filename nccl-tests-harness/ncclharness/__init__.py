"""Shared code for the librustnet NCCL harness (standard library only).

The scripts beside this package (run_nccl_tests.py, torch_sweep.py,
ddp_check.py) each run a workload twice, once through the plugin and once
through NCCL's built-in socket transport, and use this package to:

- name the collectives and apply nccl-tests' bandwidth definitions (busbw),
- read nccl-tests' text output,
- read NCCL's own INFO log and decide which network carried the traffic,
- build the environment for each network and for the one-GPU trick,
- run rank processes with logs and time limits,
- print the side-by-side table, write CSV and draw the plot,
- compare DDP losses step by step.
"""

# The vtable name librustnet registers: what NCCL prints in "Using network"
# and in the "via NET/<name>/<dev>" channel lines, and what NCCL_NET matches.
PLUGIN_NET_NAME = "rustnet"
# NCCL_NET_PLUGIN value: NCCL dlopens libnccl-net-rustnet.so for it.
PLUGIN_LOAD_NAME = "rustnet"
# The name of NCCL's own TCP transport.
BUILTIN_NET_NAME = "Socket"
