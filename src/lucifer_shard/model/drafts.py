"""The one table of draft kinds: what a checkpoint's `mtp.*` holds, and how stock vLLM serves it.

`plan`, the manifest's `draft` record, `serve`, `doctor` and the runtime shim's loader read it; the tensor
rules for each kind are in `rules.RULES` (scopes `MTP_ONLY` and `DSPARK_*`, placed by `rules.DRAFT_PLACES`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .config import DSPARK, MTP, ModelConfig


@dataclass(frozen=True)
class DraftKind:
    name: str
    label: str  # how plan, serve and doctor name it
    method: str  # vLLM's --speculative-config method
    vllm_class: str  # the draft class vLLM 0.34.0 builds for it
    # parameters of that class vLLM aliases from the target after loading: no file carries them
    runtime_owned: tuple[str, ...]
    runtime_owned_suffixes: tuple[str, ...] = ()


DRAFT_KINDS = {
    # vllm/models/deepseek_v4/nvidia/mtp.py: the embedding and each layer's shared head are the target's
    MTP: DraftKind(MTP, "MTP layer", "mtp", "DeepSeekV4MTP", ("model.embed_tokens.weight",),
                   ("shared_head.head.weight",)),
    # vllm/models/deepseek_v4/nvidia/dspark.py: has_own_embed_tokens / has_own_lm_head are False
    DSPARK: DraftKind(DSPARK, "DSpark drafter", "dspark", "DSparkDeepseekV4ForCausalLM",
                      ("model.embed_tokens.weight", "lm_head.weight")),
}


def draft_record(cfg: ModelConfig) -> dict:
    """The manifest's `draft`: the kind, its stage (layer) count and vLLM's default draft tokens per step."""
    return {"kind": cfg.draft_kind, "stages": cfg.num_mtp, "tokens": cfg.draft_tokens}


def speculative_config(kind: str, tokens: int) -> str:
    """vLLM's --speculative-config for OUT's own draft. Without a draft `model` vLLM drafts from the
    target's directory (OUT) with the target's load format, and the lucifer_tp3 loader picks OUT/draft
    for the draft model (`SpeculativeConfig`, vllm/config/speculative.py)."""
    return json.dumps({"method": DRAFT_KINDS[kind].method, "num_speculative_tokens": tokens}, separators=(",", ":"))


def owned_by_runtime(kind: str, names) -> set[str]:
    """Of the draft model's parameter `names`, those vLLM fills from the target (no rank file holds them)."""
    k = DRAFT_KINDS[kind]
    return {n for n in names if n in k.runtime_owned or (k.runtime_owned_suffixes and n.endswith(k.runtime_owned_suffixes))}
