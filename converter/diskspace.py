"""Room on OUT's filesystem: measured before the first byte, and explained when a write runs out.

The sizes come from the plan (every rank file, journal line and the manifest are sized exactly
before anything is written), so the errors say how much is still to write, on which filesystem,
and how much must be freed, not what one file happened to miss.
"""
from __future__ import annotations

import errno
import os
import re
import resource
from pathlib import Path

from .errors import OutputError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
WRITE_LIMITS = (*DISK_FULL, errno.EFBIG)


def free_bytes(path: Path) -> int:
    """Bytes this process may still write on the filesystem of `path` (root may use the reserve)."""
    st = os.statvfs(path)
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def on_disk(sizes: list[int], path: Path) -> int:
    """Bytes `sizes` occupy as files on the filesystem of `path`: each rounded up to whole blocks."""
    block = os.statvfs(path).f_frsize or 1
    return sum(-(-s // block) * block for s in sizes)


def filesystem(path: Path) -> str:
    """'/data (ext4 on /dev/nvme0n1p2)': the mount point holding `path`, its type and device."""
    real = os.path.realpath(path)
    best = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, point, fstype = (_unescape(x) for x in line.split()[:3])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= len(best[1])):
                    best = (device, point, fstype)
    except OSError:
        pass
    if best is None:
        return f"the filesystem of {path}"
    device, point, fstype = best
    return f"{point} ({fstype})" if device == fstype else f"{point} ({fstype} on {device})"


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def check_room(out: Path, sizes: list[int], then: str) -> None:
    """Refuse, before writing, when the files still to write do not fit."""
    need, free = on_disk(sizes, out), free_bytes(out)
    if need > free:
        raise OutputError(f"{out}: {sum(sizes):,} bytes still to write ({need:,} on disk) but {filesystem(out)} "
                          f"has {free:,} bytes free; free at least {need - free:,} bytes, then {then}")


def write_failed(err: OSError, out: Path, sizes: list[int], largest: int) -> OutputError:
    """The one-line error for a write that hit a full disk, a quota or the file-size limit."""
    where = err.filename or out
    if err.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        cap = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,} bytes"
        return OutputError(f"{where}: write failed ({err.strerror}): this process may write files of at most {cap} "
                           f"(ulimit -f) and the largest rank file is {largest:,} bytes; raise the limit and run the "
                           f"same command with --resume (or lower --max-file-size and run with --force)")
    need, free = on_disk(sizes, out), free_bytes(out)
    short = (f"free at least {need - free:,} more bytes, then run" if need > free
             else "there is room now: run")
    return OutputError(f"{where}: write failed ({err.strerror}): {sum(sizes):,} bytes of this conversion are still "
                       f"to write ({need:,} on disk) and {filesystem(out)} has {free:,} bytes free; {short} the same "
                       f"command with --resume")
