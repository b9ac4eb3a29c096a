"""The disk footprint of a conversion: bytes to read and write, files per rank, and a time estimate
from a measured throughput.

Pure arithmetic: `plan` shows it from config.json alone, `convert` sizes its files from it. The
filesystem side (free space, the up-front refusal, a full disk mid-run) is `diskspace`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..outnames import rank_of
from .tensorspecs import TensorSpec

# What `make bench` measured for `convert --tp 3` (1 worker) on the 2-vCPU VM with a virtio disk
# described in docs/evidence/performance.md: bench/results.json, summary "L1 convert w1", 19,563,768,880
# bytes read and written in a median wall time of 30.422 s (the latest run, on a day this disk
# ran 4x slower than the 12.084 s of the first). Convert runs at disk speed, so this scales with
# the disk; tests/test_cli.py checks the figure against the file.
MEASURED_BYTES_PER_S = 19_563_768_880 / 30.422266728000977
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

    @property
    def needed(self) -> int:
        """Room a conversion into an empty OUT needs: the files, the copies and the metadata allowance."""
        return self.write + self.metadata

    def only(self, ranks: list[int]) -> Footprint:
        """What a node's convert (`--ranks`) writes: the same reads, its ranks' files (the manifest,
        sized by `tensors`, still lists every rank)."""
        kept = {p: n for p, n in self.files.items() if rank_of(p) in ranks}
        return replace(self, files=kept)

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


def seconds(fp: Footprint, bytes_per_s: float = MEASURED_BYTES_PER_S) -> float:
    """Convert moves every byte it reads and writes once; at disk speed the time is their sum over the rate."""
    return (fp.read + fp.write) / bytes_per_s


# The link rate plan assumes without --link: a gigabit uplink, a common office or home line to the Hub
# (a box on a faster one passes its own: `plan --link 10Gbit/s`).
DEFAULT_LINK = "1Gbit/s"


@dataclass(frozen=True)
class Route:
    """One way to get a node's share onto its box: bytes downloaded from the Hub and disk used there, and
    what its time is made of: `hub` bytes from the Hub (each node's, or the conversion box's once) and
    `converted` bytes read and written by the conversion on one box (0: none)."""

    name: str
    command: str
    download_per_node: int
    disk_per_node: int
    conversion_box: int  # disk of a separate conversion box (0: none)
    hub: int = 0
    converted: int = 0

    def seconds(self, link: float, disk: float = MEASURED_BYTES_PER_S) -> tuple[float, float]:
        """(the download at `link` bytes per second, the conversion at `disk` bytes per second)."""
        return self.hub / link, self.converted / disk


def node_routes(source: int, share: int, output: int, peak: int, tp: int, nnodes: int, read: int = 0) -> list[Route]:
    """Per node, for a conversion whose source is `source` bytes, whose output is `output` and one
    node's share `share`; `peak`: the most source bytes a streamed conversion holds at once; `read`: the
    source tensor bytes a conversion reads. Every node that converts reads every source tensor (a rank's
    slices come from all of them)."""
    return [
        Route("convert once, stage, copy",
              f"convert --tp {tp} REPO OUT --keep-source; stage OUT DEST --nnodes {nnodes} --node-rank R; copy DEST",
              0, share, source + output, source, read + output),
        Route("each node streams its own share",
              f"convert --tp {tp} REPO DEST --nnodes {nnodes} --node-rank R", source, share + peak, 0, source,
              read + share),
        Route("fetch a published share", f"fetch PUBLISHED DEST --nnodes {nnodes} --node-rank R", share, share, 0,
              share),
    ]
