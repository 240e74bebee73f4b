"""Read NCCL's own log (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET) and
decide which network carried the traffic.

NCCL prefixes every line with "<host>:<pid>:<tid> [<cudaDev>]", optionally
after a timestamp, then "NCCL INFO <msg>" or "<file>:<line> NCCL WARN <msg>".
The lines this module relies on (same wording in NCCL 2.18 .. 2.30):

  NCCL INFO NET/Plugin: Loaded net plugin rustnet (v10)      plugin file loaded
  NCCL INFO Using network rustnet                            network chosen for a communicator
  NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/rustnet/0
  NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/rustnet/0
                                                             a connection set up over that network
  NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC          (not the network: P2P or SHM)

"Using network X" alone only says which network NCCL picked; the channel
lines say that connections between ranks were then really made over it.
A proof needs both, in every process, and nothing naming another network.
"""

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

_LINE_RE = re.compile(
    r"(?P<host>[^\s:\[\]]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>-?\d+)\] "
    r"(?:(?P<where>\S.*?) )?NCCL (?P<level>INFO|WARN|TRACE) ?(?P<msg>.*)$")
_USING_RE = re.compile(r"^Using network (?P<name>\S+)")
_LOADED_RE = re.compile(r"NET/Plugin: Loaded net plugin (?P<name>\S+) \(v(?P<ver>\d+)\)")
_ASSIGNED_RE = re.compile(r"Assigned NET plugin (?P<name>\S+) to comm")
_CHANNEL_NET_RE = re.compile(r"^Channel \S+ : .*\bvia NET/(?P<name>[^/\s]+)/")
_CHANNEL_LOCAL_RE = re.compile(r"^Channel \S+ : .*\bvia (?P<kind>P2P|SHM)/")
_VERSION_RE = re.compile(r"NCCL version (?P<ver>\d+\.\d+\.\d+\S*)")


@dataclass
class ProcessLog:
    """What one process's NCCL log says."""
    host: str
    pid: int
    using_networks: List[str] = field(default_factory=list)
    loaded_plugins: List[List] = field(default_factory=list)   # [name, version]
    assigned: List[str] = field(default_factory=list)
    net_channels: Dict[str, int] = field(default_factory=dict)  # net name -> channel lines
    local_channels: Dict[str, int] = field(default_factory=dict)  # P2P/SHM -> lines
    warnings: List[str] = field(default_factory=list)
    plugin_messages: List[str] = field(default_factory=list)  # "NET/<plugin> : ..." lines
    nccl_version: Optional[str] = None

    @property
    def key(self):
        return f"{self.host}:{self.pid}"

    def to_dict(self):
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d):
        return cls(**d)


def parse_nccl_log(text, plugin_name="rustnet"):
    """Group NCCL lines by process. Returns {"host:pid": ProcessLog}."""
    procs = {}
    version = None
    own_prefix = f"NET/{plugin_name} : "
    for raw in text.splitlines():
        vm = _VERSION_RE.search(raw)
        if vm and version is None:
            version = vm["ver"]
        m = _LINE_RE.search(raw)
        if not m:
            continue
        host, pid = m["host"], int(m["pid"])
        key = f"{host}:{pid}"
        p = procs.get(key)
        if p is None:
            p = procs[key] = ProcessLog(host=host, pid=pid)
        msg = m["msg"].strip()
        if vm:
            p.nccl_version = vm["ver"]
        if m["level"] == "WARN":
            p.warnings.append(msg)
            continue
        if m["level"] != "INFO":
            continue
        if msg.startswith(own_prefix):
            p.plugin_messages.append(msg[len(own_prefix):])
        u = _USING_RE.match(msg)
        if u:
            p.using_networks.append(u["name"])
            continue
        lm = _LOADED_RE.search(msg)
        if lm:
            p.loaded_plugins.append([lm["name"], int(lm["ver"])])
            continue
        am = _ASSIGNED_RE.search(msg)
        if am:
            p.assigned.append(am["name"])
            continue
        cm = _CHANNEL_NET_RE.match(msg)
        if cm:
            p.net_channels[cm["name"]] = p.net_channels.get(cm["name"], 0) + 1
            continue
        lc = _CHANNEL_LOCAL_RE.match(msg)
        if lc:
            p.local_channels[lc["kind"]] = p.local_channels.get(lc["kind"], 0) + 1
    for p in procs.values():
        if p.nccl_version is None:
            p.nccl_version = version
    return procs


def merge_logs(*dicts):
    """Merge parse results of several files (same process may span files)."""
    out = {}
    for d in dicts:
        for key, p in d.items():
            if key not in out:
                out[key] = ProcessLog.from_dict({k: (list(v) if isinstance(v, list) else
                                                      dict(v) if isinstance(v, dict) else v)
                                                  for k, v in p.to_dict().items()})
                continue
            q = out[key]
            q.using_networks += p.using_networks
            q.loaded_plugins += p.loaded_plugins
            q.assigned += p.assigned
            q.warnings += p.warnings
            q.plugin_messages += p.plugin_messages
            for name, n in p.net_channels.items():
                q.net_channels[name] = q.net_channels.get(name, 0) + n
            for name, n in p.local_channels.items():
                q.local_channels[name] = q.local_channels.get(name, 0) + n
            q.nccl_version = q.nccl_version or p.nccl_version
    return out


