"""Read the text nccl-tests' *_perf binaries print.

Layout (nccl-tests 2.13 .. 2.19; older and newer differ only in extra
columns, which the header names):

  # nThread 1 nGpus 1 minBytes 1024 maxBytes 1073741824 step: 2(factor) ...
  # Using devices
  #  Rank  0 Group  0 Pid  41630 on   gpu-node device  0 [0000:19:00] NVIDIA H200
  #
  #                                                              out-of-place                       in-place
  #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
  #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
          1024           256     float     sum      -1    41.23    0.02    0.02      0    40.11    0.03    0.03      0
  ...
  # Out of bounds values : 0 OK
  # Avg bus bandwidth    : 1.2345
  #
  # Collective test concluded: all_reduce_perf

The column header is read to find each field, so per-iteration columns
(-I 1), timestamps (-T) or a missing root column do not shift anything.
"""

import re
from dataclasses import dataclass, field
from typing import List, Optional

_RANK_RE = re.compile(
    r"^#\s+Rank\s+(?P<rank>\d+)(?:\s+Group\s+\d+)?\s+Pid\s+(?P<pid>\d+)\s+on\s+(?P<host>\S+)\s+device\s+(?P<dev>\d+)")
_AVG_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(?P<v>[-+0-9.eE]+|nan|inf)", re.I)
_OOB_RE = re.compile(r"^#\s*Out of bounds values\s*:\s*(?P<n>\d+)\s*(?P<verdict>\w*)")
_CONF_RE = re.compile(r"^#\s*nThread\s+(?P<nthread>\d+)\s+nGpus\s+(?P<ngpus>\d+)")
_FAIL_RE = re.compile(r"Test (NCCL |CUDA )?failure|Test timeout")
_DEFAULT_HEADER = ["size", "count", "type", "redop", "root",
                   "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"]


@dataclass
class PerfRow:
    size: int                 # bytes (nccl-tests' "size" column)
    count: int                # elements
    dtype: str
    redop: str
    oop_time_us: float
    oop_algbw: float
    oop_busbw: float
    oop_wrong: Optional[int]  # None when validation was off (N/A)
    ip_time_us: Optional[float] = None
    ip_algbw: Optional[float] = None
    ip_busbw: Optional[float] = None
    ip_wrong: Optional[int] = None

    def busbw(self, placement="out"):
        return self.oop_busbw if placement == "out" or self.ip_busbw is None else self.ip_busbw

    def algbw(self, placement="out"):
        return self.oop_algbw if placement == "out" or self.ip_algbw is None else self.ip_algbw

    def time_us(self, placement="out"):
        return self.oop_time_us if placement == "out" or self.ip_time_us is None else self.ip_time_us


@dataclass
class PerfOutput:
    rows: List[PerfRow] = field(default_factory=list)
    ranks: List[dict] = field(default_factory=list)   # {"rank","pid","host","device"}
    avg_busbw: Optional[float] = None
    out_of_bounds: Optional[int] = None
    nthreads: Optional[int] = None
    ngpus: Optional[int] = None
    failures: List[str] = field(default_factory=list)  # lines that report a failure
    concluded: bool = False

    @property
    def nranks(self):
        return len(self.ranks) or None

    def wrong_total(self):
        return sum((r.oop_wrong or 0) + (r.ip_wrong or 0) for r in self.rows)


def _num(tok):
    try:
        return float(tok)
    except ValueError:
        return None


def _wrong(tok):
    if tok in ("N/A", "n/a", "-"):
        return None
    v = _num(tok)
    return None if v is None else int(v)


def _header_tokens(line):
    toks = line.lstrip("#").split()
    return toks if toks[:2] == ["size", "count"] else None


