"""Reading vLLM's config objects, for the fork's policy (wrappers/policy.py) and stock virtual TP (stock_vtp.py)
alike. Imports nothing from vLLM: it reads attributes of the objects vLLM passes in."""
from __future__ import annotations

from lucifer_shard.model.config import MODEL_TYPE


def text_config(model_config):
    """The hf config the layers are sized from (`hf_text_config`, else `hf_config`)."""
    return getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)


def backend_name(value) -> str | None:
    """An attention/MoE backend enum member or string as its name; None for none."""
    return None if value is None else str(getattr(value, "name", value))


def model_problems(vllm_config) -> list[str]:
    """How the model differs from what the rank files hold (DeepSeek-V4, fp4 experts); empty: it is."""
    mc = vllm_config.model_config
    text = text_config(mc)
    problems = []
    model_type = getattr(getattr(mc, "hf_config", None), "model_type", None)
    if model_type != MODEL_TYPE and getattr(text, "model_type", None) != MODEL_TYPE:
        problems.append(f"model_type {model_type!r} (files require {MODEL_TYPE!r})")
    expert_dtype = getattr(text, "expert_dtype", "fp4")
    if expert_dtype != "fp4":
        problems.append(f"expert_dtype {expert_dtype!r} (files require 'fp4')")
    return problems
