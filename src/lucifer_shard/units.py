"""One unit system for every report: sizes in binary units (KiB, MiB, GiB, TiB), rates in GiB/s.

JSON carries plain integers (bytes) and seconds; only text is rounded.
"""
from __future__ import annotations

_PREFIXES = ("B", "KiB", "MiB", "GiB", "TiB")
GIB = 1 << 30
# Binary like every report: K, M, G, T and KiB..TiB are powers of 1024 (as dd, truncate and
# `numfmt --from=iec` read them); only the spelled-out KB..TB are powers of 1000.
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": GIB, "t": 1 << 40,
               "kib": 1 << 10, "mib": 1 << 20, "gib": GIB, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE_SYNTAX = ("K, M, G, T (4G) and KiB, MiB, GiB, TiB are binary (4G = 4 GiB = 4 x 2^30 bytes, as dd reads it); "
               "KB, MB, GB, TB are decimal")


def size(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1: 512 B, 3.50 MiB, 169.27 GiB."""
    for i, unit in enumerate(_PREFIXES):
        if abs(n) < 1024 or i == len(_PREFIXES) - 1:
            return f"{n:.0f} {unit}" if i == 0 else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def size_flag(n: int) -> str:
    """A byte count as a size option takes it: 16777216 -> 16M, 4294967296 -> 4G (parse_size reads it back)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GIB:.2f} GiB/s"


def duration(seconds: float) -> str:
    """A human time span: 4.2 s, 42 s, 3 min 20 s, 1 h 05 min."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def parse_size(text: str) -> int:
    """`4G`, `4GiB`, `500MB`, `1048576` -> bytes (see SIZE_SYNTAX); ValueError on anything else."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value < 0:
        raise ValueError(f"{text!r}: expected a size like 4G, 4GiB, 500MB or 1048576")
    return int(value * _SIZE_UNITS[unit])


# A link's rate: a size per second (1GiB/s, 500MB/s, 200M/s: SIZE_SYNTAX) or bits per second as links are
# sold, decimal (10Gbit/s = 10^10 bits/s = 1.25 GB/s; 1Gbps the same as 1Gbit/s).
_BIT_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
RATE_SYNTAX = "a size per second (1GiB/s, 500MB/s) or bits per second, decimal as links are sold (10Gbit/s, 1Gbps)"


def parse_rate(text: str) -> float:
    """`1GiB/s`, `500MB/s`, `10Gbit/s`, `1Gbps` -> bytes per second (see RATE_SYNTAX); ValueError on
    anything else, or on a rate of 0."""
    t = text.strip().lower().replace(" ", "")
    bits = next((t[:-len(end)] for end in ("bit/s", "bps") if t.endswith(end)), None)
    try:
        if bits is not None:
            unit = bits[-1:] if bits[-1:].isalpha() else ""
            value = float(bits[:len(bits) - len(unit)]) * _BIT_PREFIXES[unit] / 8
        elif t.endswith("/s"):
            value = float(parse_size(t[:-2]))
        else:
            raise ValueError(text)
    except (ValueError, KeyError):
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{text!r}: expected a rate like 1GiB/s, 500MB/s or 10Gbit/s")
    return value


def byte_bar(total: int, desc: str, enabled: bool):
    """A tqdm progress bar over bytes in binary units (MiB, GiB/s; tqdm writes the kilo prefix as `ki`)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled)
