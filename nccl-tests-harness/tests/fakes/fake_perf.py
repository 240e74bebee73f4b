"""Stands in for an nccl-tests *_perf binary in the tests (no GPU, no NCCL).

It prints what nccl-tests prints and writes what NCCL would log, deciding
the network the way NCCL would from the environment the harness gave it:
the plugin only when NCCL_NET_PLUGIN=rustnet and libnccl-net-rustnet.so is
on LD_LIBRARY_PATH. Knobs for failure cases: FAKE_FALLBACK=1 (the plugin
"fails to init", NCCL silently uses Socket), FAKE_WRONG=1 (#wrong > 0),
FAKE_P2P=1 (some channels via P2P), FAKE_RC=n (exit status).
Under the fake mpirun (OMPI_COMM_WORLD_RANK set) or the fake mpiexec
(MPICH Hydra: PMI_RANK/PMI_SIZE) it acts as one rank of several; rank 0
prints the table after the others reported their pid and NCCL_HOSTID
through FAKE_RANKDIR.

For the kit tests (fake_mpiexec.py, fake_mps_control.py):
  MPS: with CUDA_MPS_PIPE_DIRECTORY pointing at a running fake daemon, each
    rank "connects" as the CUDA driver would: the daemon's logs get a client
    line with its pid (and a server is started on first use).
    FAKE_MPS_IGNORED=1: the ranks do not find the daemon (run without MPS).
  FAKE_GBPS_<NET>=a,b,c (NET = RUSTNET or SOCKET): busbw scale of the k-th
    run of the same (test, ranks, network) (counted in FAKE_STATE_DIR).
  FAKE_HANG=test:ranks:net[:k]: that run (the k-th, default every) hangs.
  FAKE_RUN_RECORD: rank 0 appends "test ranks network" per run.
  FAKE_STATE_DIR/pids: every rank writes its pid there (leftover checks)."""

import getopt
import os
import socket
import sys
import time

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "sendrecv": lambda n: 1.0}


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def mps_connect(env, pid):
    """What the CUDA driver does at start-up: find the MPS control daemon
    through CUDA_MPS_PIPE_DIRECTORY; if it runs, become its client."""
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if not pipe or env.get("FAKE_MPS_IGNORED") or not os.path.exists(os.path.join(pipe, "control")):
        return False
    logdir = env.get("CUDA_MPS_LOG_DIRECTORY", pipe)
    server = os.path.join(pipe, "server")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S.000")
    with open(os.path.join(logdir, "control.log"), "a") as f:
        if not os.path.exists(server):
            with open(server, "w") as s:
                s.write("4242\n")
            f.write(f"[{stamp} Control 4241] Starting new server 4242 for user 0\n")
            f.write(f"[{stamp} Control 4241] NEW SERVER 4242: Ready\n")
        f.write(f"[{stamp} Control 4241] NEW CLIENT {pid} from user 0: Server already exists\n")
    with open(os.path.join(logdir, "server.log"), "a") as f:
        f.write(f"[{stamp} Server 4242] New client {pid} connected\n")
    return True


