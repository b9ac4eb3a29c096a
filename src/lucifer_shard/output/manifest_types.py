"""The manifest as typed, frozen records: what every reader of an output (the proof, the commands, the
runtime shim) and its writer share. Each field carries its spec (formats/records.py), so the records are
the manifest's one declaration: `MANIFEST_FIELDS` (the check), `Manifest.parse` (the one loader: format,
every field's type and range, then the file layout) and `Manifest.to_dict` (the document the writer
seals) all derive from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from blake3 import blake3

from ..errors import CONVERT_FORCE, CONVERT_RESUME, VERIFY, OutputError, SourceError
from ..formats.dtypes import DTYPE_SIZE
from ..formats.records import Only, Rec, fld, from_doc, schema_of, to_doc
from ..formats.schema import Int, ListOf, MapOf, Null, OneOf, SchemaError, Str, check, loads
from ..guarded_io import JSON_LIMIT, Refused, read_regular
from ..model.arches import ARCHES
from ..model.drafts import DRAFT_KINDS
from ..model.options import Options
from ..model.plan import MAX_TP, Axis
from ..model.rules import ROLES
from ..model.tensorspecs import TensorSpec
from ..outnames import MANIFEST_NAME, SIDE_FILES
from .manifest import (CARD_NAME, FORMAT, FORMAT_VERSION, digest_ok, part_path, read_manifest_bytes,
                       stamps_digest)

_HEX64 = Str(r"[0-9a-f]{64}")
_DIGEST = Str(r"blake3:[0-9a-f]{64}")
_N = Int()
_DTYPE = OneOf(tuple(DTYPE_SIZE))
_SHAPE = ListOf(_N, max_len=8)


@dataclass(frozen=True)
class SourcePiece:
    """A slice of a source tensor a rank tensor holds (`model.rules.Piece`, as recorded)."""

    key: str = fld(Str())
    dim: int = fld(Int(0, 7))
    src_start: int = fld(_N)
    dst_start: int = fld(_N)
    length: int = fld(_N)
    seg_len: int = fld(_N)


Region = tuple[int, int, int]  # [dim, start, end) of a pad region in model layout (of one expert when stacked)


def zero_regions(spec: TensorSpec) -> tuple[Region, ...]:
    """The pad regions of a planned tensor: each piece's tail past its source slice."""
    return tuple((p.dim, *p.tail) for p in spec.pieces if p.tail[1] > p.tail[0])


@dataclass(frozen=True)
class TensorRecord:
    """A rank tensor: where it lies, its digest, and what the rule table planned for it."""

    file: str = fld(Str())
    digest: str = fld(_DIGEST)
    dtype: str = fld(_DTYPE)
    shape: tuple[int, ...] = fld(_SHAPE)
    model_shape: tuple[int, ...] = fld(_SHAPE)
    layout: str = fld(Str())
    experts: int | None = fld(Null(_N))
    sources: tuple[SourcePiece, ...] = fld(ListOf(Rec(SourcePiece)))
    source_dtype: str = fld(_DTYPE)
    zero_regions: tuple[Region, ...] = fld(ListOf(ListOf(_N, 3, 3)))
    pad: str = fld(OneOf(("zero", "-inf")))
    view_as: str | None = fld(_DTYPE, optional=True)  # the one reinterpretation a loader may apply

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

    def to_dict(self) -> dict:
        return to_doc(self)

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
    """A rank file: its path in OUT, size, BLAKE3 digest (`output.manifest.file_digest`) and content stamp."""

    path: str = fld(Str())
    bytes: int = fld(_N)
    digest: str = fld(_DIGEST)
    content: str = fld(_DIGEST)


