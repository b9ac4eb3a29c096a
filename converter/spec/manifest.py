"""The output directory contract and its manifest.

```
OUT/config.json, tokenizer and generation files   byte-identical copies of the source's
OUT/lucifer-manifest.json                         written after every rank file
OUT/<role>/rank-<r>/part-<NNNNN>.safetensors      role = target (main model) or draft (MTP or DSpark)
OUT/COMPLETE                                      written last
OUT/.lucifer/                                     conversion record and journal (for --resume)
```
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from blake3 import blake3

from .. import __version__
from ..errors import OutputError, SourceError
from ..guarded_io import JSON_LIMIT, Refused, read_regular
from .arches import ARCHES
from .drafts import DRAFT_KINDS
from .plan import DEFAULT_ROUTE, MAX_TP, MOE_ROUTES
from .rules import DTYPE_SIZE, ROLES
from .source import SIDE_FILES
from .schema import Bool, Int, ListOf, MapOf, Null, Obj, OneOf, SchemaError, Str, Where, check, loads

if TYPE_CHECKING:
    from .manifest_types import Manifest

MANIFEST_NAME = "lucifer-manifest.json"
COMPLETE_NAME = "COMPLETE"
CARD_NAME = "README.md"  # the Hub model card convert writes (engine/card.py), recorded among the copies
STATE_DIR = ".lucifer"
RECORD_REL = f"{STATE_DIR}/conversion.json"  # the conversion record (engine/owned.py): OUT is a conversion's
FORMAT = "lucifer-shard/manifest"
FORMAT_VERSION = 2  # 2: rank files stamped with their source content, digests of the copied side files
MAX_ALIGN = 2 << 20  # --align: a 2 MiB huge page is the largest alignment any loader asks for
# The fix of a damaged rank file: the repair rewrites just the files that fail, from the source; only a mix it
# cannot repair (a link, an entry it did not write) needs the whole conversion again (a share: share.SHARE_REPAIR).
REPAIR = "run the same convert command with --resume (it rewrites just the damaged files), or convert --force"


@dataclass(frozen=True)
class Options:
    """Everything that decides the bytes of a conversion (and so its identity)."""

    tp: int
    arch: str | None = ARCHES[0]  # None: model layout for any GPU family (the files do not depend on it)
    expert_layout: str = "kernel"
    flashinfer_layout: str = "folded"
    mtp: bool = True
    max_file_bytes: int = 4 << 30
    align: int = 8  # data-section and tensor alignment for direct-I/O loaders (a power of two >= 8)
    moe_backend: str | None = None  # a MOE_ROUTES key other than the default ("b12x"): the routed width's route

    def to_dict(self) -> dict:
        """The options as the manifest records them; `moe_backend` only when set, so outputs of the default
        route keep the conversion id they had before the field existed."""
        d = asdict(self)
        if d["moe_backend"] is None:
            del d["moe_backend"]
        return d


def conversion_id(fingerprint: str, options: Options) -> str:
    """Identity of a conversion, known before any byte is written (stamped into every file)."""
    blob = json.dumps({"format_version": FORMAT_VERSION, "tool_version": __version__, "source": fingerprint,
                       "options": options.to_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def rank_dir(role: str, rank: int) -> str:
    return f"{role}/rank-{rank}"


def part_path(role: str, rank: int, part: int) -> str:
    return f"{rank_dir(role, rank)}/part-{part:05d}.safetensors"


def rank_of(rel: str) -> int:
    """The TP rank of rank file `rel` (`part_path`'s `role/rank-<r>/part-<NNNNN>.safetensors`)."""
    return int(rel.split("/")[1].removeprefix("rank-"))


def file_metadata(cid: str, role: str, rank: int, part: int, tp: int, content: str) -> dict[str, str]:
    """A rank file's identity stamp. `content`: the digest of the source tensors the file was made
    from (`part_content`), so files of two checkpoints with the same headers differ in their stamp."""
    return {"lucifer.format": str(FORMAT_VERSION), "lucifer.conversion_id": cid, "lucifer.role": role,
            "lucifer.rank": str(rank), "lucifer.part": str(part), "lucifer.tp_size": str(tp),
            "lucifer.content": content}


CONTENT_PLACEHOLDER = "blake3:" + "0" * 64  # as long as every content stamp: header sizes are known up front


def part_content(sources: dict[str, str]) -> str:
    """The content stamp of a part's files: BLAKE3 over its source tensors' (key, digest) in key order."""
    h = blake3()
    for key in sorted(sources):
        h.update(key.encode() + b"\0" + bytes.fromhex(sources[key]))
    return "blake3:" + h.hexdigest()


def file_digest(header: bytes, tensor_digests: list[str]) -> str:
    """A rank file's digest as the manifest records it: BLAKE3 over its header and its tensors' digests."""
    h = blake3(header)
    for d in tensor_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def _canonical(doc: dict) -> bytes:
    body = {k: v for k, v in doc.items() if k != "manifest_digest"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(doc: dict) -> dict:
    """Add the self-digest that lets `verify` detect a hand-edited manifest."""
    return {**doc, "manifest_digest": "blake3:" + blake3(_canonical(doc)).hexdigest()}


def manifest_text(doc: dict) -> str:
    return json.dumps(seal(doc), indent=1, sort_keys=True) + "\n"


def _power_of_two(x: int) -> str | None:
    return None if x & (x - 1) == 0 else f"{x} is not a power of two"


_HEX64 = Str(r"[0-9a-f]{64}")
_DIGEST = Str(r"blake3:[0-9a-f]{64}")
_N = Int()
_SIDE = OneOf(SIDE_FILES)  # the names convert copies: a manifest cannot send a reader elsewhere
_COPY = OneOf((*SIDE_FILES, CARD_NAME))  # and the model card it writes beside them
OPTIONS = Obj({"tp": Int(1, MAX_TP), "arch": Null(OneOf(ARCHES)), "expert_layout": OneOf(("kernel", "model")),
               "flashinfer_layout": OneOf(("folded", "legacy")), "mtp": Bool(), "max_file_bytes": Int(1),
               "align": Where(Int(8, MAX_ALIGN), _power_of_two)},
              optional={"moe_backend": OneOf(tuple(r for r in MOE_ROUTES if r != DEFAULT_ROUTE))}, closed=True)
_FILE = Obj({"path": Str(), "bytes": _N, "digest": _DIGEST, "content": _DIGEST})
_PIECE = Obj({"key": Str(), "dim": Int(0, 7), "src_start": _N, "dst_start": _N, "length": _N, "seg_len": _N})
_TENSOR = Obj({"file": Str(), "digest": _DIGEST, "dtype": OneOf(tuple(DTYPE_SIZE)),
               "shape": ListOf(_N, max_len=8), "model_shape": ListOf(_N, max_len=8), "layout": Str(),
               "experts": Null(_N), "sources": ListOf(_PIECE), "source_dtype": OneOf(tuple(DTYPE_SIZE)),
               "zero_regions": ListOf(ListOf(_N, 3, 3)), "pad": OneOf(("zero", "-inf"))},
              optional={"view_as": OneOf(tuple(DTYPE_SIZE))})
_AXIS = Obj({"name": Str(), "original": _N, "padded": _N, "local": _N, "kernel_local": _N})
MANIFEST_FIELDS = Obj({
    "format": Str(), "format_version": Int(), "tool_version": Str(), "conversion_id": _HEX64,
    "manifest_digest": Str(),
    "source": Obj({"fingerprint": _HEX64, "path": Str(), "files": MapOf(_N), "side_files": ListOf(_SIDE),
                   "content": Obj({"algorithm": Str(), "block_bytes": _N, "tensors": _N, "files": MapOf(_DIGEST),
                                   "digest": _DIGEST})},
                  optional={"repo": Null(Str(r"[^/\s]+/[^/\s]+")), "revision": Null(Str(r"[0-9a-f]{40}"))}),
    "copies": MapOf(Obj({"bytes": _N, "digest": _DIGEST}), key=_COPY),
    "tp_size": Int(1, MAX_TP), "plan": Obj({"tp": Int(1, MAX_TP), "axes": MapOf(_AXIS)}), "options": OPTIONS,
    "arch": Null(OneOf(ARCHES)), "moe_variant": Null(Str()), "expert_layout": OneOf(("kernel", "model")),
    "flashinfer_layout": Null(OneOf(("folded", "legacy"))),
    "layouts": MapOf(Obj({"name": Str(), "steps": ListOf(Str()), "version": _N})), "layout_version": _N,
    "runtime": MapOf(Str()), "dropped": MapOf(Str()),
    "roles": MapOf(Obj({"ranks": ListOf(Obj({"rank": Int(0, MAX_TP - 1), "files": ListOf(_FILE, 1),
                                            "tensors": MapOf(_TENSOR)}), 1, MAX_TP)}), key=OneOf(ROLES)),
}, optional={"runtime_owned": ListOf(Str()),
             # the draft's kind (spec/drafts.DRAFT_KINDS); a manifest without it and with a draft role is MTP's
             "draft": Obj({"kind": OneOf(tuple(DRAFT_KINDS)), "stages": Int(1, 16), "tokens": Int(1, 64)})})


def _layout_problem(doc: dict) -> str | None:
    """Why the manifest's file paths are not the output contract's, or None: rank entry r of a role
    lists exactly `part_path(role, r, 0..)` and its tensors live in those files. A manifest is public
    (its self-digest can be recomputed), so this, not the digest, keeps readers inside OUT."""
    if doc["arch"] is None and doc["expert_layout"] != "model":
        return "arch is null (any GPU family) but the experts are in kernel layout, which is laid out for one"
    for role, rdoc in doc["roles"].items():
        for r, entry in enumerate(rdoc["ranks"]):
            if entry["rank"] != r:
                return f"roles.{role}.ranks[{r}] says rank {entry['rank']}"
            paths = []
            for i, f in enumerate(entry["files"]):
                want = part_path(role, r, i)
                if f["path"] != want:
                    return (f"roles.{role}.ranks[{r}].files[{i}].path is {f['path'][:80]!r}; an output lists "
                            f"{want!r} there (files lie only in OUT's rank folders)")
                paths.append(want)
            for name, t in entry["tensors"].items():
                if t["file"] not in paths:
                    return f"{role} rank {r} tensor {name[:80]!r} lies in {t['file'][:80]!r}, not one of its files"
    return None


def parse_manifest(data: bytes, path: Path | str) -> dict:
    """A manifest document from its bytes: format, then every field's type and range, then the file
    layout; OutputError (one line) otherwise. Its reader is `Manifest.parse` (spec/manifest_types.py),
    which checks the self-digest (`digest_ok`) too."""
    try:
        doc = loads(data)
    except SchemaError as e:
        raise OutputError(f"{path}: unreadable ({e}); re-run convert --force") from None
    if not isinstance(doc, dict):
        raise OutputError(f"{path}: is a JSON {type(doc).__name__}, not a lucifer-shard manifest; re-run convert "
                          f"--force")
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise OutputError(f"{path}: format {str(doc.get('format'))[:60]!r} v{str(doc.get('format_version'))[:20]}, "
                          f"expected {FORMAT!r} v{FORMAT_VERSION}; re-run lucifer-shard convert --force")
    try:
        check(MANIFEST_FIELDS, doc)
    except SchemaError as e:
        raise OutputError(f"{path}: field {e}; the manifest was edited or damaged, re-run convert --force") from None
    problem = _layout_problem(doc)
    if problem:
        raise OutputError(f"{path}: {problem}; the manifest was edited, re-run convert --force")
    return doc


def digest_ok(doc: dict) -> bool:
    return doc.get("manifest_digest") == "blake3:" + blake3(_canonical(doc)).hexdigest()


def read_manifest_bytes(out: Path) -> bytes:
    """OUT/lucifer-manifest.json's bytes (a regular file, no link, bounded); OutputError otherwise."""
    path = Path(out) / MANIFEST_NAME
    try:
        return read_regular(path, JSON_LIMIT)
    except FileNotFoundError:
        raise OutputError(f"{path}: missing; {out} is not a finished lucifer-shard output (run convert)") from None
    except Refused as e:
        raise OutputError(f"{e}") from None
    except OSError as e:
        raise OutputError(f"{path}: unreadable ({e.strerror}); re-run convert --force") from None


def complete_problem(out: Path, cid: str) -> str | None:
    """Why OUT/COMPLETE does not mark the conversion `cid` as finished (missing, not a regular file,
    empty, garbage, another conversion's id), or None when it does."""
    path = Path(out) / COMPLETE_NAME
    try:
        text = read_regular(path, 4096).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return (f"no {COMPLETE_NAME} marker ({COMPLETE_NAME} missing): the conversion did not finish (run convert "
                f"again with --resume)")
    except Refused as e:
        return f"{e}"
    except OSError as e:
        return f"{path}: unreadable ({e.strerror}); re-run convert --force"
    if text == cid:
        return None
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        return (f"{COMPLETE_NAME} holds {text[:24]!r}, not a conversion id: it was not written by convert; re-run "
                f"convert --force")
    return (f"{COMPLETE_NAME} holds {text[:16]}..., the manifest's conversion id is {cid[:16]}...: files of two "
            f"conversions are mixed; re-run convert --force")


def copy_problems(out: Path, m: Manifest, fix: str | None = None) -> list[tuple[str, str]]:
    """(name, what is wrong) for each config/tokenizer copy in OUT that is not the one convert made
    (vLLM reads OUT/config.json and the tokenizer, so an edit there changes the served model). `fix`:
    the repair named instead of convert's (a node's share is staged again)."""
    problems = []
    copies = m.copies
    for name in sorted(set(m.source.side_files) - set(copies)):
        problems.append((name, f"{name}: listed as copied from the source but its digest is not recorded; "
                               f"{fix or 're-run convert --force'}"))
    for name, rec in sorted(copies.items()):
        path = Path(out) / name
        card = name == CARD_NAME
        back = fix or ("run the same convert command with --resume (it writes the card again)" if card else
                       f"copy the source's {name} back, or run the same convert command with --resume")
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
