"""The shim's view of a lucifer-shard output directory: the typed manifest and what the shim asks of it, rank files,
plan comparison.

The output contract (manifest format and self-digest, file identity metadata, safetensors
headers, roles, the virtual-TP plan) is the converter's: this module reads it through
`lucifer_shard.output.manifest_types` (the typed manifest), `.stheader`, `.plan` and `.rules` and only turns
their errors into the shim's one-line `ShimError`. Imports neither vLLM nor torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lucifer_shard.errors import CONVERT, CONVERT_AGAIN, CONVERT_RESUME, VERIFY, MismatchError, OutputError, PlanError
from lucifer_shard.formats.stheader import Header, HeaderError, read_header as _read_header
from lucifer_shard.guarded_io import Refused, Tree
from lucifer_shard.model.arches import MOE_VARIANT
from lucifer_shard.model.config import MTP, ModelConfig
from lucifer_shard.model.plan import Axis, Plan, make_plan, stock_padded
from lucifer_shard.model.rules import ROLES
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import FORMAT, FORMAT_VERSION
from lucifer_shard.output.manifest_types import Manifest, PlanRecord, RankRecord
from lucifer_shard.output.outlock import writer_of
from lucifer_shard.output.output_check import check_output
from lucifer_shard.output.outwatch import ReadWatch

from .errors import ShimError

MOE_VARIANTS = tuple(dict.fromkeys(MOE_VARIANT.values()))
# manifest plan axis -> key of vLLM's `hf_text_config.vllm_virtual_tp_plan`
PLAN_AXES = {
    "heads": "attention_heads",
    "groups": "output_groups",
    "routed": "moe_intermediate_size",
    "shared": "shared_expert_intermediate_size",
    "vocab": "vocab_size",
}


def manifest_path(out: Path) -> Path:
    return Path(out) / MANIFEST_NAME


def draft_kind(doc: Manifest) -> str | None:
    """What OUT/draft holds (model/drafts.DRAFT_KINDS), None without a draft; MTP for a manifest
    written before the record existed."""
    if "draft" not in doc.roles:
        return None
    return doc.draft.kind if doc.draft is not None else MTP


def draft_tokens(doc: Manifest) -> int:
    return doc.draft.tokens if doc.draft is not None else 1


def roles(doc: Manifest) -> tuple[str, ...]:
    return tuple(r for r in ROLES if r in doc.roles)


def needs_virtual_tp(doc: Manifest) -> bool:
    return pads_virtually(doc.plan)


@dataclass(frozen=True)
class Output:
    """A lucifer-shard output as the shim holds it: its directory and its manifest, read and checked
    once (`open_output`) and passed on whole."""

    path: Path
    manifest: Manifest


def open_output(out: str | Path, check_digest: bool = True) -> Output:
    """OUT with its manifest read and checked (`load_manifest`)."""
    return Output(Path(out), load_manifest(out, check_digest))


def rank_entry(output: Output, role: str, rank: int) -> RankRecord:
    """The manifest's record of `role` rank `rank`; a ShimError naming the role or rank OUT lacks."""
    out, doc = output.path, output.manifest
    if role not in doc.roles:
        have = ", ".join(doc.roles) or "none"
        hint = " (converted with --no-mtp: start vLLM without a speculative config)" if role == "draft" else ""
        raise ShimError(f"{manifest_path(out)} has no {role!r} role (roles: {have}){hint}")
    try:
        return doc.rank(role, rank)
    except OutputError:  # load_manifest's output check refuses such a manifest first
        raise ShimError(f"rank files missing: {manifest_path(out)} lists no {role} files for rank {rank} of "
                        f"tp_size {doc.tp_size}", VERIFY.at(out=str(out))) from None


def load_manifest(out: str | Path, check_digest: bool = True) -> Manifest:
    """Read OUT/lucifer-manifest.json with the converter's reader and run the one output check every
    reader runs (lucifer_shard.output.output_check: what verify refuses without hashing is refused here);
    `check_digest` also asks for its self-digest (a hand-edited manifest). One-line ShimErrors."""
    out = Path(out)
    path = out / MANIFEST_NAME
    if not out.is_dir():
        raise ShimError(f"model path {out} is not a local directory; --load-format lucifer_tp3 needs the output "
                        f"directory of lucifer-shard convert")
    writer = writer_of(out)
    if writer is not None:
        raise ShimError(f"{out} is being written by lucifer-shard convert ({writer}); start vLLM when it has finished")
    try:
        doc = check_output(out, seal=check_digest).refuse()
    except MismatchError as e:
        raise ShimError(str(e)) from None
    except OutputError as e:
        if not path.exists():
            raise ShimError(f"{path} not found: {out} is not a lucifer-shard output",
                            CONVERT.at(model="MODEL", out=str(out)).after("", "drop --load-format lucifer_tp3")) from None
        hint = ("; use the lucifer-shard version that wrote it"
                if f"expected {FORMAT!r} v{FORMAT_VERSION}" in str(e) else "")
        raise ShimError(f"{e}{hint}") from None
    if doc.expert_layout != "model" and doc.moe_variant not in MOE_VARIANTS:
        raise ShimError(f"{path}: moe_variant {doc.moe_variant!r} is not one of {', '.join(MOE_VARIANTS)}")
    return doc


