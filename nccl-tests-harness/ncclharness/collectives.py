"""The collectives the harness runs and nccl-tests' bandwidth definitions.

nccl-tests reports, per size:
  size   = the larger of one rank's send and receive buffer, in bytes
  algbw  = size / time                       (GB/s, 1 GB = 1e9 bytes)
  busbw  = algbw * factor(nranks)
with factor = 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and alltoall, and 1 for sendrecv.  busbw is the rate each
rank's link must sustain, so it is comparable across collectives and rank
counts; it is the number the plugin-vs-built-in comparison uses.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    name: str          # our short name, also the nccl-tests stem
    binary: str        # nccl-tests binary
    torch_call: str    # the torch.distributed call torch_sweep.py makes
    factor_kind: str   # "allreduce", "gather", "one"

    def bus_factor(self, nranks):
        if nranks < 1:
            raise ValueError("nranks must be >= 1")
        if self.factor_kind == "allreduce":
            return 2.0 * (nranks - 1) / nranks
        if self.factor_kind == "gather":
            return (nranks - 1) / nranks
        return 1.0

    def buffer_elements(self, size_bytes, nranks, elt_size=4):
        """(elements per rank chunk, reported size in bytes) for a requested
        size, rounded the way nccl-tests rounds it, so a torch run at "size S"
        moves exactly what all_reduce_perf etc. move at S.

        all_reduce, sendrecv: one buffer of size/elt elements.
        all_gather: each rank contributes base elements, output n*base;
        reduce_scatter: input n*base, output base;
        alltoall: n chunks of base elements each way;
        with base = (size/elt/n) rounded down to a multiple of 16 bytes."""
        count = size_bytes // elt_size
        if self.factor_kind == "allreduce" or self.name == "sendrecv":
            return count, count * elt_size
        align = max(1, 16 // elt_size)
        base = (count // nranks) & ~(align - 1)
        return base, base * nranks * elt_size


COLLECTIVES = {
    "all_reduce": Collective("all_reduce", "all_reduce_perf", "all_reduce", "allreduce"),
    "all_gather": Collective("all_gather", "all_gather_perf", "all_gather_into_tensor", "gather"),
    "reduce_scatter": Collective("reduce_scatter", "reduce_scatter_perf", "reduce_scatter_tensor", "gather"),
    "alltoall": Collective("alltoall", "alltoall_perf", "all_to_all_single", "gather"),
    "sendrecv": Collective("sendrecv", "sendrecv_perf", "batch_isend_irecv", "one"),
}
DEFAULT_ORDER = ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"]
_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
            "all_to_all": "alltoall", "send_recv": "sendrecv", "p2p": "sendrecv"}


def parse_collectives(text):
    """'all_reduce,alltoall' or 'all' -> list of names (validated)."""
    if text.strip() in ("", "all"):
        return list(DEFAULT_ORDER)
    out = []
    for part in text.split(","):
        key = part.strip().lower()
        if key.endswith("_perf"):
            key = key[: -len("_perf")]
        key = _ALIASES.get(key, key)
        if key not in COLLECTIVES:
            raise ValueError(f"unknown collective {part!r}; choose from {', '.join(DEFAULT_ORDER)}")
        if key not in out:
            out.append(key)
    return out


def algbw_gbps(size_bytes, seconds):
    if seconds <= 0:
        raise ValueError("time must be positive")
    return size_bytes / 1e9 / seconds


def busbw_gbps(collective, size_bytes, seconds, nranks):
    return algbw_gbps(size_bytes, seconds) * COLLECTIVES[collective].bus_factor(nranks)
