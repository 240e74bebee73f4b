"""Stands in for MPICH's Hydra mpiexec (the nccl-kit's) in the tests:
--version, -n/-np N; starts N copies of the command with PMI_RANK/PMI_SIZE
(what Hydra gives every rank) and the whole environment; a fresh
FAKE_RANKDIR meeting place per launch (see fake_perf.py)."""

import os
import subprocess
import sys
import tempfile


def main():
    args = sys.argv[1:]
    if args == ["--version"]:
        print("HYDRA build details:\n    Version:                                 5.0.2")
        return 0
    n, i = 1, 0
    while i < len(args):
        if args[i] in ("-n", "-np"):
            n = int(args[i + 1])
            i += 2
        elif args[i].startswith("-"):
            i += 1
        else:
            break
    cmd = args[i:]
    if os.environ.get("HYDRA_LAUNCHER") != "fork":
        print("fake mpiexec: HYDRA_LAUNCHER=fork not set (env.sh not sourced?)", file=sys.stderr)
        return 1
    base = os.environ.get("FAKE_RANKDIR") or os.environ.get("FAKE_STATE_DIR")
    rankdir = tempfile.mkdtemp(dir=base)
    procs = []
    for r in range(n):
        env = dict(os.environ, PMI_RANK=str(r), PMI_SIZE=str(n), MPI_LOCALRANKID=str(r),
                   MPI_LOCALNRANKS=str(n), FAKE_RANKDIR=rankdir)
        procs.append(subprocess.Popen(cmd, env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
