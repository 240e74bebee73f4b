"""Byte sizes as nccl-tests spells them: K, M, G, T are powers of 1024."""

import re

_MULT = {
    "": 1, "B": 1,
    "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10,
    "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
    "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
    "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text):
    """'1K' -> 1024, '64MiB' -> 67108864, '4096' -> 4096 (binary multiples,
    as nccl-tests' -b/-e options read them)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).upper() not in _MULT:
        raise ValueError(f"not a size: {text!r} (use a byte count, optionally with K, M, G or T)")
    value = float(m.group(1)) * _MULT[m.group(2).upper()]
    if value != int(value) or value < 0:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_size(n):
    """4096 -> '4 KiB', 1536 -> '1.5 KiB', 100 -> '100 B'."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            v = n / mult
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def short_size(n):
    """Compact label for plot axes: 1K, 64M, 1G."""
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def size_sweep(min_bytes, max_bytes, factor=2):
    """Sizes from min to max multiplying by factor, like nccl-tests -b/-e/-f."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"bad size range {min_bytes}..{max_bytes}")
    if factor < 2:
        raise ValueError("step factor must be at least 2")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out