def run_count(env, rank, key):
    """How many runs of this (test, ranks, network) so far, this one included
    (rank 0 counts; the others read its count from the launch's rank dir)."""
    state = env.get("FAKE_STATE_DIR")
    if not state:
        return 1
    path = os.path.join(state, "count-" + key)
    # beside this launch's rank dir, not in it (rank 0 reads every file there)
    mine = env.get("FAKE_RANKDIR", os.path.join(state, "launch")) + ".nth"
    if rank == 0:
        n = int(read_or(path, "0")) + 1
        with open(path, "w") as f:
            f.write(str(n))
        with open(mine + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(mine + ".tmp", mine)
        return n
    deadline = time.time() + 20
    while not os.path.exists(mine) and time.time() < deadline:
        time.sleep(0.02)
    return int(read_or(mine, "1"))


def read_or(path, default):
    try:
        with open(path) as f:
            return f.read().strip() or default
    except OSError:
        return default


def main():
    name = os.path.basename(sys.argv[1])
    coll = name.replace("_perf", "").replace("_mpi", "")
    opts, _ = getopt.getopt(sys.argv[2:], "b:e:f:g:n:w:c:")
    o = dict(opts)
    lo, hi, fac = parse_size(o.get("-b", "8")), parse_size(o.get("-e", "128M")), int(o.get("-f", "2"))
    ngpus, check = int(o.get("-g", "1")), int(o.get("-c", "1"))
    host = socket.gethostname().split(".")[0]
    pid = os.getpid()
    env = os.environ
    mpi_rank = env.get("OMPI_COMM_WORLD_RANK", env.get("PMI_RANK"))
    if mpi_rank is not None:
        rank = int(mpi_rank)
        nprocs = int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE", "1")))
        if env.get("NCCL_TESTS_DEVICE") != "0":
            print("Test failure: NCCL_TESTS_DEVICE not 0 for a one-GPU run")
            return 1
        rd = env["FAKE_RANKDIR"]
        with open(os.path.join(rd, f"rank{rank}.tmp"), "w") as f:
            f.write(f"{pid} {env.get('NCCL_HOSTID', '')}")
        os.replace(os.path.join(rd, f"rank{rank}.tmp"), os.path.join(rd, f"rank{rank}"))
        ranks = []
        deadline = time.time() + 20
        while rank == 0 and len(ranks) < nprocs and time.time() < deadline:
            ranks = [open(os.path.join(rd, p)).read().split() for p in sorted(os.listdir(rd)) if not p.endswith(".tmp")]
            time.sleep(0.02)
        if rank == 0 and len({r[1] for r in ranks}) != nprocs:
            print(f"Test failure: NCCL_HOSTID not distinct per rank: {ranks}")
            return 1
        rank_lines = [(i, int(r[0]), 0) for i, r in enumerate(ranks)]
        nranks = nprocs
    else:
        rank, nranks = 0, ngpus
        rank_lines = [(i, pid, i) for i in range(ngpus)]

    state = env.get("FAKE_STATE_DIR")
    if state:
        os.makedirs(os.path.join(state, "pids"), exist_ok=True)
        with open(os.path.join(state, "pids", str(pid)), "w") as f:
            f.write(coll)
    mps_connect(env, pid)
    plugin_dir_ok = any(os.path.exists(os.path.join(d, "libnccl-net-rustnet.so"))
                        for d in env.get("LD_LIBRARY_PATH", "").split(":") if d)
    use_plugin = env.get("NCCL_NET_PLUGIN") == "rustnet" and plugin_dir_ok and not env.get("FAKE_FALLBACK")
    net = "rustnet" if use_plugin else "Socket"
    if env.get("NCCL_NET") and env["NCCL_NET"].lower() != net.lower() and not env.get("FAKE_FALLBACK"):
        print(f"{host}:{pid}:{pid} [0] misc.cc:1 NCCL WARN Error: network {env['NCCL_NET']} not found.")
        print(f"{host}: Test NCCL failure common.cu:1 'invalid usage'")
        return 1
    log = []
    p = f"{host}:{pid}:{pid + 1} [0] NCCL INFO "
    if env.get("NCCL_NET_PLUGIN") == "rustnet" and plugin_dir_ok:
        log.append(p + "NET/Plugin: Loaded net plugin rustnet (v10)")
        if env.get("FAKE_FALLBACK"):
            log.append(p + "Failed to initialize NET plugin rustnet")
        else:
            log.append(p + "NET/rustnet : using TCP on lo (1 stream(s) per connection)")
    for g in range(ngpus if mpi_rank is None else 1):
        me = rank if mpi_rank is not None else g
        peer = (me + 1) % nranks
        q = f"{host}:{pid}:{pid + 2} [{g}] NCCL INFO "
        log.append(q + f"Using network {net}")
        log.append(q + f"Channel 00/0 : {me}[0] -> {peer}[0] [send] via NET/{net}/0")
        log.append(q + f"Channel 00/0 : {peer}[0] -> {me}[0] [receive] via NET/{net}/0")
        if env.get("FAKE_P2P"):
            log.append(q + f"Channel 01/0 : {me}[0] -> {peer}[0] via P2P/IPC")
    text = "\n".join(log) + "\n"
    dbg = env.get("NCCL_DEBUG_FILE")
    if env.get("NCCL_DEBUG") == "INFO":
        if dbg:
            with open(dbg.replace("%h", host).replace("%p", str(pid)), "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
    nth = run_count(env, rank, f"{coll}-{nranks}-{net}")
    hang = env.get("FAKE_HANG", "").split(":")
    if len(hang) >= 3 and hang[:3] == [coll, str(nranks), net] and (len(hang) < 4 or int(hang[3]) == nth):
        time.sleep(600)
    if rank != 0:
        return int(env.get("FAKE_RC", "0"))
    if env.get("FAKE_RUN_RECORD"):
        with open(env["FAKE_RUN_RECORD"], "a") as f:
            f.write(f"{coll} {nranks} {net}\n")
    print(f"# nThread 1 nGpus {ngpus} minBytes {lo} maxBytes {hi} step: {fac}(factor) warmup iters: 5 iters: 20 "
          f"agg iters: 1 validation: {check} graph: 0\n#\n# Using devices")
    for r, rpid, dev in rank_lines:
        print(f"#  Rank {r:2d} Group  0 Pid {rpid:6d} on {host:>10} device {dev:2d} [0000:19:00] NVIDIA H200")
    print("#\n#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   "
          "busbw #wrong\n#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)"
          "  (GB/s)  (GB/s)")
    gbps = 2.2 if use_plugin else 2.0
    sched = env.get("FAKE_GBPS_" + net.upper())
    if sched:
        vals = [float(x) for x in sched.split(",")]
        gbps = vals[min(nth, len(vals)) - 1]
    factor = FACTORS.get(coll, lambda n: (n - 1) / n)(nranks)
    size, total = lo, 0.0
    while size <= hi:
        t = 20e-6 + size / (gbps * 1e9)
        alg = size / t / 1e9
        wrong = "4" if env.get("FAKE_WRONG") and size == hi else "0"
        if not check:
            wrong = "N/A"
        print(f"{size:12d}  {size // 4:12d}     float     sum      -1  {t * 1e6:7.2f}  {alg:6.2f}  {alg * factor:6.2f}"
              f"  {wrong:>6}  {t * 1e6:7.2f}  {alg:6.2f}  {alg * factor:6.2f}  {wrong:>6}")
        total += alg * factor
        size *= fac
    print("# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 1.0 \n#\n# Collective test concluded: " + name)
    return int(env.get("FAKE_RC", "0"))


if __name__ == "__main__":
    sys.exit(main())
