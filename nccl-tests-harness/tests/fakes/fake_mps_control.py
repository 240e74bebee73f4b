"""Stands in for nvidia-cuda-mps-control in the tests.

  -d            start the "daemon": $CUDA_MPS_PIPE_DIRECTORY/control appears,
                control.log in $CUDA_MPS_LOG_DIRECTORY says so
  (stdin)       commands, one a line, as the real tool reads them:
                get_server_list  the server pid, if a client started one
                quit             the daemon (and server) go away
Without a running daemon, a command fails as the real tool does.
Knobs: FAKE_MPS_FAIL=1 (-d fails), FAKE_MPS_MUTE=1 (the daemon starts but
never answers: commands hang), FAKE_MPS_RECORD=<file> (one line per
start/quit, with the pipe dir), FAKE_MPS_HOLD_STDOUT=<pidfile> (-d leaves a
process behind that holds its stdout/stderr open)."""

import os
import sys
import time


def record(what, pipe):
    rec = os.environ.get("FAKE_MPS_RECORD")
    if rec:
        with open(rec, "a") as f:
            f.write(f"{what} {pipe}\n")


def main():
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    logdir = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    control = os.path.join(pipe, "control")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S.000")
    if sys.argv[1:] == ["-d"]:
        if os.environ.get("FAKE_MPS_FAIL"):
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        os.makedirs(pipe, exist_ok=True)
        os.makedirs(logdir, exist_ok=True)
        with open(control, "w") as f:
            f.write("mute\n" if os.environ.get("FAKE_MPS_MUTE") else "ok\n")
        with open(os.path.join(logdir, "control.log"), "a") as f:
            f.write(f"[{stamp} Control 4241] Starting control daemon using socket {pipe}/control\n")
        record("start", pipe)
        if os.environ.get("FAKE_MPS_HOLD_STDOUT"):
            # a daemon that keeps the caller's stdout/stderr open (as a real one may)
            import subprocess
            p = subprocess.Popen(["sleep", "30"], start_new_session=True)
            with open(os.environ["FAKE_MPS_HOLD_STDOUT"], "w") as f:
                f.write(str(p.pid))
        return 0
    if sys.argv[1:]:
        print(f"fake mps control: unknown option {sys.argv[1:]}", file=sys.stderr)
        return 1
    if not os.path.exists(control):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    with open(control) as f:
        if f.read().strip() == "mute":
            time.sleep(600)
    rc = 0
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "get_server_list":
            server = os.path.join(pipe, "server")
            if os.path.exists(server):
                with open(server) as f:
                    print(f.read().strip())
        elif cmd == "quit":
            for name in ("control", "server"):
                try:
                    os.unlink(os.path.join(pipe, name))
                except FileNotFoundError:
                    pass
            record("quit", pipe)
            try:   # the daemon logs where it was started; this client may not know where
                with open(os.path.join(logdir, "control.log"), "a") as f:
                    f.write(f"[{stamp} Control 4241] Exit\n")
            except OSError:
                pass
        elif cmd:
            print(f"unknown command {cmd}")
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
