"""Room on OUT's filesystem: checked before the first byte, and explained when a write runs out.

The sizes come from the plan (every rank file, journal line and the manifest are sized exactly
before anything is written; `outstate.sizes_to_write`), so the errors say how much is still to
write, on which filesystem, and how much must be freed, not what one file happened to miss.
"""
from __future__ import annotations

import errno
import os
import re
import resource
from pathlib import Path

from ..errors import CONVERT_RESUME, DISK_FULL, EnvironmentRefused, LuciferError, NoRoom, Remedy
from ..guarded_io import read_regular
from ..units import size

WRITE_LIMITS = (*DISK_FULL, errno.EFBIG)
INODE_SLACK = 16  # folders and temporary files a conversion creates besides its files


def existing(path: Path) -> Path:
    """`path`, or its nearest existing ancestor (the filesystem an OUT not created yet will be on)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem that holds (or will hold) `path`."""
    st = os.statvfs(existing(path))
    return st.f_bavail * st.f_frsize


def free_inodes(path: Path) -> int | None:
    """Files an unprivileged writer may still create there, or None where the filesystem does not
    count them (btrfs, some network filesystems report 0 inodes in all)."""
    st = os.statvfs(existing(path))
    return st.f_favail if st.f_files else None


def on_disk(sizes: list[int], path: Path) -> int:
    """Bytes `sizes` occupy as files on the filesystem of `path`: each rounded up to whole blocks."""
    block = os.statvfs(existing(path)).f_frsize or 1
    return sum(-(-s // block) * block for s in sizes)


def filesystem(path: Path) -> str:
    """'/data (ext4 on /dev/nvme0n1p2)': the mount point holding `path`, its type and device."""
    real = os.path.realpath(existing(path))
    best = None
    try:
        mounts = read_regular("/proc/mounts", follow=True).decode(errors="replace")
    except (OSError, LuciferError):
        mounts = ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        device, point, fstype = (_unescape(x) for x in fields[:3])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[1])):
            best = (device, point, fstype)
    if best is None:
        return f"the filesystem of {path}"
    device, point, fstype = best
    return f"{point} ({fstype})" if device == fstype else f"{point} ({fstype} on {device})"


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def shortfall(needed: int, free: int, given_back: int = 0) -> int:
    """Bytes missing on the filesystem (0 when the conversion fits)."""
    return max(0, needed - free - given_back)


def check_room(out: Path, sizes: list[int], given_back: int, then: Remedy,
               what: str = "rank files, journal, manifest, config and tokenizer copies",
               instead: str = "choose an OUT on another filesystem") -> None:
    """Refuse, before writing, when the files still to write (`sizes`, of `what`) do not fit, in bytes or
    in files the filesystem can still create; `given_back`: bytes this run frees first (files --force
    deletes that have no other link, a resumed run's partial files)."""
    need, free = on_disk(sizes, out), free_bytes(out)
    short = shortfall(need, free, given_back)
    if short:
        back = f" (+{size(given_back)} this run removes)" if given_back else ""
        raise NoRoom(f"{out}: not enough room on {filesystem(out)}: {size(sum(sizes))} still to write "
                          f"({sum(sizes):,} bytes: {what}), "
                          f"{size(free)} free{back}", remedy=then.after(f"free {size(short)} more", instead))
    inodes = free_inodes(out)
    if inodes is not None and inodes < len(sizes) + INODE_SLACK:
        raise NoRoom(f"{out}: {filesystem(out)} can create only {inodes:,} more files (no free inodes) and "
                          f"this run writes up to {len(sizes) + INODE_SLACK:,}",
                     remedy=then.after("remove files there", instead))


def write_failed(err: OSError, out: Path, sizes: list[int], largest: int) -> LuciferError:
    """The one-line error for a write that hit a full disk or a quota (`no_room`, the kind of the check
    before writing) or the file-size limit (`environment`: a limit of this process)."""
    where = err.filename or out
    if err.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        cap = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,} bytes"
        return EnvironmentRefused(f"{where}: write failed ({err.strerror}): this process may write files of at most {cap} "
                           f"(ulimit -f) and the largest rank file is {largest:,} bytes",
                           remedy=CONVERT_RESUME.after("raise the limit", "lower --max-file-size and run with --force"))
    need, free, inodes = on_disk(sizes, out), free_bytes(out), free_inodes(out)
    if need > free:
        short = f"free {size(need - free)} more"
    elif inodes is not None and inodes < len(sizes) + INODE_SLACK:
        short = f"it can create only {inodes:,} more files (no free inodes): remove files there"
    else:  # the bytes fit by our count, yet the filesystem said no: do not claim there is room
        short = ("that fits by this count, yet the filesystem refused (reserved blocks, a quota or another "
                 "writer): free more room there")
    return NoRoom(f"{where}: write failed ({err.strerror}): {size(sum(sizes))} of this conversion still to "
                       f"write ({sum(sizes):,} bytes) and {filesystem(out)} has {size(free)} free",
                  remedy=CONVERT_RESUME.after(short))
