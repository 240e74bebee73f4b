"""Where the CPU went during one run: CPU seconds per kind of thread, summed
over the rank processes, and how idle the whole machine was.

Why: on one host several ranks share the CPUs. When the network looks slow
at 8 ranks on 16 CPUs the question is whether the machine ran out of CPU and
which threads took it (the benchmark's main thread polling its stream, NCCL's
proxy thread moving the bytes, the plugin's helpers), for both networks in
the same way. Linux only (/proc); elsewhere the sampler records nothing.

The sampler reads /proc/<pid>/task/<tid>/stat of every process whose name is
the benchmark binary's, every `period` seconds while the run lasts, and keeps
the last utime+stime seen per thread (a thread that ends between two samples
loses at most one period). /proc/stat gives the machine's idle share over the
same interval.
"""

import os
import statistics
import threading
import time

# Thread kinds, by the thread's name (comm, at most 15 characters).
KINDS = ("main", "proxy", "plugin", "cuda", "other")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def kind_of(thread_comm, process_comm):
    """The kind of one thread, from its name and its process's name."""
    if thread_comm == process_comm:
        return "main"
    if thread_comm.startswith("NCCL Progress") or thread_comm.startswith("NCCL Proxy") \
            or thread_comm.startswith("NCCL Service"):
        return "proxy"
    if thread_comm.startswith("rustnet") or thread_comm.startswith("NCCL Sock"):
        # the plugin's helpers, and NCCL's own socket helper threads (NCCL_SOCKET_NTHREADS)
        return "plugin"
    if thread_comm.startswith("cuda"):
        return "cuda"
    return "other"


def parse_task_stat(text):
    """(comm, cpu_ticks) from one /proc/.../stat line, or None."""
    try:
        lpar, rpar = text.index("("), text.rindex(")")
    except ValueError:
        return None
    comm = text[lpar + 1:rpar]
    rest = text[rpar + 2:].split()
    # after the comm: state(3) ppid ... utime is field 14, stime 15 (1-based),
    # i.e. rest[11] and rest[12]
    if len(rest) < 13:
        return None
    try:
        return comm, int(rest[11]) + int(rest[12])
    except ValueError:
        return None


def read_machine_ticks(path="/proc/stat"):
    """(idle_ticks, total_ticks) over all CPUs, or None."""
    try:
        with open(path) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    v = [int(x) for x in first[1:9]]
    return v[3] + v[4], sum(v)


class ThreadCpu:
    """Samples the CPU time of the threads of processes named `process_comm`."""

    def __init__(self, process_comm, period=0.2, proc="/proc"):
        self.process_comm = process_comm[:15]
        self.period = period
        self.proc = proc
        self.seen = {}          # (pid, tid) -> (kind, ticks)
        self._stop = threading.Event()
        self._thread = None
        self._m0 = self._m1 = None
        self._t0 = self._t1 = None

    def sample(self):
        try:
            pids = [p for p in os.listdir(self.proc) if p.isdigit()]
        except OSError:
            return
        for pid in pids:
            try:
                with open(os.path.join(self.proc, pid, "comm")) as f:
                    if f.read().strip() != self.process_comm:
                        continue
                tids = os.listdir(os.path.join(self.proc, pid, "task"))
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(os.path.join(self.proc, pid, "task", tid, "stat")) as f:
                        st = parse_task_stat(f.read())
                except OSError:
                    continue
                if st:
                    comm, ticks = st
                    key = (int(pid), int(tid))
                    old = self.seen.get(key)
                    if old is None or ticks >= old[1]:
                        self.seen[key] = (kind_of(comm, self.process_comm), ticks)

    def _loop(self):
        while not self._stop.wait(self.period):
            self.sample()

    def start(self):
        self._m0, self._t0 = read_machine_ticks(), time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="threadcpu", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join()
        self._m1, self._t1 = read_machine_ticks(), time.monotonic()
        return self.result()

    def result(self):
        """{'wall_s', 'idle_pct', 'ranks', 'cpu_<kind>_s' ...}; CPU seconds summed over ranks."""
        out = {f"cpu_{k}_s": 0.0 for k in KINDS}
        for kind, ticks in self.seen.values():
            out[f"cpu_{kind}_s"] += ticks / _TICK
        out["cpu_total_s"] = sum(out[f"cpu_{k}_s"] for k in KINDS)
        out["ranks"] = len({pid for pid, _ in self.seen})
        out["wall_s"] = (self._t1 - self._t0) if (self._t0 is not None and self._t1 is not None) else 0.0
        if self._m0 and self._m1 and self._m1[1] > self._m0[1]:
            out["idle_pct"] = 100.0 * (self._m1[0] - self._m0[0]) / (self._m1[1] - self._m0[1])
        else:
            out["idle_pct"] = None
        return out


def describe(r):
    """One line: CPU seconds per kind, and the machine's idle share."""
    if not r or not r.get("ranks"):
        return "cpu: no rank threads seen"
    parts = [f"{k} {r[f'cpu_{k}_s']:.1f}" for k in KINDS if r[f"cpu_{k}_s"] > 0.05]
    idle = "?" if r.get("idle_pct") is None else f"{r['idle_pct']:.0f}%"
    return (f"cpu: {r['cpu_total_s']:.1f} s in {r['ranks']} rank(s) over {r['wall_s']:.1f} s "
            f"({', '.join(parts) or 'none'}); machine idle {idle}")


def summary_table(rows):
    """rows: (collective, nranks, network, result). Median over repeats of the
    CPU seconds per kind per run, all ranks together, and the machine's idle
    share, one line per (collective, ranks, network)."""
    groups = {}
    for coll, n, net, r in rows:
        groups.setdefault((coll, n, net), []).append(r)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    head = f"{'test':<12}{'ranks':>6} {'network':<9}{'runs':>5}{'wall s':>8}{'cpu s':>8}" + \
        "".join(f"{k:>8}" for k in KINDS) + f"{'idle':>7}"
    lines = ["CPU per run (median over repeats; seconds summed over the ranks' threads; "
             "main = the benchmark's own thread, proxy = NCCL's proxy threads, plugin = helper threads)",
             head]
    for (coll, n, net), rs in sorted(groups.items()):
        idle = med([r.get("idle_pct") for r in rs])
        lines.append(f"{coll:<12}{n:>6} {net:<9}{len(rs):>5}{med([r['wall_s'] for r in rs]):>8.1f}"
                     f"{med([r['cpu_total_s'] for r in rs]):>8.1f}"
                     + "".join(f"{med([r[f'cpu_{k}_s'] for r in rs]):>8.1f}" for k in KINDS)
                     + (f"{idle:>6.0f}%" if idle is not None else f"{'?':>7}"))
    return "\n".join(lines)
