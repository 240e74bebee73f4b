"""Evidence that CUDA MPS really served the ranks of a one-GPU run.

Without MPS, several processes on one GPU take turns (time slicing): two
ranks then read the same busbw through any network, because the GPU
scheduler, not the network, sets the pace. A busbw verdict on one GPU is
only worth something when the ranks ran as MPS clients.

gpu-check.sh starts a private MPS control daemon (its own
CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY) and stops it on exit.
A CUDA process that finds the daemon's pipe becomes a client; one that
does not runs without MPS, silently. So the daemon answering is not enough:
the logs must show that clients came. The MPS logs (NVIDIA's MPS docs,
"Appendix: Logging") say so in these lines:

  control.log:  [2013-08-05 12:50:23.347 Control 13894] Starting new server 13929 for user 500
                [2013-08-05 13:02:10.866 Control 13894] NEW CLIENT 19276 from user 500: Server already exists
  server.log:   [2013-08-05 13:00:09.269 Server 13929] New client 14781 connected

server.log is $CUDA_MPS_LOG_DIRECTORY/server.log, or one folder deeper
(<log dir>/<server name>/server.log) on newer drivers; both are read.

  python3 -m ncclharness.mps evidence LOG_DIR [--server-list TEXT] [--pids 1,2]
      exit 0 when MPS served clients (and every pid listed, if any), 4 when not.
"""

import argparse
import glob
import os
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Set

# Exit status for "no verdict: MPS is not in place" (gpu-check.sh uses it too).
EXIT_NO_MPS = 4

_CONTROL_CLIENT_RE = re.compile(r"NEW CLIENT (?P<pid>\d+)", re.I)
_SERVER_CLIENT_RE = re.compile(r"New client (?P<pid>\d+) connected", re.I)
_SERVER_START_RE = re.compile(r"Starting new server (?P<pid>\d+)", re.I)
_SERVER_READY_RE = re.compile(r"NEW SERVER (?P<pid>\d+): Ready", re.I)
_SERVER_FAIL_RE = re.compile(r"MPS server failed to start|Server \d+ exited with status [1-9]|"
                             r"is only supported on|MPS is not supported", re.I)


@dataclass
class MpsEvidence:
    log_dir: str
    clients: Set[int] = field(default_factory=set)       # pids seen as clients
    servers: Set[int] = field(default_factory=set)       # server pids started or listed
    problems: List[str] = field(default_factory=list)    # failure lines from the logs
    files: List[str] = field(default_factory=list)       # log files read

    @property
    def served(self):
        """MPS is in use: a server existed and at least one client came."""
        return bool(self.clients) and bool(self.servers) and not self.problems

    def missing(self, pids):
        return sorted(int(p) for p in pids if int(p) not in self.clients)

    def describe(self):
        parts = [f"MPS log dir {self.log_dir}: {len(self.servers)} server(s)"
                 + (f" (pid {', '.join(map(str, sorted(self.servers)))})" if self.servers else ""),
                 f"{len(self.clients)} client process(es)"]
        if self.problems:
            parts.append("problems: " + "; ".join(self.problems[:3]))
        return ", ".join(parts)


def parse_server_list(text):
    """`echo get_server_list | nvidia-cuda-mps-control` prints one server pid a line."""
    return {int(t) for t in (text or "").split() if t.isdigit()}


def read_evidence(log_dir, server_list_text=None):
    """Read control.log and every server.log under log_dir."""
    ev = MpsEvidence(log_dir=log_dir)
    ev.servers |= parse_server_list(server_list_text)
    control = os.path.join(log_dir, "control.log")
    servers = sorted(set(glob.glob(os.path.join(log_dir, "server.log")) +
                         glob.glob(os.path.join(log_dir, "*", "server.log"))))
    for path in [control] + servers:
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        ev.files.append(path)
        for line in text.splitlines():
            m = _CONTROL_CLIENT_RE.search(line) or _SERVER_CLIENT_RE.search(line)
            if m:
                ev.clients.add(int(m["pid"]))
            m = _SERVER_START_RE.search(line) or _SERVER_READY_RE.search(line)
            if m:
                ev.servers.add(int(m["pid"]))
            if _SERVER_FAIL_RE.search(line):
                ev.problems.append(line.strip())
    return ev


def judge(ev, pids=None):
    """(ok, reason). ok: MPS served clients, and every pid in pids was one."""
    if ev.problems:
        return False, "the MPS logs report a failure: " + "; ".join(ev.problems[:2])
    if not ev.files:
        return False, (f"no MPS log in {ev.log_dir} (control.log): the control daemon did not start "
                       f"there, or CUDA_MPS_LOG_DIRECTORY differs")
    if not ev.servers:
        return False, ("no MPS server was started: no CUDA process reached the control daemon "
                       "(CUDA_MPS_PIPE_DIRECTORY not passed to the ranks?), so they time-sliced the GPU")
    if not ev.clients:
        return False, "an MPS server exists but the logs show no client: the ranks did not use MPS"
    miss = ev.missing(pids or [])
    if miss:
        return False, (f"{len(miss)} of {len(pids)} rank process(es) never connected to MPS "
                       f"(pid {', '.join(map(str, miss[:8]))}): they ran without it")
    return True, ev.describe()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m ncclharness.mps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("evidence", help="did MPS serve clients? exit 0 yes, 4 no")
    e.add_argument("log_dir")
    e.add_argument("--server-list", default="", help="output of get_server_list")
    e.add_argument("--pids", default="", help="comma list of pids that must have been clients")
    args = ap.parse_args(argv)
    ev = read_evidence(args.log_dir, args.server_list)
    pids: Optional[List[int]] = [int(p) for p in args.pids.split(",") if p.strip()] or None
    ok, reason = judge(ev, pids)
    print(("MPS PROVEN: " if ok else "MPS NOT PROVEN: ") + reason)
    return 0 if ok else EXIT_NO_MPS


if __name__ == "__main__":
    sys.exit(main())
