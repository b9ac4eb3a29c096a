"""The load plan: every check `--load-format lucifer_tp3` makes before the first byte is read, and what to read
into what. Imports neither vLLM nor torch: the loader (loader.py) describes the engine and the model it built
(`Engine`, `ModelView`) and this module decides, so each refusal is tested on CPU (tests/test_loadplan.py).

The checks of the rank files themselves (present, sized, headed and stamped as the manifest says) are
loadfiles.py's; those of the model's keys, shapes, dtypes and expert groups are here.
"""
from __future__ import annotations

from dataclasses import dataclass

from lucifer_shard.model.config import ARCHITECTURE
from lucifer_shard.model.drafts import DRAFT_KINDS, owned_by_runtime
from lucifer_shard.model.layouts import EXPERT_TENSORS, layout_by_name
from lucifer_shard.model.runtimes import MOE_BACKEND, flashinfer_problem
from lucifer_shard.output.manifest_types import Manifest, RankRecord, TensorRecord
from lucifer_shard.output.share import share_problem

from ..adapt.lucifer_tuple import tp_mismatch
from lucifer_shard.errors import CONVERT_AGAIN, CONVERT_FORCE, DOCTOR, SERVE

from ..errors import ShimError
from ..manifest import Output, draft_kind, manifest_path, rank_entry
from .loadfiles import CheckedRankFile, check_files, few, shape_text

TARGET_CLASSES = (ARCHITECTURE,)
DRAFT_CLASSES = {k.vllm_class: k.name for k in DRAFT_KINDS.values()}  # vLLM's draft class -> draft kind
# The only reinterpretation allowed, and only where the manifest declares it (`view_as`); dtype names as
# the files spell them (formats/dtypes.TORCH_DTYPE).
VIEW_PAIRS = {frozenset(("U8", "F8_E8M0"))}
# parallel dimension the MoE shard index flattens into TP -> the vLLM flag that sets it
FLATTENED = {"dp": "--data-parallel-size", "pcp": "--prefill-context-parallel-size"}


@dataclass(frozen=True)
class Param:
    """A parameter or persistent buffer of the model vLLM built, as the checks need it."""

    shape: tuple[int, ...]
    dtype: str  # the files' spelling (formats/dtypes.TORCH_DTYPE's key) where there is one
    buffer: bool = False
    contiguous: bool = True


@dataclass(frozen=True)
class MoeModule:
    """A module with a `quant_method`: the MoE backend it resolved to and its (tp_rank, tp_size, ep_size)."""

    backend: str | None
    parallel: tuple[int, int, int] | None


@dataclass(frozen=True)
class ModelView:
    cls: str  # the model class vLLM built
    params: dict[str, Param]  # parameters and persistent buffers by name
    moe: dict[str, MoeModule]  # by module prefix


@dataclass(frozen=True)
class Engine:
    """What the loader reads from vLLM before it reads a byte."""

    tp: int
    rank: int
    sizes: dict[str, int]  # "pp", "dp", "pcp" -> world size
    verify: str  # settings.LOADER_OPTIONS["verify"]
    forced_role: str = "auto"  # --model-loader-extra-config role
    role_hint: str | None = None  # what vLLM says it is loading (the draft's config or the target's)
    relayout_missing: str | None = None  # why the expert re-layout wrapper is not installed; None: it is
    arch: str | None = None  # the GPU family (None: no GPU) and its capability
    capability: str = ""
    plan_difference: str | None = None  # the live config's virtual-TP geometry against the manifest's plan


@dataclass(frozen=True)
class Read:
    """One tensor: `nbytes` at `offset` of its file into parameter `param`, whole, its first `prefix` entries
    (`attn_sink`), or viewed in `view` (a kernel layout's shape)."""

    name: str
    offset: int
    param: str
    prefix: int | None = None
    view: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FilePlan:
    file: CheckedRankFile
    reads: tuple[Read, ...]