@dataclass
class NetworkProof:
    expected: str
    ok: bool
    problems: List[str]
    facts: List[str]

    def describe(self):
        head = (f"PROVEN: NCCL's log shows the traffic went over '{self.expected}'" if self.ok else
                f"REFUSED: NCCL's log does not prove the traffic went over '{self.expected}'")
        lines = [head]
        lines += [f"  - {p}" for p in self.problems]
        lines += [f"  . {f}" for f in self.facts]
        return "\n".join(lines)

    def summary(self):
        """One line for the final report."""
        if not self.ok:
            return f"REFUSED {self.expected}: " + "; ".join(self.problems[:3])
        return f"proven {self.expected}: " + "; ".join(self.facts[:4])

    def to_dict(self):
        return dict(self.__dict__)


def _short_host(h):
    return h.split(".")[0]


def check_network(procs, expected, expected_processes=None, forbid_local=True,
                  plugin_name="rustnet"):
    """Decide whether the log proves that `expected` carried the traffic.

    procs: {"host:pid": ProcessLog} (or a list of ProcessLog).
    expected: the network name that must appear ("rustnet" or "Socket").
    expected_processes: an int (how many processes must have logged), or a
        list of (host, pid) pairs that must each be present, or None.
    forbid_local: refuse P2P/SHM channels (the one-host runs disable them, so
        any such line means some traffic did not cross the network)."""
    if isinstance(procs, dict):
        plist = list(procs.values())
    else:
        plist = list(procs)
    problems, facts = [], []
    exp = expected.casefold()
    if not plist:
        problems.append("no NCCL log lines at all: NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS including "
                        "INIT,NET must be in the environment of every rank, and NCCL must have started")
        return NetworkProof(expected, False, problems, facts)

    if isinstance(expected_processes, int):
        logged = [p for p in plist if p.using_networks]
        if len(logged) < expected_processes:
            problems.append(f"only {len(logged)} of {expected_processes} processes logged 'Using network'")
    elif expected_processes:
        have = {(_short_host(p.host), p.pid) for p in plist if p.using_networks}
        for host, pid in expected_processes:
            if (_short_host(host), int(pid)) not in have:
                problems.append(f"process {host}:{pid} (a rank nccl-tests listed) has no "
                                f"'Using network' line in the log")

    total_expected_channels = 0
    for p in sorted(plist, key=lambda q: q.key):
        if not p.using_networks:
            # A process that only printed WARNs or the version line, e.g. a
            # launcher, says nothing; only ranks count (checked above).
            continue
        others = sorted({n for n in p.using_networks if n.casefold() != exp})
        if others:
            problems.append(f"{p.key}: NCCL used network {', '.join(repr(o) for o in others)}, "
                            f"not '{expected}' (a fallback)")
        for name, n in sorted(p.net_channels.items()):
            if name.casefold() == exp:
                total_expected_channels += n
            else:
                problems.append(f"{p.key}: {n} channel connection(s) via NET/{name}, not NET/{expected}")
        if forbid_local and p.local_channels:
            kinds = ", ".join(f"{n} via {k}" for k, n in sorted(p.local_channels.items()))
            problems.append(f"{p.key}: connections that bypass the network ({kinds}); "
                            f"P2P and SHM must be disabled for this run")
        if p.warnings:
            facts.append(f"{p.key}: {len(p.warnings)} NCCL WARN line(s), first: {p.warnings[0]}")

    ranks = [p for p in plist if p.using_networks]
    if not ranks:
        problems.append("no process logged 'Using network': NCCL never chose a network "
                        "(was NCCL_DEBUG_SUBSYS missing INIT?)")
    if total_expected_channels == 0:
        problems.append(f"no channel connection 'via NET/{expected}/' in the log: no data path was "
                        f"set up over '{expected}' (were NET lines enabled with NCCL_DEBUG_SUBSYS=INIT,NET?)")

    versions = sorted({p.nccl_version for p in plist if p.nccl_version})
    if versions:
        facts.append(f"NCCL {', '.join(versions)}")
    facts.append(f"{len(ranks)} process(es) chose '{expected}'" if not problems else
                 f"{len(ranks)} process(es) logged a network choice")
    if total_expected_channels:
        facts.append(f"{total_expected_channels} channel connection(s) via NET/{expected}")
    loaded = Counter((n, v) for p in plist for n, v in p.loaded_plugins)
    for (name, ver), n in sorted(loaded.items()):
        facts.append(f"plugin '{name}' loaded as ncclNet v{ver} by {n} process(es)")
    if exp != plugin_name.casefold() and any(n.casefold() == plugin_name.casefold() for (n, _v) in loaded):
        facts.append(f"note: '{plugin_name}' was loaded although '{expected}' was expected")
    msgs = sorted({m for p in plist for m in p.plugin_messages})
    for m in msgs[:4]:
        facts.append(f"{plugin_name} said: {m}")
    return NetworkProof(expected, not problems, problems, facts)