def parse_perf_output(text):
    """Parse one run's stdout (NCCL log lines mixed in are ignored)."""
    out = PerfOutput()
    header = None
    for raw in text.splitlines():
        line = raw.rstrip()
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            m = _RANK_RE.match(s)
            if m:
                out.ranks.append({"rank": int(m["rank"]), "pid": int(m["pid"]),
                                  "host": m["host"], "device": int(m["dev"])})
                continue
            toks = _header_tokens(s)
            if toks:
                header = toks
                continue
            m = _AVG_RE.match(s)
            if m:
                out.avg_busbw = float(m["v"])
                continue
            m = _OOB_RE.match(s)
            if m:
                out.out_of_bounds = int(m["n"])
                if m["verdict"].upper() == "FAILED":
                    out.failures.append(s)
                continue
            m = _CONF_RE.match(s)
            if m:
                out.nthreads, out.ngpus = int(m["nthread"]), int(m["ngpus"])
                continue
            if "Collective test concluded" in s:
                out.concluded = True
            continue
        if _FAIL_RE.search(s):
            out.failures.append(s)
            continue
        toks = s.split()
        if not toks or not toks[0].isdigit() or len(toks) < 8:
            continue
        row = _parse_row(toks, header or _DEFAULT_HEADER)
        if row is not None:
            out.rows.append(row)
    return out


def _parse_row(toks, header):
    # Indices of the repeated measurement groups, in header order.
    idx = {}
    for i, name in enumerate(header):
        idx.setdefault(name, []).append(i)
    need = ("size", "count", "type", "time", "algbw", "busbw")
    if any(k not in idx for k in need):
        header = _DEFAULT_HEADER
        idx = {}
        for i, name in enumerate(header):
            idx.setdefault(name, []).append(i)
    def get(name, k=0, conv=_num):
        lst = idx.get(name, [])
        if k >= len(lst) or lst[k] >= len(toks):
            return None
        return conv(toks[lst[k]])

    size, count = get("size", conv=int), get("count", conv=int)
    oop = (get("time"), get("algbw"), get("busbw"))
    if size is None or count is None or any(v is None for v in oop):
        return None
    wrong_key = "#wrong" if "#wrong" in idx else ("error" if "error" in idx else None)
    row = PerfRow(size=size, count=count, dtype=get("type", conv=str) or "",
                  redop=get("redop", conv=str) or "",
                  oop_time_us=oop[0], oop_algbw=oop[1], oop_busbw=oop[2],
                  oop_wrong=get(wrong_key, 0, _wrong) if wrong_key else None)
    ip = (get("time", 1), get("algbw", 1), get("busbw", 1))
    if all(v is not None for v in ip):
        row.ip_time_us, row.ip_algbw, row.ip_busbw = ip
        row.ip_wrong = get(wrong_key, 1, _wrong) if wrong_key else None
    return row


def run_problems(perf, *, timed_out, rc, timeout_desc, nranks=None, require_validation=False):
    """What is wrong with one nccl-tests run, from its exit and its parsed
    output (an empty list: nothing). `nranks`: the rank count it must list;
    `require_validation`: a row without #wrong is a problem (correctness not
    shown)."""
    errors = []
    if timed_out:
        errors.append(f"timed out after {timeout_desc}")
    elif rc != 0:
        errors.append(f"exit status {rc}")
    if perf.failures:
        errors.append("nccl-tests reported: " + "; ".join(perf.failures[:3]))
    if not perf.rows:
        errors.append("no result rows in the output")
    if nranks is not None and perf.nranks is not None and perf.nranks != nranks:
        errors.append(f"nccl-tests listed {perf.nranks} ranks, not {nranks}")
    if perf.wrong_total():
        errors.append(f"{perf.wrong_total()} wrong elements (#wrong): data corrupted")
    if require_validation and any(r.oop_wrong is None for r in perf.rows):
        errors.append("#wrong not reported (validation off?): correctness not shown")
    if perf.out_of_bounds:
        errors.append(f"out of bounds values: {perf.out_of_bounds}")
    return errors