@dataclass(frozen=True)
class LoadPlan:
    role: str
    rank: int
    entry: RankRecord
    files: tuple[FilePlan, ...]
    expert_groups: dict[str, tuple[str, ...]]  # MoE prefixes whose experts arrive in kernel layout -> leaves


def check_engine(output: Output, config_problems: list[str], tp: int, relayout_missing: str | None,
                 flashinfer: str | None) -> None:
    """Before vLLM builds the model: its settings, TP size, the re-layout wrapper kernel-layout experts
    need and the FlashInfer generation sm90 files need (`flashinfer`: its installed version)."""
    out, doc = output.path, output.manifest
    if config_problems:
        raise ShimError("cannot load per-TP-rank files with " + "; ".join(config_problems))
    if mismatch := tp_mismatch(doc, tp):
        raise ShimError(mismatch)
    if doc.expert_layout != "model" and relayout_missing is not None:
        raise ShimError(f"{manifest_path(out)} has routed experts in kernel layout ({doc.moe_variant}), but the "
                        f"expert re-layout wrapper is not installed: {relayout_missing}; use a supported vLLM build",
                        DOCTOR.at(out=str(out)).after("", "convert with --expert-layout model"))
    if problem := flashinfer_problem(doc.flashinfer_layout, flashinfer):
        raise ShimError(f"{manifest_path(out)}: {problem[0]}; {problem[1]}")


def plan_load(output: Output, engine: Engine, model: ModelView) -> LoadPlan:
    """Every check before the first byte, in the order the loader made them; the plan, or one ShimError."""
    out, doc = output.path, output.manifest
    check_parallel(engine)
    if mismatch := tp_mismatch(doc, engine.tp):
        raise ShimError(mismatch)
    if missing := share_problem(out, doc.conversion_id, engine.rank, doc.tp_size):  # a node's share without this rank
        raise ShimError(missing)
    role = model_role(model.cls, engine.forced_role, engine.role_hint)
    check_model_class(output, model.cls, role)
    entry = rank_entry(output, role, engine.rank)
    files = check_files(output, role, engine.rank, entry, identity=engine.verify != "none")
    check_keys(doc, role, engine.rank, entry, model.params)
    if engine.plan_difference:
        raise ShimError(f"{engine.plan_difference}",
                        SERVE.at(out=str(output.path)).after("check B12X_MOE_FORCE_A8 / NVFP4 env"))
    groups = expert_groups(output, entry)
    check_expert_modules(doc, groups, model.moe, engine)
    reads = tuple(FilePlan(f, tuple(read(name, f.header.data_start + h.start, entry.tensors[name], model.params[name])
                                    for name, h in f.header.tensors.items())) for f in files)
    return LoadPlan(role, engine.rank, entry, reads, groups)


def check_parallel(engine: Engine) -> None:
    pp = engine.sizes.get("pp", 1)
    if pp != 1:
        raise ShimError(f"pipeline parallel size {pp}; lucifer_tp3 rank files are per TP rank, start with "
                        f"--pipeline-parallel-size 1")
    for dim, flag in FLATTENED.items():
        size = engine.sizes.get(dim, 1)
        if size != 1:
            raise ShimError(f"{dim} size {size}; the MoE shard index flattens dp/pcp into TP, so "
                            f"lucifer_tp3 files need {flag} 1")


def model_role(cls: str, forced: str, hint: str | None) -> str:
    """"draft" when vLLM built a draft class, else "target"; refused where the role key or vLLM says otherwise."""
    found = "draft" if cls in DRAFT_CLASSES else "target"
    if forced != "auto" and forced != found:
        raise ShimError(f"--model-loader-extra-config role={forced!r} but the model being loaded is the {found} "
                        f"model; drop the role key")
    if hint is not None and hint != found:
        raise ShimError(f"vLLM is loading the {hint} model but its parameters look like the {found} "
                        f"model; check the speculative config")
    return found


