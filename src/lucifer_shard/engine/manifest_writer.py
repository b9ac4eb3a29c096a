"""The manifest convert writes last but one (before COMPLETE): the job's plan, options and layouts,
every rank file's and tensor's digest, content stamp and source pieces, the source's content
digests, and the digests of the copied config and tokenizer files (vLLM reads them from OUT)."""
from __future__ import annotations

from pathlib import Path

from blake3 import blake3

from .. import __version__
from ..guarded_io import Tree, JSON_LIMIT, read_regular
from ..model.drafts import draft_record
from ..outnames import MANIFEST_NAME
from ..output.manifest import CARD_NAME, FORMAT, FORMAT_VERSION, manifest_text, part_content, part_path
from ..output.manifest_types import (Content, Copy, Draft, FileRecord, Manifest, PlanRecord, RankRecord, Source,
                                     TensorRecord, roles_identity)
from ..output.output_check import recorded_fields
from ..source.checkpoint import side_files
from ..source.content import ALGORITHM, BLOCK, checkpoint_digest, shard_digests
from .job import Job, layout_name, stored_shape
from .journal import JournalEntry


def source_content(job: Job, files: dict[str, JournalEntry], roles: dict[str, tuple[RankRecord, ...]]) -> Content:
    """The manifest's `source.content`: digests of every converted source tensor, per shard and in all, and
    the content identity of the rank files (`roles`) they stamp."""
    digests: dict[str, str] = {}
    for entry in files.values():
        digests.update(entry.sources or {})
    shards = shard_digests(digests, {k: job.ckpt.tensors[k].file for k in digests})
    return Content(ALGORITHM, BLOCK, len(digests), shards, checkpoint_digest(shards), roles_identity(roles))


def copies(root: Path, follow: bool, card: bool = False) -> dict[str, Copy]:
    """The side files in `root` (OUT's copies; the source's, for sizes) by name; with `card`, OUT's model
    card too (a source's README.md is not copied)."""
    out = {}
    for name in side_files(root) + ([CARD_NAME] if card and (Path(root) / CARD_NAME).is_file() else []):
        data = read_regular(Path(root) / name, JSON_LIMIT, follow=follow)
        out[name] = Copy(len(data), "blake3:" + blake3(data).hexdigest())
    return out


def planned_copies(job: Job) -> dict[str, Copy]:
    """The copies as they will be, from the source's sizes (a source on the Hub has none on disk yet):
    a digest has a fixed length, so the manifest's size is exact before anything is copied."""
    return {name: Copy(n, "blake3:" + "0" * 64) for name, n in job.ckpt.side.items()}


def _ranks(job: Job, role: str, files: dict[str, JournalEntry]) -> tuple[RankRecord, ...]:
    """`role`'s rank entries: each rank's files and its tensors' records."""
    parts = [p for p in job.parts if p.role == role]
    ranks = []
    for rank, specs in enumerate(job.specs[role]):
        rank_files, where = [], {}
        for part in parts:
            rel = part_path(role, rank, part.index)
            entry = files[rel]
            content = part_content(files[part_path(role, 0, part.index)].sources)  # rank 0 carries them
            rank_files.append(FileRecord(rel, entry.bytes, "blake3:" + entry.digest, content))
            where.update({name: (rel, "blake3:" + entry.tensors[name]) for name in part.names})
        tensors = {s.name: TensorRecord.planned(s, stored_shape(s, job.layouts), layout_name(s, job.layouts),
                                                *where[s.name]) for s in specs}
        ranks.append(RankRecord(rank, tuple(rank_files), tensors))
    return tuple(ranks)


def build_manifest(job: Job, files: dict[str, JournalEntry], out: Path | None = None) -> Manifest:
    """The manifest of `job` with these rank files; the copies digested in `out` (without it, the
    source's files: the same sizes, for the room check before anything is copied)."""
    o = job.options
    roles = {role: _ranks(job, role, files) for role in job.roles}
    return Manifest(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        tool_version=__version__,
        conversion_id=job.cid,
        source=Source(job.ckpt.fingerprint, job.source_path, dict(sorted(job.ckpt.files.items())),
                      tuple(job.ckpt.side), source_content(job, files, roles), **job.origin),
        copies=copies(out, follow=False, card=True) if out is not None else planned_copies(job),
        tp_size=job.plan.tp,
        plan=PlanRecord(job.plan.tp, job.plan.axes),
        options=o,
        **recorded_fields(o),  # what every reader derives from the options and compares (output/output_check)
        dropped=dict(sorted(job.dropped.items())),
        roles=roles,
        draft=Draft(**draft_record(job.ckpt.config)) if "draft" in job.roles else None,
    )


def write_manifest(out: Path, m: Manifest) -> None:
    Tree(out).write_bytes(MANIFEST_NAME, manifest_text(m.to_dict()).encode())
