"""Stands in for an nccl-tests *_perf binary in the tests (no GPU, no NCCL).

It prints what nccl-tests prints and writes what NCCL would log, deciding
the network the way NCCL would from the environment the harness gave it:
the plugin only when NCCL_NET_PLUGIN=rustnet and libnccl-net-rustnet.so is
on LD_LIBRARY_PATH. Knobs for failure cases: FAKE_FALLBACK=1 (the plugin
"fails to init", NCCL silently uses Socket), FAKE_WRONG=1 (#wrong > 0),
FAKE_P2P=1 (some channels via P2P), FAKE_RC=n (exit status).
Under the fake mpirun (OMPI_COMM_WORLD_RANK set) it acts as one rank of
several; rank 0 prints the table after the others reported their pid and
NCCL_HOSTID through FAKE_RANKDIR."""

import getopt
import os
import socket
import sys
import time

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "sendrecv": lambda n: 1.0}


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


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
    mpi_rank = env.get("OMPI_COMM_WORLD_RANK")
    if mpi_rank is not None:
        rank, nprocs = int(mpi_rank), int(env["OMPI_COMM_WORLD_SIZE"])
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
    if rank != 0:
        return int(env.get("FAKE_RC", "0"))
    print(f"# nThread 1 nGpus {ngpus} minBytes {lo} maxBytes {hi} step: {fac}(factor) warmup iters: 5 iters: 20 "
          f"agg iters: 1 validation: {check} graph: 0\n#\n# Using devices")
    for r, rpid, dev in rank_lines:
        print(f"#  Rank {r:2d} Group  0 Pid {rpid:6d} on {host:>10} device {dev:2d} [0000:19:00] NVIDIA H200")
    print("#\n#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   "
          "busbw #wrong\n#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)"
          "  (GB/s)  (GB/s)")
    gbps = 2.2 if use_plugin else 2.0
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
