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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from blake3 import blake3

from .. import __version__
from ..errors import OutputError, SourceError
from ..guarded_io import JSON_LIMIT, Refused, read_regular
from .arches import ARCHES
from .plan import DEFAULT_ROUTE, MAX_TP, MOE_ROUTES
from .stheader import (META_CONTENT, META_CONVERSION_ID, META_FORMAT, META_PART, META_RANK, META_ROLE,
                       META_TP_SIZE)
from .schema import Bool, Int, Null, OneOf, Where
from .records import fld, to_doc

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


def _power_of_two(x: int) -> str | None:
    return None if x & (x - 1) == 0 else f"{x} is not a power of two"


@dataclass(frozen=True)
class Options:
    """Everything that decides the bytes of a conversion (and so its identity); the manifest's and the
    conversion record's `options`, each field with its spec (spec/records.py)."""

    tp: int = fld(Int(1, MAX_TP))
    # None: model layout for any GPU family (the files do not depend on it)
    arch: str | None = fld(Null(OneOf(ARCHES)), default=ARCHES[0])
    expert_layout: str = fld(OneOf(("kernel", "model")), default="kernel")
    flashinfer_layout: str = fld(OneOf(("folded", "legacy")), default="folded")
    mtp: bool = fld(Bool(), default=True)
    max_file_bytes: int = fld(Int(1), default=4 << 30)
    # data-section and tensor alignment for direct-I/O loaders (a power of two >= 8)
    align: int = fld(Where(Int(8, MAX_ALIGN), _power_of_two), default=8)
    # a MOE_ROUTES key other than the default ("b12x"): the routed width's route. Written only when set, so
    # outputs of the default route keep the conversion id they had before the field existed.
    moe_backend: str | None = fld(OneOf(tuple(r for r in MOE_ROUTES if r != DEFAULT_ROUTE)), optional=True)

    def to_dict(self) -> dict:
        """The options as the manifest records them."""
        return to_doc(self)


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
    return {META_FORMAT: str(FORMAT_VERSION), META_CONVERSION_ID: cid, META_ROLE: role, META_RANK: str(rank),
            META_PART: str(part), META_TP_SIZE: str(tp), META_CONTENT: content}


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
