"""The disk footprint of a conversion: bytes to read and write, files per rank, room on OUT's
filesystem, and a time estimate from a measured throughput.

Pure arithmetic shared by `plan` (from config.json alone) and `convert` (its up-front refusal when
OUT's filesystem lacks the room); only `free_space` and `tree_bytes` look at the filesystem.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .rules import TensorSpec

# What `make bench` measured for `convert --tp 3` (1 worker) on the 2-vCPU VM with a virtio disk
# described in docs/performance.md: bench/results.json, summary "L1 convert w1", 19,563,768,880
# bytes read and written in a median wall time of 12.084 s. Convert runs at disk speed, so this
# scales with the disk; tests/test_plan.py checks the figure against the file.
MEASURED_BYTES_PER_S = 19_563_768_880 / 12.083711780000158
MEASURED_WHERE = "convert's speed measured by `make bench` on a 2-vCPU VM's virtio disk (bench/results.json)"
# Manifest and journal: about 2 KiB per rank tensor entry (measured: 1.2-1.6 KiB), plus slack.
METADATA_BYTES_PER_TENSOR = 2048
METADATA_SLACK = 1 << 20


@dataclass(frozen=True)
class Footprint:
    read: int  # source tensor bytes read (each converted tensor once)
    files: dict[str, int]  # rank file path relative to OUT -> exact bytes (header + data)
    tensors: int  # rank tensor entries in the manifest (all roles and ranks)
    side: int = 0  # config/tokenizer copies (unknown, 0, when planning from config.json alone)

    @property
    def write(self) -> int:
        return sum(self.files.values()) + self.side

    @property
    def metadata(self) -> int:
        """Room kept for the manifest and the journal."""
        return self.tensors * METADATA_BYTES_PER_TENSOR + METADATA_SLACK

    def needed(self, kept: Iterable[str] = ()) -> int:
        """Bytes still to write when the files in `kept` are already in OUT."""
        keep = set(kept)
        return sum(n for p, n in self.files.items() if p not in keep) + self.side + self.metadata

    def per_rank(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(role, rank) -> (files, bytes), roles and ranks in order."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for path, n in sorted(self.files.items()):
            role, rank_dir = path.split("/")[:2]
            key = (role, int(rank_dir.removeprefix("rank-")))
            files, total = out.get(key, (0, 0))
            out[key] = (files + 1, total + n)
        return dict(sorted(out.items(), key=lambda kv: (kv[0][0] != "target", kv[0])))


def read_bytes(specs: dict[str, list[list[TensorSpec]]], sizes: dict[str, int]) -> int:
    """Bytes of the source tensors the specs read (rank 0's specs name every source once)."""
    return sum(sizes[k] for ranks in specs.values() for s in ranks[0] for k in dict.fromkeys(s.sources()))


def shortfall(needed: int, free: int, reclaimable: int = 0) -> int:
    """Bytes missing on the filesystem (0 when the conversion fits)."""
    return max(0, needed - free - reclaimable)


def seconds(fp: Footprint, bytes_per_s: float = MEASURED_BYTES_PER_S) -> float:
    """Convert moves every byte it reads and writes once; at disk speed the time is their sum over the rate."""
    return (fp.read + fp.write) / bytes_per_s


def free_space(path: Path) -> tuple[int, Path]:
    """(bytes an unprivileged writer may still use, mount point) of the filesystem that holds or
    would hold `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    dev = p.stat().st_dev
    mount = p
    while mount.parent != mount and mount.parent.stat().st_dev == dev:
        mount = mount.parent
    return st.f_bavail * st.f_frsize, mount


def tree_bytes(root: Path, pattern: str = "*") -> int:
    """Bytes of the regular files under `root` whose name matches `pattern` (what removing them gives back)."""
    total = 0
    for p in Path(root).rglob(pattern):
        st = p.lstat()
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total
