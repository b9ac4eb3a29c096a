"""The narrow wrappers around vLLM, installed only on the builds `compat.SUPPORTED_BUILDS` vets each for.

The fork builds get (a) and (b); stock releases get the two of `stock_vtp` (virtual TP supplied by
the plugin). `compat.WRAPPERS` says what each replaces, why, in which process, and when it can go.

(a) virtual-TP policy: wraps `vllm.config.virtual_tp.maybe_apply_b12x_virtual_tp_padding`. With
    `--load-format lucifer_tp3` it accepts exactly the Lucifer tuple, builds the plan with the
    fork's own `apply_b12x_virtual_tp_padding_to_model_config` (no B12X backend gate) and checks
    the plan equals the manifest's. With any other load format the Lucifer tuple is refused (the
    stock MXFP4 loader mis-slices W2); everything else goes to the original unchanged.
(b) expert re-layout: wraps the name `convert_weight_to_mxfp4_moe_kernel_format` that
    `Mxfp4MoEMethod._setup_kernel` looks up at call time (the forks and stock 0.33.0). For layers the
    loader tagged (experts already in kernel layout) it is the identity: the same storage comes back,
    viewed in the kernel's shape (SM90's folded scales are 5-D, held in the 3-D parameter whose shape
    `_setup_kernel` checks); it refuses a tagged layer whose resolved backend is not the manifest's
    variant. Untagged layers go to the original.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import dataclass, field

from lucifer_shard.errors import SourceError
from lucifer_shard.spec.config import ModelConfig, parse_config
from lucifer_shard.spec.layouts import EXPERT_TENSORS
from lucifer_shard.spec.manifest import RUNTIME
from lucifer_shard.spec.arches import arch_of_capability

from . import compat, settings, stock_vtp
from .configview import backend_name, model_problems, text_config
from .errors import ShimError, ShimRuntimeError
from .manifest import compare_plan, load_manifest, virtual_tp_needed

logger = logging.getLogger("lucifer_shard.runtime_shim")

LOAD_FORMAT = RUNTIME["load_format"]
ATTENTION_BACKEND = RUNTIME["attention_backend"]
MOE_BACKEND = RUNTIME["moe_backend"]
# hf config keys the fork's virtual TP overwrites with the padded size, keeping `original_<key>`
VTP_PADDED_KEYS = ("num_attention_heads", "o_groups", "moe_intermediate_size")
TAG_ATTR = "_lucifer_tp3_tag"

# wrapper name -> WrapperVerdict of the last install attempt in this process
VERDICTS: dict[str, compat.WrapperVerdict] = {}


@dataclass
class ExpertTag:
    """Marks a RoutedExperts module whose four expert tensors were loaded in kernel layout."""

    prefix: str
    moe_variant: str
    layout: dict[str, str]
    data_ptrs: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the files' (kernel) shapes
    relayout_calls: int = 0


def installed(wrapper: str) -> bool:
    v = VERDICTS.get(wrapper)
    return bool(v and v.ok)


def why_not_installed(wrapper: str) -> str:
    v = VERDICTS.get(wrapper)
    if v is None:
        return "the shim's register() has not run in this process (plugin not loaded?)"
    return v.reason


# ------------------------------------------------------------------------- the Lucifer tuple


def device_arch() -> tuple[str | None, str]:
    """(arch, 'major.minor') of the current GPU as vLLM sees it; (None, reason) without one."""
    try:
        from vllm.platforms import current_platform

        cap = current_platform.get_device_capability()
    except Exception as e:  # noqa: BLE001 - any failure means "no usable GPU"
        return None, f"unknown ({e.__class__.__name__})"
    if cap is None:
        return None, "none (no GPU visible)"
    major, minor = int(cap[0]), int(cap[1])
    return arch_of_capability(major, minor), f"{major}.{minor}"


def runtime_plan(model_config) -> dict | None:
    """vLLM's live virtual-TP plan (`hf_text_config.vllm_virtual_tp_plan`), None without one."""
    return getattr(text_config(model_config), "vllm_virtual_tp_plan", None)


def model_dir(model_config) -> str:
    return getattr(model_config, "model_weights", None) or model_config.model


def _model_problems(vllm_config) -> list[str]:
    """How the model and the two backends differ from the Lucifer tuple (empty = they are the tuple)."""
    problems = model_problems(vllm_config)
    attn = backend_name(getattr(getattr(vllm_config, "attention_config", None), "backend", None))
    if attn != ATTENTION_BACKEND:
        problems.append(f"attention backend {attn} (pass --attention-backend {ATTENTION_BACKEND})")
    moe = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", None)
    if moe != MOE_BACKEND:
        problems.append(f"MoE backend {moe!r} (pass --moe-backend {MOE_BACKEND}, unset VLLM_USE_B12X_MOE)")
    return problems