@dataclass(frozen=True)
class RankRecord:
    rank: int = fld(Int(0, MAX_TP - 1))
    files: tuple[FileRecord, ...] = fld(ListOf(Rec(FileRecord), 1))
    tensors: dict[str, TensorRecord] = fld(MapOf(Rec(TensorRecord)))

    def held(self, path: str) -> list[str]:
        """The names of the tensors in its file `path`, sorted."""
        return sorted(n for n, t in self.tensors.items() if t.file == path)


@dataclass(frozen=True)
class Copy:
    """A config or tokenizer file convert copied into OUT."""

    bytes: int = fld(_N)
    digest: str = fld(_DIGEST)


@dataclass(frozen=True)
class Content:
    """The source's content digests (source/content.py): per shard, and of the whole checkpoint."""

    algorithm: str = fld(Str())
    block_bytes: int = fld(_N)
    tensors: int = fld(_N)
    files: dict[str, str] = fld(MapOf(_DIGEST))
    digest: str = fld(_DIGEST)
    # the content identity as written (`content_identity`); absent in outputs written before it was recorded
    stamps: str | None = fld(_DIGEST, optional=True)


@dataclass(frozen=True)
class Source:
    fingerprint: str = fld(_HEX64)
    path: str = fld(Str())
    files: dict[str, int] = fld(MapOf(_N))
    side_files: tuple[str, ...] = fld(ListOf(OneOf(SIDE_FILES)))  # a manifest cannot send a reader elsewhere
    content: Content = fld(Rec(Content))
    # the Hugging Face repo id and commit it came from; None (written as null) for a local directory
    repo: str | None = fld(Null(Str(r"[^/\s]+/[^/\s]+")), optional=True, omit_none=False)
    revision: str | None = fld(Null(Str(r"[0-9a-f]{40}")), optional=True, omit_none=False)


@dataclass(frozen=True)
class PlanRecord:
    """The virtual-TP plan as recorded (`model.plan.Plan.to_dict`); its axes by name."""

    tp: int = fld(Int(1, MAX_TP))
    axes: dict[str, Axis] = fld(MapOf(Rec(Axis)))

    def to_dict(self) -> dict:
        return to_doc(self)


@dataclass(frozen=True)
class LayoutRecord:
    name: str = fld(Str())
    steps: tuple[str, ...] = fld(ListOf(Str()))
    version: int = fld(_N)


@dataclass(frozen=True)
class Draft:
    """What OUT/draft holds (model/drafts.DRAFT_KINDS)."""

    kind: str = fld(OneOf(tuple(DRAFT_KINDS)))
    stages: int = fld(Int(1, 16))
    tokens: int = fld(Int(1, 64))


def roles_identity(roles: dict[str, tuple[RankRecord, ...]]) -> str:
    """`output.manifest.stamps_digest` of these rank entries' file records."""
    return stamps_digest({f.path: f.content for ranks in roles.values() for r in ranks for f in r.files})


