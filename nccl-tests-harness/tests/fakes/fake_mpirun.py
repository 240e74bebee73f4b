"""Stands in for Open MPI's mpirun in the tests: --version, -np N, -x VAR
(one line per launch appended to FAKE_MPIRUN_RECORD), --allow-run-as-root; starts N copies of
the command with OMPI_COMM_WORLD_RANK/SIZE set."""

import os
import subprocess
import sys
import tempfile


def main():
    args = sys.argv[1:]
    if args == ["--version"]:
        print("mpirun (Open MPI) 4.1.6")
        return 0
    n, forwarded, i = 1, [], 0
    while i < len(args):
        a = args[i]
        if a == "-np":
            n = int(args[i + 1])
            i += 2
        elif a == "-x":
            forwarded.append(args[i + 1])
            i += 2
        elif a.startswith("--"):
            i += 1
        else:
            break
    cmd = args[i:]
    rec = os.environ.get("FAKE_MPIRUN_RECORD")
    if rec:
        with open(rec, "a") as f:
            f.write(" ".join(forwarded) + "\n")
    procs = []
    # a fresh meeting place for this launch's ranks (see fake_perf.py)
    rankdir = tempfile.mkdtemp(dir=os.environ.get("FAKE_RANKDIR"))
    for r in range(n):
        env = dict(os.environ, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE=str(n), FAKE_RANKDIR=rankdir)
        procs.append(subprocess.Popen(cmd, env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
