"""The manifest as typed, frozen records: what every reader of an output (the proof, the commands, the
runtime shim) and its writer share. `Manifest.parse` is the one loader: the document is checked by
spec/manifest.py (`parse_manifest`: format, every field's type and range, the file layout), then built
into these records once; `Manifest.to_dict` is its inverse, the document the writer seals.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from ..errors import OutputError
from .manifest import MANIFEST_NAME, Options, digest_ok, parse_manifest, read_manifest_bytes
from .plan import Axis
from .rules import DTYPE_SIZE
from .tensorspecs import TensorSpec


@dataclass(frozen=True)
class SourcePiece:
    """A slice of a source tensor a rank tensor holds (`spec.rules.Piece`, as recorded)."""

    key: str
    dim: int
    src_start: int
    dst_start: int
    length: int
    seg_len: int

    def to_dict(self) -> dict:
        return {"key": self.key, "dim": self.dim, "src_start": self.src_start, "dst_start": self.dst_start,
                "length": self.length, "seg_len": self.seg_len}


Region = tuple[int, int, int]  # [dim, start, end) of a pad region in model layout (of one expert when stacked)


def zero_regions(spec: TensorSpec) -> tuple[Region, ...]:
    """The pad regions of a planned tensor: each piece's tail past its source slice."""
    return tuple((p.dim, *p.tail) for p in spec.pieces if p.tail[1] > p.tail[0])


@dataclass(frozen=True)
class TensorRecord:
    """A rank tensor: where it lies, its digest, and what the rule table planned for it."""

    file: str
    digest: str
    dtype: str
    shape: tuple[int, ...]
    model_shape: tuple[int, ...]
    layout: str
    experts: int | None
    sources: tuple[SourcePiece, ...]
    source_dtype: str
    zero_regions: tuple[Region, ...]
    pad: str  # "zero" or "-inf"
    view_as: str | None = None  # the one reinterpretation a loader may apply

    # the fields the rule table decides (`planned`), which verify and diff check against it
    PLANNED = ("dtype", "shape", "model_shape", "layout", "experts", "source_dtype", "sources", "zero_regions", "pad")

    @classmethod
    def planned(cls, spec: TensorSpec, shape: tuple[int, ...], layout: str, file: str = "",
                digest: str = "") -> TensorRecord:
        """The record of `spec` stored in `shape` and `layout` (in `file`, of `digest`, once written)."""
        return cls(file, digest, spec.dtype, tuple(shape), tuple(spec.shape), layout, spec.experts,
                   tuple(SourcePiece(p.source, p.dim, p.src_start, p.dst_start, p.length, p.seg_len)
                         for p in spec.pieces),
                   spec.src_dtype, zero_regions(spec), "-inf" if spec.pad != b"\x00" else "zero")

    @classmethod
    def from_dict(cls, d: dict) -> TensorRecord:
        return cls(d["file"], d["digest"], d["dtype"], tuple(d["shape"]), tuple(d["model_shape"]), d["layout"],
                   d["experts"], tuple(SourcePiece(**{k: p[k] for k in SourcePiece.__dataclass_fields__})
                                       for p in d["sources"]),
                   d["source_dtype"], tuple(tuple(r) for r in d["zero_regions"]), d["pad"], d.get("view_as"))

    def to_dict(self) -> dict:
        d = {"file": self.file, "digest": self.digest, "dtype": self.dtype, "shape": list(self.shape),
             "model_shape": list(self.model_shape), "layout": self.layout, "experts": self.experts,
             "sources": [p.to_dict() for p in self.sources], "source_dtype": self.source_dtype,
             "zero_regions": [list(r) for r in self.zero_regions], "pad": self.pad}
        if self.view_as is not None:
            d["view_as"] = self.view_as
        return d

    @property
    def stacked(self) -> bool:
        return bool(self.experts)

    @property
    def kernel(self) -> bool:
        """Stored in a kernel layout (not model layout)."""
        return self.layout != "model"

    @property
    def model_bytes(self) -> int:
        return DTYPE_SIZE[self.dtype] * prod(self.model_shape)

    @property
    def padding_bytes(self) -> int:
        """Bytes of its zero regions, over every expert when stacked."""
        matrix = self.model_shape[1:] if self.experts else self.model_shape
        per = DTYPE_SIZE[self.dtype] * (self.experts or 1)
        return sum(per * (hi - lo) * prod(n for d, n in enumerate(matrix) if d != dim)
                   for dim, lo, hi in self.zero_regions)