@dataclass(frozen=True)
class Manifest:
    format: str = fld(Str())
    format_version: int = fld(Int())
    tool_version: str = fld(Str())
    conversion_id: str = fld(_HEX64)
    source: Source = fld(Rec(Source))
    # the files convert copies, and the model card it writes beside them
    copies: dict[str, Copy] = fld(MapOf(Rec(Copy), key=OneOf((*SIDE_FILES, CARD_NAME))))
    tp_size: int = fld(Int(1, MAX_TP))
    plan: PlanRecord = fld(Rec(PlanRecord))
    options: Options = fld(Rec(Options, closed=True))
    arch: str | None = fld(Null(OneOf(ARCHES)))
    moe_variant: str | None = fld(Null(Str()))
    expert_layout: str = fld(OneOf(("kernel", "model")))
    flashinfer_layout: str | None = fld(Null(OneOf(("folded", "legacy"))))
    layouts: dict[str, LayoutRecord] = fld(MapOf(Rec(LayoutRecord)))
    layout_version: int = fld(_N)
    runtime: dict[str, str] = fld(MapOf(Str()))  # output/manifest.runtime_record
    dropped: dict[str, str] = fld(MapOf(Str()))  # source tensor -> why it is not converted
    roles: dict[str, tuple[RankRecord, ...]] = fld(MapOf(Only("ranks", ListOf(Rec(RankRecord), 1, MAX_TP)),
                                                         key=OneOf(ROLES)))
    # None without a draft role, and for MTP written before the record existed
    draft: Draft | None = fld(Rec(Draft), optional=True)
    runtime_owned: tuple[str, ...] | None = fld(ListOf(Str()), optional=True)
    manifest_digest: str | None = fld(Str(), omit_none=True, default=None)  # None until sealed (`seal`)
    sealed: bool = field(default=False, compare=False)  # as read: its self-digest matches its content

    def to_dict(self) -> dict:
        """The document (what `output.manifest.manifest_text` seals and writes)."""
        return to_doc(self)

    @classmethod
    def parse(cls, data: bytes, path: Path | str) -> Manifest:
        """The manifest of these bytes: format, then every field's type and range (`MANIFEST_FIELDS`), then
        the file layout; OutputError (one line) otherwise. Its self-digest is `sealed`'s, checked by the caller."""
        try:
            doc = loads(data)
        except SchemaError as e:
            raise OutputError(f"{path}: unreadable ({e})", remedy=CONVERT_FORCE) from None
        if not isinstance(doc, dict):
            raise OutputError(f"{path}: is a JSON {type(doc).__name__}, not a lucifer-shard manifest",
                              remedy=CONVERT_FORCE)
        if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            raise OutputError(f"{path}: format {str(doc.get('format'))[:60]!r} v{str(doc.get('format_version'))[:20]}"
                              f", expected {FORMAT!r} v{FORMAT_VERSION}", remedy=CONVERT_FORCE)
        try:
            check(MANIFEST_FIELDS, doc)
        except SchemaError as e:
            raise OutputError(f"{path}: field {e}; the manifest was edited or damaged", remedy=CONVERT_FORCE) from None
        m = from_doc(cls, doc, sealed=digest_ok(doc))
        problem = _layout_problem(m)
        if problem:
            raise OutputError(f"{path}: {problem}; the manifest was edited", remedy=CONVERT_FORCE)
        return m

    @classmethod
    def load(cls, out: Path, check_digest: bool = True) -> Manifest:
        """OUT's manifest; with `check_digest`, OutputError when its self-digest does not match."""
        path = Path(out) / MANIFEST_NAME
        m = cls.parse(read_manifest_bytes(out), path)
        if check_digest and not m.sealed:
            raise OutputError(f"{path}: manifest_digest does not match its content: the manifest was edited "
                              f"after conversion", remedy=CONVERT_FORCE)
        return m

    @property
    def content_identity(self) -> str:
        """What the nodes compare as the weights' identity (`output.share.identity_line`): the digest of every
        rank file's recorded content stamp, which verify checks against the files' bytes."""
        return roles_identity(self.roles)

    def rank(self, role: str, rank: int) -> RankRecord:
        """`role`'s entry of TP rank `rank` (by its `rank` field); OutputError naming it when the manifest
        lists none (output/output_check refuses such a manifest before any reader asks)."""
        entry = next((e for e in self.roles.get(role, ()) if e.rank == rank), None)
        if entry is None:
            raise OutputError(f"{MANIFEST_NAME}: lists no {role} entry for TP rank {rank} of {self.tp_size}: the "
                              f"manifest was edited", remedy=VERIFY.at(out="OUT"))
        return entry

    def files(self, ranks: list[int] | None = None) -> list[tuple[str, int, FileRecord]]:
        """(role, rank, file) for every rank file listed (of `ranks` only, when given)."""
        return [(role, e.rank, f) for role, entries in self.roles.items() for e in entries
                if ranks is None or e.rank in ranks for f in e.files]


MANIFEST_FIELDS = schema_of(Manifest)  # the check every manifest passes before its records are built