def read_header(path: Path, fd: int | None = None) -> Header:
    """The validated header of a rank file (`lucifer_shard.formats.stheader`, the reader the converter
    uses; from `fd` when given): every tensor's dtype, shape and offsets and the `__metadata__`;
    one-line ShimErrors."""
    try:
        return _read_header(path, fd=fd)
    except HeaderError as e:
        raise ShimError(f"{e}; the file is corrupt", CONVERT_AGAIN) from None


def open_rank_file(out: Path, rel: str, role: str, rank: int) -> int:
    """A read-only descriptor of OUT/`rel` reached through real directories (no link followed: the
    loader reads nothing outside OUT, whatever the manifest or the folders say)."""
    try:
        return Tree(out).open_read(rel)
    except FileNotFoundError:
        raise ShimError(f"rank files missing: {Path(out) / rel} (listed in the manifest for {role} rank {rank}) "
                        f"does not exist", CONVERT_RESUME.after("", "copy the whole output directory")) from None
    except Refused as e:
        raise ShimError(f"{e}; copy the output directory with its files, not links to them") from None
    except OSError as e:
        raise ShimError(f"{Path(out) / rel}: cannot be read ({e.strerror})") from None


def watch(out: Path) -> ReadWatch:
    """Note OUT's manifest and COMPLETE before a load; `check_watch` after it."""
    return ReadWatch.start(Path(out))


def check_watch(w: ReadWatch) -> None:
    """ShimError when a convert wrote OUT during the load: what was loaded may mix two outputs."""
    problem = w.problem("vLLM")
    if problem:
        raise ShimError(problem)


# ---------------------------------------------------------------------------- virtual-TP plan


def compare_plan(runtime_plan: dict | None, manifest_plan: PlanRecord | Plan) -> str | None:
    """None when vLLM's live plan equals the manifest's; otherwise a one-line difference."""
    axes = manifest_plan.axes
    tp = manifest_plan.tp
    if runtime_plan is None:
        padded = [n for n in PLAN_AXES if n in axes and axis_pads(axes[n])]
        if padded:
            name, a = padded[0], axes[padded[0]]
            stock = stock_padded(a.name, a.original)
            alone = f" (vLLM alone pads it to {stock})" if stock != a.original else ""
            return (f"virtual-TP plan missing at runtime, but the files pad axis {PLAN_AXES[name]} "
                    f"{a.original} -> {a.padded}{alone}")
        return None
    for name, key in PLAN_AXES.items():
        if name not in axes:
            continue
        want = axes[name]
        got = runtime_plan.get(key)
        if got is None:
            if name in ("groups", "shared") and not axis_pads(want):
                continue
            return f"virtual-TP plan mismatch: runtime plan has no axis {key} (manifest {want.original} -> {want.padded})"
        for mk, rk in (("original", "original_size"), ("padded", "padded_size"), ("local", "local_size")):
            if int(got.get(rk, -1)) != getattr(want, mk):
                return (f"virtual-TP plan mismatch on axis {key} (runtime {rk} {got.get(rk)}, manifest "
                        f"{getattr(want, mk)})")
        if "tp_size" in got and int(got["tp_size"]) != tp:
            return f"virtual-TP plan mismatch on axis {key} (runtime tp_size {got['tp_size']}, manifest {tp})"
    return None


def axis_pads(axis: Axis) -> bool:
    """Whether an axis is padded by virtual TP: beyond what vLLM pads it to by itself
    (`lucifer_shard.model.plan.stock_padded`: the vocabulary to a multiple of 64)."""
    return axis.padded != stock_padded(axis.name, axis.original)


def pads_virtually(plan: PlanRecord | Plan) -> bool:
    """Whether a plan (the manifest's, or `make_plan`'s) pads any axis the way only vLLM's virtual TP
    does. Not `Plan.pads`: that also counts the FlashInfer kernel's rounding of the routed width
    (`kernel_local`) and vLLM's own vocabulary padding, neither of which is virtual TP."""
    return any(axis_pads(a) for a in plan.axes.values())


def virtual_tp_needed(cfg: ModelConfig, tp: int) -> bool:
    """Whether vLLM's DeepSeek-V4 plan at `tp` pads any axis (`lucifer_shard.model.plan.make_plan`)."""
    try:
        plan = make_plan(cfg, tp)
    except PlanError:
        # a TP size the virtual-TP plan cannot serve (outside 1..8, or heads that do not fill whole
        # output groups) is not a plain split either
        return tp > 0
    return pads_virtually(plan)
