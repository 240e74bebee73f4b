"""Run processes with their output in log files and a hard time limit.

Every process is started in its own session so that on a timeout the whole
group it started (e.g. torch's or MPI's children) can be ended by its id."""

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import List, Optional


@dataclass
class Proc:
    argv: List[str]
    log_path: str
    popen: Optional[subprocess.Popen] = None
    rc: Optional[int] = None
    timed_out: bool = False
    seconds: float = 0.0


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_group(popen, grace=5.0):
    try:
        pgid = os.getpgid(popen.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            popen.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class _Follower:
    """Prints the new lines of a log file as they appear (NCCL INFO lines
    left out), so a long run shows its progress."""

    def __init__(self, path, prefix="   | "):
        self.path, self.prefix, self.pos, self.buf = path, prefix, 0, b""

    def poll(self, final=False):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return
        self.pos += len(data)
        self.buf += data
        lines = self.buf.split(b"\n")
        self.buf = b"" if final else lines.pop()
        for ln in lines:
            text = ln.decode("utf-8", "replace").rstrip()
            if text and " NCCL INFO " not in text:
                print(self.prefix + text, flush=True)


def run_group(specs, timeout_s, fail_fast_grace=30.0, cwd=None, follow=None):
    """Start all processes of one run together and wait for all.

    specs: list of (argv, env, log_path). If one exits non-zero the others get
    fail_fast_grace seconds to finish (a rank whose peer died usually hangs)
    before they are ended. follow: index of a spec whose log is echoed live.
    Returns the list of Proc."""
    procs = []
    try:
        return _run_group(procs, specs, timeout_s, fail_fast_grace, cwd, follow)
    except BaseException:
        # Interrupted (SIGTERM turned into an exception, Ctrl-C): the groups
        # run in their own sessions, so nobody else would end them.
        for p in procs:
            if p.popen is not None and p.popen.poll() is None:
                _end_group(p.popen, grace=2.0)
        raise


def _run_group(procs, specs, timeout_s, fail_fast_grace, cwd, follow):
    start = time.monotonic()
    for argv, env, log_path in specs:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        logf = open(log_path, "wb")
        try:
            po = subprocess.Popen(argv, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
        finally:
            logf.close()
        procs.append(Proc(argv=list(argv), log_path=log_path, popen=po))
    deadline = start + timeout_s
    failed_at = None
    follower = _Follower(specs[follow][2]) if follow is not None else None
    while True:
        if follower:
            follower.poll()
        running = [p for p in procs if p.rc is None]
        for p in running:
            rc = p.popen.poll()
            if rc is not None:
                p.rc = rc
                p.seconds = time.monotonic() - start
                if rc != 0 and failed_at is None:
                    failed_at = time.monotonic()
        running = [p for p in procs if p.rc is None]
        if not running:
            break
        now = time.monotonic()
        if now >= deadline or (failed_at is not None and now - failed_at > fail_fast_grace):
            for p in running:
                p.timed_out = now >= deadline
                _end_group(p.popen)
                p.rc = p.popen.returncode if p.popen.returncode is not None else -9
                p.seconds = time.monotonic() - start
            break
        time.sleep(0.1)
    if follower:
        follower.poll(final=True)
    return procs


def read_text(path):
    """A log file's text ('' if it is not there)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tail(path, nlines=25):
    try:
        with open(path, "rb") as f:
            data = f.read()[-20000:]
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-nlines:])