def _layout_problem(m: Manifest) -> str | None:
    """Why the manifest's file paths are not the output contract's, or None: rank entry r of a role
    lists exactly `part_path(role, r, 0..)` and its tensors live in those files. A manifest is public
    (its self-digest can be recomputed), so this, not the digest, keeps readers inside OUT."""
    if m.arch is None and m.expert_layout != "model":
        return "arch is null (any GPU family) but the experts are in kernel layout, which is laid out for one"
    for role, ranks in m.roles.items():
        for r, entry in enumerate(ranks):
            if entry.rank != r:
                return f"roles.{role}.ranks[{r}] says rank {entry.rank}"
            paths = []
            for i, f in enumerate(entry.files):
                want = part_path(role, r, i)
                if f.path != want:
                    return (f"roles.{role}.ranks[{r}].files[{i}].path is {f.path[:80]!r}; an output lists "
                            f"{want!r} there (files lie only in OUT's rank folders)")
                paths.append(want)
            for name, t in entry.tensors.items():
                if t.file not in paths:
                    return f"{role} rank {r} tensor {name[:80]!r} lies in {t.file[:80]!r}, not one of its files"
    return None


def copy_problems(out: Path, m: Manifest, fix: str | None = None) -> list[tuple[str, str]]:
    """(name, what is wrong) for each config/tokenizer copy in OUT that is not the one convert made
    (vLLM reads OUT/config.json and the tokenizer, so an edit there changes the served model). `fix`:
    the repair named instead of convert's (a node's share is staged again)."""
    problems = []
    copies = m.copies
    for name in sorted(set(m.source.side_files) - set(copies)):
        problems.append((name, f"{name}: listed as copied from the source but its digest is not recorded; "
                               f"{fix or CONVERT_FORCE}"))
    for name, rec in sorted(copies.items()):
        path = Path(out) / name
        card = name == CARD_NAME
        back = fix or (str(CONVERT_RESUME) if card else f"copy the source's {name} back, or {CONVERT_RESUME}")
        try:
            data = read_regular(path, JSON_LIMIT)
        except FileNotFoundError:
            problems.append((name, f"{name}: copied from the source by convert, now missing; {back}"))
            continue
        except (Refused, OSError) as e:
            problems.append((name, f"{e}" if isinstance(e, Refused) else f"{path}: unreadable ({e.strerror})"))
            continue
        got = "blake3:" + blake3(data).hexdigest()
        if len(data) != rec.bytes or got != rec.digest:
            read = "the card says how to fetch and serve OUT" if card else "vLLM reads it from OUT"
            problems.append((name, f"{name}: {len(data)} bytes, digest {got[7:23]}..., not the copy convert made "
                                   f"({rec.bytes} bytes, {rec.digest[7:23]}...): it was edited, and {read}; {back}"))
    return problems


def source_model(out: Path, m: Manifest, model: str | None) -> tuple[str, str | None, bool]:
    """(MODEL, its revision, whether it came from the manifest): MODEL as given (a repo id is read at the
    commit the manifest records when it is that repo), or else the source the manifest recorded: its
    path where that is a directory here, else its repo id at the recorded commit (read from the Hugging
    Face cache, or from the Hub: `diff OUT` checks the revision that was converted)."""
    if model is not None:
        return model, m.source.revision if model == m.source.repo else None, False
    path, repo, revision = m.source.path, m.source.repo, m.source.revision
    if not path:
        raise OutputError(f"{out}'s manifest records no source path; pass MODEL after OUT")
    try:
        is_dir = Path(path).is_dir()
    except (OSError, ValueError):  # a name too long, a NUL byte
        is_dir = False
    if is_dir:
        return path, None, True
    if repo and revision:
        return repo, revision, True
    raise SourceError(f"{out} was converted from {path}, which is not a directory here; pass MODEL after OUT")
