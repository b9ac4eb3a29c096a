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
import os
import re
from pathlib import Path

from blake3 import blake3

from .. import __version__
from ..errors import CONVERT_FORCE, CONVERT_RESUME, COPY_AGAIN, OutputError
from ..formats.stheader import (META_CONTENT, META_CONVERSION_ID, META_FORMAT, META_PART, META_RANK, META_ROLE,
                                META_TP_SIZE)
from ..guarded_io import JSON_LIMIT, Refused, read_regular
from ..model.options import Options
from ..outnames import MANIFEST_NAME, STATE_DIR

COMPLETE_NAME = "COMPLETE"
CARD_NAME = "README.md"  # the Hub model card convert writes (engine/card.py), recorded among the copies
RECORD_REL = f"{STATE_DIR}/conversion.json"  # the conversion record (engine/owned.py): OUT is a conversion's
FORMAT = "lucifer-shard/manifest"
FORMAT_VERSION = 2  # 2: rank files stamped with their source content, digests of the copied side files
# The fix of a damaged rank file: the repair rewrites just the files that fail, from the source; only a mix it
# cannot repair (a link, an entry it did not write) needs the whole conversion again (a share: share.SHARE_REPAIR).
REPAIR = str(CONVERT_RESUME.after("", "convert --force"))


def conversion_id(fingerprint: str, options: Options) -> str:
    """Identity of a conversion, known before any byte is written (stamped into every file)."""
    blob = json.dumps({"format_version": FORMAT_VERSION, "tool_version": __version__, "source": fingerprint,
                       "options": options.to_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def rank_dir(role: str, rank: int) -> str:
    return f"{role}/rank-{rank}"


def part_path(role: str, rank: int, part: int) -> str:
    return f"{rank_dir(role, rank)}/part-{part:05d}.safetensors"


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


def stamps_digest(stamps: dict[str, str]) -> str:
    """The output's content identity: BLAKE3 over every rank file's path and content stamp, in path order.
    Each stamp is bound to its file's bytes (the header carries it, the file digest covers the header),
    so unlike `source.content` it cannot be claimed by a re-sealed manifest without verify refusing it."""
    h = blake3()
    for path in sorted(stamps):
        h.update(path.encode() + b"\0" + stamps[path].encode() + b"\0")
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
        raise OutputError(f"{path}: unreadable ({e.strerror})", remedy=CONVERT_FORCE) from None


def complete_problem(out: Path, cid: str) -> str | None:
    """Why OUT/COMPLETE does not mark the conversion `cid` as finished (missing, not a regular file,
    empty, garbage, another conversion's id), or None when it does."""
    path = Path(out) / COMPLETE_NAME
    try:
        text = read_regular(path, 4096).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        if not os.path.lexists(Path(out) / RECORD_REL):  # no conversion record: a stage, fetch or copy stopped
            again = COPY_AGAIN.after("", f"copy the output again (everything but .lucifer/, {COMPLETE_NAME} last)")
            return f"no {COMPLETE_NAME} marker ({COMPLETE_NAME} missing): the copy did not finish; {again}"
        return f"no {COMPLETE_NAME} marker ({COMPLETE_NAME} missing): the conversion did not finish; {CONVERT_RESUME}"
    except Refused as e:
        return f"{e}"
    except OSError as e:
        return f"{path}: unreadable ({e.strerror}); {CONVERT_FORCE}"
    if text == cid:
        return None
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        return f"{COMPLETE_NAME} holds {text[:24]!r}, not a conversion id: it was not written by convert; {CONVERT_FORCE}"
    return (f"{COMPLETE_NAME} holds {text[:16]}..., the manifest's conversion id is {cid[:16]}...: files of two "
            f"conversions are mixed; {CONVERT_FORCE}")
