"""The load plan's check of one rank's files: each present, of the manifest's size and identity stamp, its
safetensors header (read through the converter's `formats/stheader`) holding exactly the manifest's tensors in
the manifest's dtypes and shapes. Imports neither vLLM nor torch."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lucifer_shard.formats.stheader import META_CONTENT, META_CONVERSION_ID, META_PART, Header
from lucifer_shard.output.manifest import file_metadata
from lucifer_shard.output.manifest_types import FileRecord, RankRecord

from lucifer_shard.errors import CONVERT_AGAIN, CONVERT_FORCE

from ..errors import ShimError
from ..manifest import Output, manifest_path, open_rank_file, read_header

# identity stamp key -> what a file whose stamp differs is (any other key: misplaced)
STAMP_MEANS = {META_CONVERSION_ID: "from another conversion",
               META_CONTENT: "made from other source weights (another checkpoint or revision)"}


@dataclass(frozen=True)
class CheckedRankFile:
    path: Path
    declared: FileRecord  # the manifest's entry
    header: Header  # validated: tensors in data order, offsets count from header.data_start
    identity: tuple[int, int]  # (st_dev, st_ino) of the file the header was read from: the data must be its


def few(names, n: int = 5) -> str:
    names = sorted(names)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def shape_text(shape) -> str:
    return "(" + ",".join(str(int(x)) for x in shape) + ")"


def check_files(output: Output, role: str, rank: int, entry: RankRecord, identity: bool) -> list[CheckedRankFile]:
    """Every file of the rank: present, its header's tensors exactly the manifest's (names, dtypes,
    shapes); with `identity`, also its size and identity stamp."""
    out = output.path
    if not entry.files:
        raise ShimError(f"rank files missing: {manifest_path(out)} lists no files for {role} rank {rank}",
                        CONVERT_AGAIN)
    by_file: dict[str, list[str]] = {}
    for name, t in entry.tensors.items():
        by_file.setdefault(t.file, []).append(name)
    return [_check_file(output, role, rank, entry, f, by_file.get(f.path, []), identity) for f in entry.files]


def _check_file(output: Output, role: str, rank: int, entry: RankRecord, f: FileRecord, names: list[str],
                identity: bool) -> CheckedRankFile:
    out, doc = output.path, output.manifest
    path = out / f.path
    fd = open_rank_file(out, f.path, role, rank)
    try:
        st = os.fstat(fd)
        if identity and st.st_size != f.bytes:
            raise ShimError(f"{path} is {st.st_size} bytes, the manifest says {f.bytes}; the copy is "
                            f"truncated or from another conversion, re-copy it")
        header = read_header(path, fd=fd)
    finally:
        os.close(fd)
    meta = header.metadata
    want_meta = file_metadata(doc.conversion_id, role, rank, 0, doc.tp_size, f.content) if identity else {}
    for k, v in want_meta.items():
        if k != META_PART and meta.get(k) != v:  # the part index is the file's name
            raise ShimError(f"{path} metadata {k}={meta.get(k)!r}, manifest expects {v!r}: the file is "
                            f"{STAMP_MEANS.get(k, 'misplaced')}; do not mix outputs",
                            CONVERT_AGAIN.after("choose a fresh directory for OUT"))
    if set(header.tensors) != set(names):
        extra, miss = set(header.tensors) - set(names), set(names) - set(header.tensors)
        raise ShimError(f"{path} holds tensors the manifest does not list ({few(extra) or 'none'}) or lacks "
                        f"listed ones ({few(miss) or 'none'})", CONVERT_FORCE)
    for name in names:
        t, h = entry.tensors[name], header.tensors[name]
        if h.dtype != t.dtype or tuple(h.shape) != t.shape:
            raise ShimError(f"{path}: tensor {name} is {h.dtype}{shape_text(h.shape)} but the manifest says "
                            f"{t.dtype}{shape_text(t.shape)}", CONVERT_FORCE)
    return CheckedRankFile(path, f, header, (st.st_dev, st.st_ino))