def check_model_class(output: Output, cls: str, role: str) -> None:
    """The class vLLM built is the one the files are for: the target's, or the class of OUT's draft kind
    (a DSpark output served with method "mtp" builds DeepSeekV4MTP, which has none of its weights)."""
    out, doc = output.path, output.manifest
    if role == "target":
        if cls not in TARGET_CLASSES:
            raise ShimError(f"model class {cls} is not {' / '.join(TARGET_CLASSES)}; lucifer_tp3 files hold "
                            f"DeepSeek-V4 target weights, check config.json in the output directory")
        return
    kind = DRAFT_KINDS[draft_kind(doc) or DRAFT_CLASSES[cls]]
    if cls != kind.vllm_class:
        raise ShimError(f"vLLM built the draft as {cls} but {out}/draft holds a {kind.label} "
                        f"({kind.vllm_class})", SERVE.at(out=f"{out} --draft").after(
                            "", f"start with --speculative-config '{{\"method\":\"{kind.method}\"}}'"))


def check_keys(doc: Manifest, role: str, rank: int, entry: RankRecord, params: dict[str, Param]) -> None:
    """The files' tensors are exactly the model's parameters (less those vLLM aliases from the target: a
    draft's `runtime_owned`), persistent buffers allowed, each of the parameter's dtype and shape."""
    files = set(entry.tensors)
    owned = owned_by_runtime(draft_kind(doc), params) if role == "draft" else set()
    buffers = {n for n, p in params.items() if p.buffer}
    want = set(params) - buffers - owned
    missing = want - files
    unexpected = files - want - (buffers - owned)
    if missing:
        raise ShimError(f"key missing: {len(missing)} parameter(s) of the {role} model are not in rank {rank} "
                        f"files: {few(missing)}; the output was converted for another model/vLLM build",
                        CONVERT_AGAIN)
    if unexpected:
        raise ShimError(f"key unexpected: {len(unexpected)} tensor(s) of {role} rank {rank} files have no "
                        f"parameter in the model: {few(unexpected)}; the output was converted for another "
                        f"model/vLLM build", CONVERT_AGAIN)
    for name in sorted(files):
        check_tensor(name, entry.tensors[name], params[name])


def is_sink(name: str, t: TensorRecord) -> bool:
    return name.endswith("attn_sink") and t.pad == "-inf" and len(t.shape) == 1


def kernel_shape(t: TensorRecord, p: Param) -> tuple[int, ...] | None:
    """The shape the file's kernel layout gives parameter `p` ([experts, rows, cols] in model layout), or None
    for model layout or a shape the layout cannot take. SM90's scale fold makes the 3-D parameter 5-D at the
    same byte count; the bytes then fill the parameter viewed in that shape, and the re-layout wrapper hands
    the kernel that view (wrappers/relayout.py): a reinterpretation, no narrowing."""
    if not t.kernel or len(p.shape) != 3 or not p.contiguous:
        return None
    try:
        return (p.shape[0], *layout_by_name(t.layout).kernel_shape((p.shape[1], p.shape[2])))
    except ValueError:
        return None


def check_tensor(name: str, t: TensorRecord, p: Param) -> None:
    if t.dtype != p.dtype and not (t.view_as == p.dtype and frozenset((t.dtype, p.dtype)) in VIEW_PAIRS):
        raise ShimError(f"dtype mismatch: tensor {name} is {t.dtype} in the files, param is "
                        f"{p.dtype}; no casting is performed, re-convert for this vLLM build")
    if is_sink(name, t):
        if len(p.shape) != 1 or p.shape[0] < t.shape[0]:
            raise ShimError(f"shape mismatch: tensor {name} {shape_text(t.shape)} does not fit param "
                            f"{shape_text(p.shape)} (attn_sink is copied into a prefix only)")
        return
    if p.shape != t.shape and kernel_shape(t, p) != t.shape:
        raise ShimError(f"shape mismatch: tensor {name} shape {shape_text(t.shape)} != param {shape_text(p.shape)}; "
                        f"no narrowing is performed, re-convert for this vLLM build and attention backend")


