"""What the shim's wrappers (runtime_shim/wrappers/) and its loader share: the Lucifer tuple and how a
vLLM config differs from it, the tag the loader leaves on experts it filled in kernel layout, and the
verdicts of the last `wrappers.install()` in this process (which wrappers are in place, and why not).
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from lucifer_shard.errors import SourceError
from lucifer_shard.spec.config import ModelConfig, parse_config
from lucifer_shard.spec.manifest import RUNTIME
from lucifer_shard.spec.manifest_types import Manifest
from lucifer_shard.spec.arches import arch_of_capability

from . import compat, settings, stock_vtp
from .configview import backend_name, model_problems, text_config
from .manifest import compare_plan, virtual_tp_needed

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
    problems = settings.config_problems(vllm_config)
    if manifest is not None and (mismatch := tp_mismatch(manifest, vllm_config.parallel_config.tensor_parallel_size)):
        problems.append(mismatch)
    return problems


def tp_mismatch(manifest: Manifest, tp: int) -> str | None:
    """How a TP size differs from the one the rank files were built for (None: it is that one)."""
    tp = int(tp)
    if tp == manifest.tp_size:
        return None
    return (f"tensor_parallel_size {tp}, but the files were built for {manifest.tp_size}: start with "
            f"-tp {manifest.tp_size} or rebuild with lucifer-shard convert --tp {tp}")


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


def load_format(vllm_config) -> str:
    lc = getattr(vllm_config, "load_config", None)
    return str(getattr(lc, "load_format", "auto") or "auto").lower()


def replace(symbol: compat.Symbol, make) -> None:
    """Put `make(original)` where the symbol lives (a module function or a class attribute), once."""
    owner = importlib.import_module(symbol.module)
    *path, name = symbol.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    current = getattr(owner, name)
    if getattr(current, "__lucifer_wrapped__", None) is not None:
        return
    setattr(owner, name, make(current))


def plan_difference(model_config, out: Path, manifest: Manifest) -> str | None:
    """How the live model config's virtual-TP geometry differs from the manifest's plan (None: equal):
    the fork's `vllm_virtual_tp_plan`, or on stock vLLM the padding the plugin applied."""
    fork_plan = runtime_plan(model_config)
    if fork_plan is None and (stock_vtp.applied(model_config) is not None or installed(compat.STOCK_CONFIG)):
        return stock_vtp.geometry_problem(model_config, out, manifest)
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
