"""A stand-in nccl-kit and MPS for the kit tests (no GPU, no MPI, no NCCL).

The kit has the real kit's layout (see ../shared/gpu/nccl-kit/README.txt):
bin/*_perf (here: fake_perf.py, which "references MPI_Init" like an MPI
build), mpi/bin/mpiexec (fake_mpiexec.py, MPICH Hydra style), env.sh and
rank-wrap.sh with the real ones' contract (PATH, HYDRA_LAUNCHER=fork;
NCCL_HOSTID and NCCL_TESTS_DEVICE=0 per rank from PMI_RANK). mpsbin/ holds
a stand-in nvidia-cuda-mps-control to put first on PATH."""

import os
import sys

from _util import TESTS

FAKES = os.path.join(TESTS, "fakes")
PERF_TESTS = ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv")


def write_exe(path, body):
    with open(path, "w") as f:
        f.write(body)
    os.chmod(path, 0o755)


def make_fake_kit(root):
    """Create <root>/nccl-kit and <root>/mpsbin; returns (kit, mpsbin)."""
    kit = os.path.join(root, "nccl-kit")
    for d in ("bin", "mpi/bin", "mpi/lib"):
        os.makedirs(os.path.join(kit, d), exist_ok=True)
    py = sys.executable
    for coll in PERF_TESTS:
        write_exe(os.path.join(kit, "bin", f"{coll}_perf"),
                  f'#!/bin/sh\n# references MPI_Init\nexec "{py}" -S "{FAKES}/fake_perf.py" "$0" "$@"\n')
    write_exe(os.path.join(kit, "mpi", "bin", "mpiexec"),
              f'#!/bin/sh\nexec "{py}" -S "{FAKES}/fake_mpiexec.py" "$@"\n')
    with open(os.path.join(kit, "env.sh"), "w") as f:
        f.write('# stand-in for the kit\'s env.sh: its mpiexec first on PATH, Hydra by fork\n'
                'NCCL_KIT=${NCCL_KIT:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}\n'
                'export NCCL_KIT PATH="$NCCL_KIT/mpi/bin:$PATH" HYDRA_LAUNCHER=fork\n'
                'echo "nccl-kit (fake): NCCL_KIT=$NCCL_KIT" >&2\n')
    write_exe(os.path.join(kit, "rank-wrap.sh"),
              '#!/bin/sh\nr=${PMI_RANK:?rank-wrap.sh: no PMI_RANK}\n'
              'NCCL_HOSTID="nccl-kit-rank$r" NCCL_TESTS_DEVICE="${NCCL_TESTS_DEVICE:-0}" NCCL_KIT_RANK=$r\n'
              'export NCCL_HOSTID NCCL_TESTS_DEVICE NCCL_KIT_RANK\nexec "$@"\n')
    mpsbin = os.path.join(root, "mpsbin")
    os.makedirs(mpsbin, exist_ok=True)
    write_exe(os.path.join(mpsbin, "nvidia-cuda-mps-control"),
              f'#!/bin/sh\nexec "{py}" -S "{FAKES}/fake_mps_control.py" "$@"\n')
    return kit, mpsbin
