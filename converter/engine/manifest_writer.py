"""The manifest convert writes last but one (before COMPLETE): the job's plan, options and layouts,
every rank file's and tensor's digest, content stamp and source pieces, the source's content
digests, and the digests of the copied config and tokenizer files (vLLM reads them from OUT)."""
from __future__ import annotations

from pathlib import Path

from blake3 import blake3

from .. import __version__
from ..guarded_io import Tree
from ..spec.arches import GENERATION_ARCHES, MOE_VARIANT
from ..spec.drafts import draft_record
from ..spec.content import ALGORITHM, BLOCK, checkpoint_digest, shard_digests
from ..spec.layouts import LAYOUT_VERSION
from ..guarded_io import JSON_LIMIT, read_regular
from ..spec.manifest import FORMAT, FORMAT_VERSION, MANIFEST_NAME, manifest_text, part_content, part_path, runtime_record
from ..spec.rules import TensorSpec
from ..spec.source import side_files
from .job import Job, layout_name, stored_shape


def source_content(job: Job, files: dict[str, dict]) -> dict:
    """The manifest's `source.content`: digests of every converted source tensor, per shard and in all."""
    digests: dict[str, str] = {}
    for entry in files.values():
        digests.update(entry.get("sources") or {})
    shards = shard_digests(digests, {k: job.ckpt.tensors[k].file for k in digests})
    return {"algorithm": ALGORITHM, "block_bytes": BLOCK, "tensors": len(digests), "files": shards,
            "digest": checkpoint_digest(shards)}


def _zero_regions(spec: TensorSpec) -> list[list[int]]:
    """[dim, start, end) pad regions in model layout (dims of the per-expert matrix when stacked)."""
    regions = []
    for p in spec.pieces:
        lo, hi = p.tail
        if hi > lo:
            regions.append([p.dim, lo, hi])
    return regions


def copies(root: Path, follow: bool) -> dict[str, dict]:
    """name -> {bytes, digest} of the side files in `root` (OUT's copies; the source's, for sizes)."""
    out = {}
    for name in side_files(root):
        data = read_regular(Path(root) / name, JSON_LIMIT, follow=follow)
        out[name] = {"bytes": len(data), "digest": "blake3:" + blake3(data).hexdigest()}
    return out


def build_manifest(job: Job, files: dict[str, dict], out: Path | None = None) -> dict:
    """The manifest of `job` with these rank files; the copies digested in `out` (without it, the
    source's files: the same sizes, for the room check before anything is copied)."""
    o = job.options
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "conversion_id": job.cid,
        "source": {"fingerprint": job.ckpt.fingerprint, "path": str(job.ckpt.root.absolute()), **job.origin,
                   "files": dict(sorted(job.ckpt.files.items())), "side_files": side_files(job.ckpt.root),
                   "content": source_content(job, files)},
        "copies": copies(out, follow=False) if out is not None else copies(job.ckpt.root, follow=True),
        "tp_size": job.plan.tp,
        "plan": job.plan.to_dict(),
        "options": o.to_dict(),
        "arch": o.arch,  # null: model layout converted without --arch, for any GPU family
        # null without arch, or on the b12x route: vLLM picks the variant for the GPU it runs on
        "moe_variant": None if o.moe_backend else MOE_VARIANT.get(o.arch),
        "expert_layout": o.expert_layout,
        "flashinfer_layout": (o.flashinfer_layout if o.arch in GENERATION_ARCHES and o.expert_layout == "kernel"
                              else None),
        "layouts": {t: {"name": lay.name, "steps": list(lay.steps), "version": lay.version}
                    for t, lay in job.layouts.items()},
        "layout_version": LAYOUT_VERSION,
        "runtime": runtime_record(o),
        "dropped": dict(sorted(job.dropped.items())),
        "roles": {},
    }
    if "draft" in job.roles:
        doc["draft"] = draft_record(job.ckpt.config)
    for role in job.roles:
        ranks = []
        for rank, specs in enumerate(job.specs[role]):
            parts = [p for p in job.parts if p.role == role]
            rank_files = []
            tensors = {}
            for part in parts:
                rel = part_path(role, rank, part.index)
                entry = files[rel]
                content = part_content(files[part_path(role, 0, part.index)]["sources"])  # rank 0 carries them
                rank_files.append({"path": rel, "bytes": entry["bytes"], "digest": "blake3:" + entry["digest"],
                                   "content": content})
                for name in part.names:
                    tensors[name] = {"file": rel, "digest": "blake3:" + entry["tensors"][name]}
            for spec in specs:
                t = tensors[spec.name]
                t.update({
                    "dtype": spec.dtype,
                    "shape": list(stored_shape(spec, job.layouts)),
                    "model_shape": list(spec.shape),
                    "layout": layout_name(spec, job.layouts),
                    "experts": spec.experts,
                    "sources": [{"key": p.source, "dim": p.dim, "src_start": p.src_start, "dst_start": p.dst_start,
                                 "length": p.length, "seg_len": p.seg_len} for p in spec.pieces],
                    "source_dtype": spec.src_dtype,
                    "zero_regions": _zero_regions(spec),
                    "pad": "-inf" if spec.pad != b"\x00" else "zero",
                })
            ranks.append({"rank": rank, "files": rank_files, "tensors": tensors})
        doc["roles"][role] = {"ranks": ranks}
    return doc


def write_manifest(out: Path, doc: dict) -> None:
    Tree(out).write_bytes(MANIFEST_NAME, manifest_text(doc).encode())
