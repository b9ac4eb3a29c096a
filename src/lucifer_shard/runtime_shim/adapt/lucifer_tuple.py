"""The Lucifer tuple against a vLLM config: how the model, the backends, the parallel layout and the GPU differ
from what the rank files need, read off the objects vLLM passes in (the fork's policy wrapper, stock virtual TP
and the loader ask). Imports vLLM only inside `device_arch`.
"""
from __future__ import annotations

import os

from lucifer_shard.errors import SourceError
from lucifer_shard.model.arches import arch_of_capability
from lucifer_shard.model.config import ModelConfig, parse_config
from lucifer_shard.model.runtimes import ATTENTION_BACKEND, MOE_BACKEND
from lucifer_shard.output.manifest_types import Manifest

from . import settings
from ..manifest import virtual_tp_needed
from .configview import backend_name, model_problems, text_config

# hf config keys the fork's virtual TP overwrites with the padded size, keeping `original_<key>`
VTP_PADDED_KEYS = ("num_attention_heads", "o_groups", "moe_intermediate_size")


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
    """The converter's view (`lucifer_shard.model.config.parse_config`) of vLLM's hf config, with any
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


def b12x_moe_env() -> str | None:
    v = os.environ.get("VLLM_USE_B12X_MOE")
    return v if v is not None and v.strip().lower() not in ("", "0", "false", "no", "off") else None
