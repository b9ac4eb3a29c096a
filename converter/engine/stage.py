"""`lucifer-shard stage OUT DEST`: write one node's share of a finished output (spec/share.py).

Each file goes in by a hard link when DEST is on OUT's filesystem (no byte copied), otherwise by a
copy that is hashed while it is written and read back before it is published. Nothing outside DEST is
written (guarded_io.Tree). Order: the manifest and the copies, the rank files, `lucifer-share.json`,
`COMPLETE` last, so a stage stopped part-way is an unfinished share that the same command finishes:
a file already in DEST is kept when it is the same inode as OUT's (a link) or has its size and
bytes (a copy), and a file left half-written under its temporary name is removed by the next run.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from blake3 import blake3

from ..errors import OutputError, UsageRefused
from ..guarded_io import Tree, write_all
from ..spec.manifest import COMPLETE_NAME, MANIFEST_NAME, STATE_DIR, complete_problem, load_manifest
from ..spec.share import SHARE_NAME, describe, read_share, share_doc, share_text
from ..units import duration, size

logger = logging.getLogger("lucifer_shard.stage")
CHUNK = 16 << 20


@dataclass
class StageSummary:
    out: str
    dest: str
    share: dict
    linked: int = 0
    copied: int = 0
    kept: int = 0
    bytes: int = 0  # the share's bytes (rank files, manifest, copies)
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "files"}

    def lines(self) -> list[str]:
        return [f"share      {self.dest}: {describe(self.share)} of {self.out}",
                f"files      {self.linked} hard-linked, {self.copied} copied and read back, {self.kept} already there",
                f"size       {size(self.bytes)}",
                f"time       {duration(self.seconds)}"]


def share_files(manifest: dict, ranks: list[int]) -> list[tuple[str, int]]:
    """(path, bytes) of every file a share of `ranks` holds but COMPLETE and the share record: the
    manifest first (a DEST stopped part-way is then known as this output's share), the copies, then
    each role's rank files of those ranks."""
    files = [(MANIFEST_NAME, -1)]  # its size is the file's
    files += [(name, rec["bytes"]) for name, rec in sorted(manifest["copies"].items())]
    for role, doc in manifest["roles"].items():
        for rank in ranks:
            files += [(f["path"], f["bytes"]) for f in doc["ranks"][rank]["files"]]
    return files


def share_bytes(manifest: dict, ranks: list[int]) -> int:
    """The rank files' bytes of a share of `ranks` (what a node needs beyond a few small files)."""
    return sum(n for _, n in share_files(manifest, ranks) if n > 0)


def stage(out: Path, dest: Path, ranks: list[int], nnodes: int | None = None, node_rank: int | None = None) -> StageSummary:
    t0 = time.perf_counter()
    out, dest = Path(out), Path(dest)
    if not out.is_dir():
        raise OutputError(f"{out}: no such output directory")
    if read_share(out) is not None:
        raise UsageRefused(f"{out} is itself a node's share; stage from the whole output convert wrote")
    manifest = load_manifest(out)
    problem = complete_problem(out, manifest["conversion_id"])
    if problem:
        raise OutputError(f"{out}: {problem}")
    _refuse_dest(out, dest, manifest, ranks)
    doc = share_doc(manifest["conversion_id"], manifest["tp_size"], ranks, nnodes, node_rank)
    dest.mkdir(parents=True, exist_ok=True)  # DEST itself, as convert makes OUT; below it only through Tree
    src, tree = Tree(out), Tree(dest)
    summary = StageSummary(str(out), str(dest), doc)
    tree.remove(COMPLETE_NAME)  # a stage that changes DEST is unfinished until it ends
    for rel, _ in share_files(manifest, ranks):
        how = _place(src, tree, rel)
        setattr(summary, how, getattr(summary, how) + 1)
        summary.bytes += tree.lstat(rel).st_size
        summary.files.append(rel)
        logger.info("%s: %s", rel, how)
    tree.write_bytes(SHARE_NAME, share_text(doc).encode())
    tree.write_bytes(COMPLETE_NAME, src.read(COMPLETE_NAME))
    summary.seconds = time.perf_counter() - t0
    return summary


def _refuse_dest(out: Path, dest: Path, manifest: dict, ranks: list[int]) -> None:
    """DEST must be new, empty, or an unfinished or finished share of the same conversion and ranks."""
    if dest.resolve() == out.resolve() or out.resolve() in dest.resolve().parents:
        raise UsageRefused(f"{dest}: inside the output {out}; stage into a directory of its own")
    if dest.exists() and not dest.is_dir():
        raise OutputError(f"{dest}: a file, not a directory; choose another DEST")
    tree = Tree(dest)
    entries = tree.entries()
    if not entries:
        return
    if STATE_DIR in entries:
        raise OutputError(f"{dest}: holds a conversion (its {STATE_DIR}/), not a share; choose another DEST")
    there = None
    if MANIFEST_NAME in entries:
        try:
            there = load_manifest(dest, check_digest=False)["conversion_id"]
        except OutputError:
            there = None
    if there != manifest["conversion_id"]:
        raise OutputError(f"{dest}: not empty and not a share of this output; stage into a new or empty directory")
    share = read_share(dest)
    if share is not None and share["ranks"] != sorted(ranks):
        raise OutputError(f"{dest}: already a share of {describe(share)}; stage other ranks into another DEST")


def _place(src: Tree, tree: Tree, rel: str) -> str:
    """Put OUT's `rel` into DEST: 'kept' (already there and the same), 'linked' or 'copied'."""
    st, there = src.lstat(rel), tree.lstat(rel)
    if there is not None:
        if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino) or (
                there.st_size == st.st_size and _digest(tree, rel) == _digest(src, rel)):
            return "kept"
        tree.remove(rel)  # another file under the share's name: this stage wrote it, or it is stale
    try:
        tree.link_in(src, rel)
        return "linked"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    want = _copy(src, tree, rel)
    got = _digest(tree, rel)
    if got != want:
        tree.remove(rel)
        raise OutputError(f"{tree.path(rel)}: the copy reads back other bytes than {src.path(rel)} (blake3 "
                          f"{got[:16]}... != {want[:16]}...); check DEST's disk and stage again")
    return "copied"


def _copy(src: Tree, tree: Tree, rel: str) -> str:
    """Publish a copy of OUT's `rel` in DEST; the BLAKE3 of the bytes read from OUT."""
    h = blake3()
    fd_in = src.open_read(rel)

    def write(fd: int) -> None:
        while True:
            chunk = os.read(fd_in, CHUNK)
            if not chunk:
                return
            h.update(chunk)
            write_all(fd, chunk)

    try:
        tree.publish(rel, write)
    finally:
        os.close(fd_in)
    return h.hexdigest()


def _digest(tree: Tree, rel: str) -> str:
    h = blake3()
    fd = tree.open_read(rel)
    try:
        while True:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)
    finally:
        os.close(fd)