@dataclass(frozen=True)
class FileRecord:
    """A rank file: its path in OUT, size, BLAKE3 digest (`spec.manifest.file_digest`) and content stamp."""

    path: str
    bytes: int
    digest: str
    content: str

    def to_dict(self) -> dict:
        return {"path": self.path, "bytes": self.bytes, "digest": self.digest, "content": self.content}


@dataclass(frozen=True)
class RankRecord:
    rank: int
    files: tuple[FileRecord, ...]
    tensors: dict[str, TensorRecord]

    @classmethod
    def from_dict(cls, d: dict) -> RankRecord:
        return cls(d["rank"], tuple(FileRecord(**{k: f[k] for k in FileRecord.__dataclass_fields__})
                                    for f in d["files"]),
                   {n: TensorRecord.from_dict(t) for n, t in d["tensors"].items()})

    def to_dict(self) -> dict:
        return {"rank": self.rank, "files": [f.to_dict() for f in self.files],
                "tensors": {n: t.to_dict() for n, t in self.tensors.items()}}

    def held(self, path: str) -> list[str]:
        """The names of the tensors in its file `path`, sorted."""
        return sorted(n for n, t in self.tensors.items() if t.file == path)


@dataclass(frozen=True)
class Copy:
    """A config or tokenizer file convert copied into OUT."""

    bytes: int
    digest: str


@dataclass(frozen=True)
class Content:
    """The source's content digests (spec/content.py): per shard, and of the whole checkpoint."""

    algorithm: str
    block_bytes: int
    tensors: int
    files: dict[str, str]
    digest: str


@dataclass(frozen=True)
class Source:
    fingerprint: str
    path: str
    files: dict[str, int]
    side_files: tuple[str, ...]
    content: Content
    repo: str | None = None  # the Hugging Face repo id and commit it came from; None for a local directory
    revision: str | None = None

    def to_dict(self) -> dict:
        c = self.content
        return {"fingerprint": self.fingerprint, "path": self.path, "repo": self.repo, "revision": self.revision,
                "files": dict(self.files), "side_files": list(self.side_files),
                "content": {"algorithm": c.algorithm, "block_bytes": c.block_bytes, "tensors": c.tensors,
                            "files": dict(c.files), "digest": c.digest}}


@dataclass(frozen=True)
class PlanRecord:
    """The virtual-TP plan as recorded (`spec.plan.Plan.to_dict`); its axes by name."""

    tp: int
    axes: dict[str, Axis]

    def to_dict(self) -> dict:
        return {"tp": self.tp, "axes": {n: {"name": a.name, "original": a.original, "padded": a.padded,
                                            "local": a.local, "kernel_local": a.kernel_local}
                                        for n, a in self.axes.items()}}


@dataclass(frozen=True)
class LayoutRecord:
    name: str
    steps: tuple[str, ...]
    version: int


@dataclass(frozen=True)
class Draft:
    """What OUT/draft holds (spec/drafts.DRAFT_KINDS)."""

    kind: str
    stages: int
    tokens: int


