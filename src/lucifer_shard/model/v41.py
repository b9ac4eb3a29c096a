"""DeepSeek-V4.1-Flash (`model_type` deepseek_v41): recognised, sized for `plan`, not converted.

V4.1 is another model (docs/deepseek-v4.1.md): a nested `text_config`, hidden 5120, 384 experts, FP8 in
32x32 UE8M0 blocks, two Engram tables that vLLM keeps in host memory, a vision tower, a 128-expert
DSpark drafter. vLLM 0.34.0's `DeepseekV41ForCausalLM` asserts heads % TP == 0 and Engram's `wkv`
(25600 rows) does not divide by 3, so TP3 needs a plan this tool does not have yet. What `plan` shows is
an estimate of each rank's bytes under a V4-style virtual plan (the same padded axes as `plan.make_plan`),
family by family from the config: the routed experts exactly, the dense families by their shapes (the
compressors and indexer are left out), the Engram tables split by hash head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SourceError
from ..formats.schema import Int, ListOf, Null, Obj, SchemaError, Where, check
from .config import SIZE, V41_MODEL_TYPE as MODEL_TYPE
from .plan import HEADS_ALIGN, MAX_TP, ROUTED_ALIGN, SHARED_ALIGN, VOCAB_ALIGN, KERNEL_ALIGN, _virtual_axis, align_up

BLOCK = 32  # FP8 weight_block_size [32, 32] (V4: 128)
ENGRAM_HEADS_PER_TABLE = 24  # hash heads per Engram table (the rows are split by head, whole heads per rank)
DSPARK_STAGES = 3
FP4_BYTES = 17 / 32  # one packed E2M1 byte per 2 elements and one E8M0 scale per 32: bytes per element


def is_v41(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") == MODEL_TYPE


def _fp8(rows: int, cols: int) -> int:
    """An FP8 weight with its 32x32 UE8M0 block scales."""
    return rows * cols + -(-rows // BLOCK) * -(-cols // BLOCK)


@dataclass(frozen=True)
class RankBytes:
    tp: int
    gpu: dict[str, int]  # family -> bytes on each rank's GPU
    host: int  # Engram table bytes in host memory, the largest rank's

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())


def _divides(heads_groups: dict[str, Any]) -> str | None:
    h, g = heads_groups["num_attention_heads"], heads_groups["o_groups"]
    return None if h % g == 0 else f"num_attention_heads {h} does not divide into o_groups {g}"


# Every field the sizing reads, typed and bounded like V4's config.FIELD_TYPES (V4.1-Flash: hidden 5120,
# 384 experts, two Engram tables of ~3.8e8 rows): a field outside is a one-line refusal, never a
# negative size or a ZeroDivisionError.
TEXT_FIELDS = Where(Obj({
    "vocab_size": Int(1, 1 << 24), "hidden_size": SIZE, "moe_intermediate_size": SIZE,
    "num_hidden_layers": Int(1, 1024), "num_attention_heads": Int(1, 4096), "head_dim": Int(1, 1 << 16),
    "q_lora_rank": SIZE, "o_lora_rank": SIZE, "o_groups": Int(1, 4096), "n_routed_experts": Int(1, 1 << 16),
    "engram_num_embeddings": ListOf(Int(1, 1 << 40), max_len=64), "engram_head_dim": Int(1, 1 << 16),
    "hc_mult": Int(1, 64), "dspark_n_routed_experts": Int(1, 1 << 16), "dspark_markov_rank": SIZE,
}, optional={"n_shared_experts": Int(1, 64), "engram_layer_ids": ListOf(Int(0, 1023), max_len=1024)}), _divides)
VISION_FIELDS = Obj({}, optional={"num_hidden_layers": Int(0, 1024), "hidden_size": Int(0, 1 << 20),
                                  "intermediate_size": Int(0, 1 << 20)})
FIELDS = Obj({"text_config": TEXT_FIELDS}, optional={"vision_config": Null(VISION_FIELDS)})


def _text(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """`text_config`, once every field the sizing reads is typed and in range (FIELDS); SourceError otherwise."""
    try:
        check(FIELDS, raw)
    except SchemaError as e:
        raise SourceError(f"{where}: field {e}; a DeepSeek-V4.1 config's fields are as in its published config.json") \
            from None
    return raw["text_config"]


def rank_bytes(raw: dict[str, Any], tp: int, where: str = "config.json") -> RankBytes:
    """Each rank's bytes at `tp` under a V4-style virtual plan (an estimate: see the module docstring)."""
    t = _text(raw, where)
    h, layers, heads, hd = t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["head_dim"]
    axis = {"heads": _virtual_axis("heads", heads, tp, HEADS_ALIGN),
            "routed": _virtual_axis("routed", t["moe_intermediate_size"], tp, ROUTED_ALIGN, KERNEL_ALIGN),
            "shared": _virtual_axis("shared", t["moe_intermediate_size"] * t.get("n_shared_experts", 1), tp,
                                    SHARED_ALIGN)}
    local_heads, groups = axis["heads"].local, axis["heads"].local // (heads // t["o_groups"])
    routed, shared = axis["routed"].kernel_local, axis["shared"].local
    vocab = align_up(t["vocab_size"], VOCAB_ALIGN * tp) // tp
    stages = DSPARK_STAGES
    decoders = layers + stages
    attention = (_fp8(t["q_lora_rank"], h) + _fp8(hd, h) + _fp8(local_heads * hd, t["q_lora_rank"])
                 + _fp8(groups * t["o_lora_rank"], heads // t["o_groups"] * hd) + _fp8(h, groups * t["o_lora_rank"])
                 + 2 * (t["q_lora_rank"] + hd) + 4 * local_heads)
    mix, hc = (2 + t["hc_mult"]) * t["hc_mult"], t["hc_mult"] * h
    per_layer_small = 2 * 4 * (mix * hc + mix + 3) + 2 * 2 * h  # hc mixers (F32) and the two norms
    engram_wkv_rows = align_up(-(-5 * h // tp), BLOCK)  # wkv [5 * hidden, 24 * 256], split by rows
    engram_layers = len(t.get("engram_layer_ids", []))
    gpu = {
        "routed experts": (layers * t["n_routed_experts"] + stages * t["dspark_n_routed_experts"])
                          * int(3 * routed * h * FP4_BYTES),
        "shared experts": decoders * (2 * _fp8(shared, h) + _fp8(h, shared)),
        "attention": decoders * attention,
        "routers, mixers, norms": decoders * per_layer_small
                                  + (layers * t["n_routed_experts"] + stages * t["dspark_n_routed_experts"]) * (2 * h + 8),
        "embedding and LM head": 2 * vocab * h * 2,
        "Engram wkv": engram_layers * (_fp8(engram_wkv_rows, ENGRAM_HEADS_PER_TABLE * t["engram_head_dim"])
                                       + 2 * 4 * h * 2),
        "drafter heads": (_fp8(h, stages * h) + 2 * t["vocab_size"] * t["dspark_markov_rank"] * 2
                          + 4 * (h + t["dspark_markov_rank"]) + _fp8(stages * hd, h)),
        "vision tower": _vision(raw.get("vision_config") or {}),
    }
    heads_per_rank = -(-ENGRAM_HEADS_PER_TABLE // tp)
    row = t["engram_head_dim"] + t["engram_head_dim"] // BLOCK  # F8 row and its E8M0 scales
    host = sum(-(-rows * heads_per_rank // ENGRAM_HEADS_PER_TABLE) * row for rows in t["engram_num_embeddings"])
    return RankBytes(tp, gpu, host)


def _vision(v: dict[str, Any]) -> int:
    """The vision tower in BF16, replicated: per block q, k, v, o and a gated MLP (an estimate)."""
    n, d, inter = v.get("num_hidden_layers", 0), v.get("hidden_size", 0), v.get("intermediate_size", 0)
    return 2 * n * (4 * d * d + 3 * d * inter)


TP_SIZES = tuple(t for t in (1, 2, 3, 4, 8) if t <= MAX_TP)