def parallel_problems(vllm_config, manifest=None) -> list[str]:
    """Each way the parallel layout and features differ from what per-TP-rank files need (empty: fine)."""
    pc = vllm_config.parallel_config
    problems = settings.config_problems(vllm_config)
    if manifest is not None:
        tp = int(pc.tensor_parallel_size)
        if tp != manifest.tp_size:
            problems.append(f"tensor_parallel_size {tp} (files were built for {manifest.tp_size}: start with "
                            f"-tp {manifest.tp_size} or rebuild with lucifer-shard convert --tp {tp})")
    return problems


def tuple_problems(vllm_config, manifest=None) -> list[str]:
    """Each way `vllm_config` differs from the Lucifer tuple (empty = it is the tuple)."""
    problems = _model_problems(vllm_config) + parallel_problems(vllm_config, manifest)
    if manifest is not None:
        arch, cap = device_arch()
        if manifest.arch is not None and arch != manifest.arch:  # null: model layout, any GPU family
            problems.append(f"GPU capability {cap} (files were laid out for {manifest.arch}, {manifest.moe_variant}; "
                            f"re-convert with --arch {arch or '<this GPU>'})")
    return problems


def source_config(model_config) -> ModelConfig | None:
    """The converter's view (`lucifer_shard.spec.config.parse_config`) of vLLM's hf config, with any
    virtual-TP padding the fork applied undone; None when it is not a config lucifer-shard converts."""
    text = text_config(model_config)
    to_dict = getattr(text, "to_dict", None)
    raw = dict(to_dict() if callable(to_dict) else vars(text))
    for key in VTP_PADDED_KEYS:
        if raw.get(f"original_{key}") is not None:
            raw[key] = raw[f"original_{key}"]
    try:
        return parse_config(raw, "vLLM's model config")
    except SourceError:
        return None


def is_lucifer_request(vllm_config) -> bool:
    """DeepSeek-V4 fp4 + the two Lucifer backends at a TP size that needs virtual padding."""
    mc = vllm_config.model_config
    if mc is None or _model_problems(vllm_config):
        return False
    cfg = source_config(mc)
    return cfg is not None and virtual_tp_needed(cfg, int(vllm_config.parallel_config.tensor_parallel_size))


def _load_format(vllm_config) -> str:
    lc = getattr(vllm_config, "load_config", None)
    return str(getattr(lc, "load_format", "auto") or "auto").lower()


# ------------------------------------------------------------------------ (a) policy wrapper


def make_policy_wrapper(original, apply_to_model_config):
    def maybe_apply_b12x_virtual_tp_padding(vllm_config):
        mc = getattr(vllm_config, "model_config", None)
        if mc is None:
            return original(vllm_config)
        lf = _load_format(vllm_config)
        if lf != LOAD_FORMAT:
            if is_lucifer_request(vllm_config):
                raise ShimError(
                    f"DeepSeek-V4 at tensor_parallel_size {vllm_config.parallel_config.tensor_parallel_size} with "
                    f"{ATTENTION_BACKEND} + {MOE_BACKEND} needs virtual TP, which is only supported with "
                    f"--load-format {LOAD_FORMAT} (found --load-format {lf}; the stock MXFP4 loader mis-slices W2); "
                    f"convert with lucifer-shard convert and start with lucifer-shard serve OUT")
            return original(vllm_config)
        manifest = load_manifest(model_dir(mc))
        problems = tuple_problems(vllm_config, manifest)
        if problems:
            raise ShimError(f"--load-format {LOAD_FORMAT} serves only the Lucifer tuple; found " + "; ".join(problems))
        apply_to_model_config(mc, vllm_config.parallel_config)
        diff = compare_plan(runtime_plan(mc), manifest.plan)
        if diff:
            raise ShimError(f"{diff}; check B12X_MOE_FORCE_A8 / NVFP4 env and that {manifest.out} was converted for "
                            f"this model with --tp {manifest.tp_size}")
        logger.info("lucifer_tp3: virtual-TP plan applied and equal to %s", manifest.path)

    maybe_apply_b12x_virtual_tp_padding.__lucifer_wrapped__ = original
    maybe_apply_b12x_virtual_tp_padding.__wrapped__ = original
    return maybe_apply_b12x_virtual_tp_padding


# ---------------------------------------------------------------------- (b) relayout wrapper