def read(name: str, offset: int, t: TensorRecord, p: Param) -> Read:
    """Where the file tensor's bytes go: the parameter; `attn_sink`'s prefix; a kernel-layout tensor whose
    layout reshapes it (SM90's folded scales), the parameter's storage viewed in the file's shape."""
    if is_sink(name, t):
        return Read(name, offset, name, prefix=t.shape[0])
    return Read(name, offset, name, view=None if p.shape == t.shape else t.shape)


def expert_groups(output: Output, entry: RankRecord) -> dict[str, tuple[str, ...]]:
    """Prefixes of the MoE modules whose routed experts arrive in kernel layout (expert_layout=kernel).

    Only the four routed-expert tensors may carry a kernel layout (w2_weight keeps the model
    layout on sm120/sm100, its bytes are unchanged by the kernel's re-layout); all four must be
    in the files for a tagged module."""
    doc, path = output.manifest, manifest_path(output.path)
    groups: dict[str, list[str]] = {}
    for name, t in entry.tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in EXPERT_TENSORS and ".experts." in f".{name}":
            groups.setdefault(prefix, []).append(leaf)
        elif t.kernel:
            raise ShimError(f"{path}: tensor {name} has layout {t.layout!r}; only the four "
                            f"routed-expert tensors may be in kernel layout", CONVERT_FORCE)
    if doc.expert_layout == "model":
        bad = sorted(n for n, t in entry.tensors.items() if t.kernel)
        if bad:
            raise ShimError(f"{path}: expert_layout is 'model' but {bad[0]} has layout "
                            f"{entry.tensors[bad[0]].layout!r}", CONVERT_FORCE)
        return {}
    for prefix, leaves in groups.items():
        if sorted(leaves) != sorted(EXPERT_TENSORS):
            raise ShimError(f"{path}: {prefix} has only {', '.join(sorted(leaves))} of "
                            f"{', '.join(EXPERT_TENSORS)}", CONVERT_FORCE)
    return {p: tuple(leaves) for p, leaves in groups.items()}


def check_expert_modules(doc: Manifest, groups: dict[str, tuple[str, ...]], moe: dict[str, MoeModule],
                         engine: Engine) -> None:
    """Kernel-layout experts: on the GPU family they were laid out for, each MoE module with the re-layout
    wrapper, the backend of the files and this rank's unflattened TP place."""
    if not groups:
        return
    if engine.arch is not None and engine.arch != doc.arch:
        raise ShimError(f"GPU capability {engine.capability} but files were laid out for {doc.arch} "
                        f"({doc.moe_variant}); re-convert with --arch {engine.arch} or --expert-layout model")
    for prefix in groups:
        module = moe.get(prefix)
        if module is None:  # no quant_method: nothing of vLLM's re-lays it out
            continue
        if engine.relayout_missing is not None:
            raise ShimError(f"{prefix}: experts arrive in kernel layout but the re-layout wrapper is not "
                            f"installed ({engine.relayout_missing}); use a supported vLLM build "
                            f"or convert with --expert-layout model")
        if module.backend != doc.moe_variant:
            raise ShimError(f"MoE backend resolved to {module.backend} on layer {prefix}; files require "
                            f"{doc.moe_variant} (--moe-backend {MOE_BACKEND}, unset VLLM_USE_B12X_MOE)")
        if module.parallel is not None and module.parallel != (engine.rank, engine.tp, 1):
            raise ShimError(f"{prefix}: MoE parallel (tp_rank, tp_size, ep_size)={module.parallel}, files need "
                            f"({engine.rank}, {engine.tp}, 1); disable DP/PCP/expert parallel")