@dataclass(frozen=True)
class Manifest:
    format: str
    format_version: int
    tool_version: str
    conversion_id: str
    source: Source
    copies: dict[str, Copy]
    tp_size: int
    plan: PlanRecord
    options: Options
    arch: str | None
    moe_variant: str | None
    expert_layout: str
    flashinfer_layout: str | None
    layouts: dict[str, LayoutRecord]
    layout_version: int
    runtime: dict[str, str]  # spec/manifest.runtime_record
    dropped: dict[str, str]  # source tensor -> why it is not converted
    roles: dict[str, tuple[RankRecord, ...]]
    draft: Draft | None = None  # None without a draft role, and for MTP written before the record existed
    runtime_owned: tuple[str, ...] | None = None
    manifest_digest: str | None = None  # None until sealed (`spec.manifest.seal`)
    sealed: bool = field(default=False, compare=False)  # as read: its self-digest matches its content

    @classmethod
    def from_dict(cls, d: dict, sealed: bool = False) -> Manifest:
        """The records of a document `parse_manifest` checked."""
        s, c = d["source"], d["source"]["content"]
        return cls(
            d["format"], d["format_version"], d["tool_version"], d["conversion_id"],
            Source(s["fingerprint"], s["path"], dict(s["files"]), tuple(s["side_files"]),
                   Content(c["algorithm"], c["block_bytes"], c["tensors"], dict(c["files"]), c["digest"]),
                   s.get("repo"), s.get("revision")),
            {n: Copy(r["bytes"], r["digest"]) for n, r in d["copies"].items()}, d["tp_size"],
            PlanRecord(d["plan"]["tp"], {n: Axis(a["name"], a["original"], a["padded"], a["local"], a["kernel_local"])
                                         for n, a in d["plan"]["axes"].items()}),
            Options(**d["options"]), d["arch"], d["moe_variant"], d["expert_layout"], d["flashinfer_layout"],
            {t: LayoutRecord(v["name"], tuple(v["steps"]), v["version"]) for t, v in d["layouts"].items()},
            d["layout_version"], dict(d["runtime"]), dict(d["dropped"]),
            {role: tuple(RankRecord.from_dict(e) for e in r["ranks"]) for role, r in d["roles"].items()},
            Draft(**{k: d["draft"][k] for k in Draft.__dataclass_fields__}) if "draft" in d else None,
            tuple(d["runtime_owned"]) if "runtime_owned" in d else None, d.get("manifest_digest"), sealed)

    def to_dict(self) -> dict:
        """The document (what `spec.manifest.manifest_text` seals and writes)."""
        d = {"format": self.format, "format_version": self.format_version, "tool_version": self.tool_version,
             "conversion_id": self.conversion_id, "source": self.source.to_dict(),
             "copies": {n: {"bytes": r.bytes, "digest": r.digest} for n, r in self.copies.items()},
             "tp_size": self.tp_size, "plan": self.plan.to_dict(), "options": self.options.to_dict(),
             "arch": self.arch, "moe_variant": self.moe_variant, "expert_layout": self.expert_layout,
             "flashinfer_layout": self.flashinfer_layout,
             "layouts": {t: {"name": v.name, "steps": list(v.steps), "version": v.version}
                         for t, v in self.layouts.items()},
             "layout_version": self.layout_version, "runtime": dict(self.runtime), "dropped": dict(self.dropped),
             "roles": {role: {"ranks": [e.to_dict() for e in ranks]} for role, ranks in self.roles.items()}}
        if self.draft is not None:
            d["draft"] = {"kind": self.draft.kind, "stages": self.draft.stages, "tokens": self.draft.tokens}
        if self.runtime_owned is not None:
            d["runtime_owned"] = list(self.runtime_owned)
        if self.manifest_digest is not None:
            d["manifest_digest"] = self.manifest_digest
        return d

    @classmethod
    def parse(cls, data: bytes, path: Path | str) -> Manifest:
        """The manifest of these bytes (`parse_manifest`: OutputError when they are not one); its
        self-digest is `sealed`'s, checked by the caller."""
        doc = parse_manifest(data, path)
        return cls.from_dict(doc, digest_ok(doc))

    @classmethod
    def load(cls, out: Path, check_digest: bool = True) -> Manifest:
        """OUT's manifest; with `check_digest`, OutputError when its self-digest does not match."""
        path = Path(out) / MANIFEST_NAME
        m = cls.parse(read_manifest_bytes(out), path)
        if check_digest and not m.sealed:
            raise OutputError(f"{path}: manifest_digest does not match its content: the manifest was edited "
                              f"after conversion; re-run convert --force")
        return m

    def rank(self, role: str, rank: int) -> RankRecord:
        """`role`'s entry of TP rank `rank` (by its `rank` field); OutputError naming it when the manifest
        lists none (spec/output_check refuses such a manifest before any reader asks)."""
        entry = next((e for e in self.roles.get(role, ()) if e.rank == rank), None)
        if entry is None:
            raise OutputError(f"{MANIFEST_NAME}: lists no {role} entry for TP rank {rank} of {self.tp_size}: the "
                              f"manifest was edited; lucifer-shard verify OUT names every problem")
        return entry

    def files(self, ranks: list[int] | None = None) -> list[tuple[str, int, FileRecord]]:
        """(role, rank, file) for every rank file listed (of `ranks` only, when given)."""
        return [(role, e.rank, f) for role, entries in self.roles.items() for e in entries
                if ranks is None or e.rank in ranks for f in e.files]
