"""A node's convert (`convert --ranks K[,K...]`, `--nnodes N --node-rank R`): OUT becomes the share
`stage` would make of the whole conversion for those ranks, with no conversion box and no copy.

Only the node's rank files are written. The manifest lists every rank's files with their digests,
so the other ranks' files are still assembled from the one read of each source tensor and hashed by
`stwriter.StreamHasher` (the writer's own hashing, without a file), journaled like written files and
never written. The manifest, the copies, `lucifer-share.json` (`output.share.share_doc`, the fields
stage writes) and COMPLETE are then byte for byte what stage of the whole output gives.

`--resume` keeps the other ranks' digests from the journal: a kept part's source tensors are read
and hashed again anyway (`resumed`), and with the same source digests and conversion id (options,
tool version) the conversion is deterministic, so re-assembling and re-hashing those ranks would
only repeat what the journal holds. `.lucifer/` (record, journal, lock) stays in OUT as in every
conversion; the record names the share, and only the same ranks may resume or replace it
(`outstate`).
"""
from __future__ import annotations

from ..guarded_io import Tree
from ..output.share import SHARE_NAME, share_text
from .job import Job

__all__ = ["SHARE_NAME", "share_problem", "write_share"]


def _text(job: Job) -> bytes:
    return share_text(job.node.doc(job.cid, job.plan.tp)).encode()


def share_problem(tree: Tree, job: Job) -> str | None:
    """Why OUT's share record is not the one `job` writes (missing or other bytes); None for a whole
    output (it has none) or a record that is right."""
    if job.node is None:
        return None
    try:
        return None if tree.read(SHARE_NAME) == _text(job) else f"{SHARE_NAME} is not this node's share record"
    except FileNotFoundError:
        return f"{SHARE_NAME} is missing"


def write_share(tree: Tree, job: Job) -> None:
    """Write a node's share record (the last file before COMPLETE, as stage writes it); nothing for a
    whole output."""
    if job.node is not None:
        tree.write_bytes(SHARE_NAME, _text(job))