def make_relayout_wrapper(original):
    sig = inspect.signature(original)

    def convert_weight_to_mxfp4_moe_kernel_format(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        layer = bound.arguments.get("layer")
        tag: ExpertTag | None = getattr(layer, TAG_ATTR, None)
        if tag is None:
            return original(*args, **kwargs)
        backend = backend_name(bound.arguments.get("mxfp4_backend"))
        if backend != tag.moe_variant:
            raise ShimError(f"MoE backend resolved to {backend} on layer {tag.prefix}; files require "
                            f"{tag.moe_variant} (--moe-backend {MOE_BACKEND}, unset VLLM_USE_B12X_MOE)")
        a = bound.arguments
        for name in EXPERT_TENSORS:
            t = a.get(name)
            want = tag.data_ptrs.get(name)
            if want is not None and (t is None or t.data_ptr() != want):
                raise ShimRuntimeError(f"expert tensor {tag.prefix}.{name} reached the re-layout step with other "
                                       f"storage than the loader filled; vLLM's post-load path changed, this build "
                                       f"is not supported")
        tag.relayout_calls += 1
        kernel = {name: a[name].data.view(tag.shapes.get(name, a[name].shape)) for name in EXPERT_TENSORS}
        logger.debug("lucifer_tp3: %s: experts loaded in kernel layout, re-layout skipped", tag.prefix)
        return (kernel["w13_weight"], kernel["w2_weight"], kernel["w13_weight_scale"], kernel["w2_weight_scale"],
                a.get("w13_bias"), a.get("w2_bias"))

    convert_weight_to_mxfp4_moe_kernel_format.__lucifer_wrapped__ = original
    convert_weight_to_mxfp4_moe_kernel_format.__wrapped__ = original
    return convert_weight_to_mxfp4_moe_kernel_format


# ---------------------------------------------------------------------------------- install


def install(builds=None) -> dict[str, compat.WrapperVerdict]:
    """Install each wrapper of `compat.WRAPPERS` whose symbols match a build vetted for it; idempotent;
    never raises."""
    builds = compat.SUPPORTED_BUILDS if builds is None else builds
    for wrapper in compat.WRAPPERS:
        try:
            verdict = compat.judge_wrapper(wrapper, builds)
            if verdict.ok:
                INSTALLERS[wrapper]()
            VERDICTS[wrapper] = verdict
        except Exception as e:  # noqa: BLE001 - register() must never raise
            VERDICTS[wrapper] = compat.WrapperVerdict(wrapper, False, None, (), f"install failed: {e!r}")
        v = VERDICTS[wrapper]
        if v.ok:
            logger.debug("lucifer_tp3: %s wrapper installed (build %s)", wrapper, v.build.commit)
        else:
            logger.debug("lucifer_tp3: %s wrapper not installed: %s", wrapper, v.reason)
    return dict(VERDICTS)


def _replace(symbol_key: str, make) -> None:
    """Put `make(original)` where the symbol lives (a module function or a class attribute), once."""
    sym = compat.SYMBOLS[symbol_key]
    owner = importlib.import_module(sym.module)
    *path, name = sym.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    current = getattr(owner, name)
    if getattr(current, "__lucifer_wrapped__", None) is not None:
        return
    setattr(owner, name, make(current))


def _install_policy() -> None:
    mod = importlib.import_module("vllm.config.virtual_tp")
    _replace("maybe_apply_b12x_virtual_tp_padding",
             lambda current: make_policy_wrapper(current, mod.apply_b12x_virtual_tp_padding_to_model_config))


def _install_relayout() -> None:
    mod = importlib.import_module(compat.RELAYOUT_PATCH_MODULE)
    current = getattr(mod, compat.RELAYOUT_PATCH_ATTR)
    if getattr(current, "__lucifer_wrapped__", None) is not None:
        return
    oracle = compat.unwrap(compat.resolve(compat.SYMBOLS["convert_weight_to_mxfp4_moe_kernel_format"]))
    if compat.unwrap(current) is not oracle:
        raise RuntimeError(f"{compat.RELAYOUT_PATCH_MODULE}.{compat.RELAYOUT_PATCH_ATTR} is not the oracle function")
    setattr(mod, compat.RELAYOUT_PATCH_ATTR, make_relayout_wrapper(current))


INSTALLERS = {
    compat.POLICY: _install_policy,
    compat.RELAYOUT: _install_relayout,
    compat.STOCK_CONFIG: lambda: _replace("EngineArgs.create_engine_config", stock_vtp.make_engine_config_wrapper),
    compat.STOCK_VOCAB: lambda: _replace("VocabParallelEmbedding.__init__", stock_vtp.make_vocab_wrapper),
}


def plan_difference(model_config, manifest) -> str | None:
    """How the live model config's virtual-TP geometry differs from the manifest's plan (None: equal):
    the fork's `vllm_virtual_tp_plan`, or on stock vLLM the padding the plugin applied."""
    fork_plan = runtime_plan(model_config)
    if fork_plan is None and (stock_vtp.applied(model_config) is not None or installed(compat.STOCK_CONFIG)):
        return stock_vtp.geometry_problem(model_config, manifest)
    return compare_plan(fork_plan, manifest.plan)


def virtual_tp_missing() -> str | None:
    """Why this vLLM gets no virtual TP, neither the fork's (policy wrapper) nor the plugin's (the stock
    wrappers); None when it has one."""
    if installed(compat.POLICY) or all(installed(w) for w in compat.STOCK_WRAPPERS):
        return None
    return next(why_not_installed(w) for w in compat.STOCK_WRAPPERS if not installed(w))


def b12x_moe_env() -> str | None:
    v = os.environ.get("VLLM_USE_B12X_MOE")
    return v if v is not None and v.strip().lower() not in ("", "0", "false", "no", "off") else None
