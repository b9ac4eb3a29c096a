"""The one table of tensor rules: every checkpoint tensor of the V4-Flash schema is one row of `RULES`.

A row gives its key (relative to its scope), its shape and dtype as functions of the config, the vLLM
parameter it becomes, how it is partitioned (which source dim follows which plan axis, how many tensor
elements one axis index spans, and the storage unit along that dim), its fused segment, dtype rule and
pad value. Where each scope's rows go in a draft model is `DRAFT_PLACES`, one row per draft kind, and
which layers a row applies to is `WHEN`: a new tensor, a new predicate or a new draft kind is rows here.
Data only: `tensorspecs` expands the table into the schema's expected tensors and per-rank tensor
specs, which `plan`, `convert`, `diff`, `verify`, the numerics check and the runtime shim all read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import DSPARK, FP8_BLOCK, MTP, MXFP4_GROUP, ModelConfig
from .plan import stock_padded

# Storage units along a sharded dim, in logical elements per stored index.
ELEM = 1  # unpacked elements (BF16/F32/FP8 weights, rows of packed MXFP4 tensors)
FP4_BYTE = 2  # packed MXFP4 along K: two E2M1 codes per byte
E8M0_GROUP = MXFP4_GROUP  # MXFP4 E8M0 scales along K: one byte per 32 elements
FP8_BLOCK_SCALE = FP8_BLOCK  # FP8 block scales: one per 128x128 block

# Safetensors dtype tags and their sizes.
NEG_INF_F32 = b"\x00\x00\x80\xff"

# Layer predicates (CONFIDENCE: the config asks for DSpark's confidence head).
ALL, HASH, BIAS, C4, C128, COMPRESSED, CONFIDENCE = "all", "hash", "bias", "c4", "c128", "compressed", "confidence"
# Scopes: where the key lives and where its parameter goes. MTP_ONLY: each MTP layer's own tensors; the DSpark
# drafter's model-level tensors live in its first stage (DSPARK_FIRST), its last (DSPARK_LAST), or are every
# stage's tensor stacked into one parameter (DSPARK_STACK).
GLOBAL, LAYER, EXPERT, MTP_ONLY = "global", "layer", "expert", "mtp"
DSPARK_FIRST, DSPARK_LAST, DSPARK_STACK = "dspark-first", "dspark-last", "dspark-stack"
# The stages of a draft that hold a scope's instance.
EVERY, FIRST, LAST = "every", "first", "last"


@dataclass(frozen=True)
class Place:
    """Where a scope's rows have instances in a draft model: in which stages, under which vLLM parameter
    prefix (`{i}` the layer index, `{j}` the stage), and whether an instance is its stage's layer (the
    layer predicates and compress ratio apply) or the draft model's own."""

    stages: str
    prefix: str
    layered: bool = True


# Per draft kind, the scopes it has and where each goes in vLLM's draft model. LAYER and EXPERT are the decoder
# block every stage repeats: DeepSeekV4MTP nests it under the layer (vllm/models/deepseek_v4/nvidia/mtp.py);
# DSparkDeepseekV4ForCausalLM keeps its stages in `model.layers` from 0 (`_remap_dspark_name` in
# vllm/models/deepseek_v4/nvidia/dspark.py).
_MTP_BLOCK, _DSPARK_BLOCK = Place(EVERY, "model.layers.{i}.mtp_block."), Place(EVERY, "model.layers.{j}.")
DRAFT_PLACES = {
    MTP: {LAYER: _MTP_BLOCK, EXPERT: _MTP_BLOCK, MTP_ONLY: Place(EVERY, "model.layers.{i}.")},
    DSPARK: {LAYER: _DSPARK_BLOCK, EXPERT: _DSPARK_BLOCK, DSPARK_FIRST: Place(FIRST, "model.", layered=False),
             DSPARK_LAST: Place(LAST, "model.", layered=False), DSPARK_STACK: Place(EVERY, "model.", layered=False)},
}


def _layer(test: Callable[[ModelConfig, int], bool]) -> Callable[[ModelConfig, int | None], bool]:
    """A predicate on the layer: never true of a model-level instance (layer None)."""
    return lambda c, i: i is not None and test(c, i)


# Whether a row has an instance in layer `i` (None: a model-level instance).
WHEN: dict[str, Callable[[ModelConfig, int | None], bool]] = {
    ALL: lambda c, i: True,
    CONFIDENCE: lambda c, i: c.confidence_head,
    HASH: _layer(lambda c, i: i < c.num_hash_layers),
    BIAS: _layer(lambda c, i: i >= c.num_hash_layers),
    C4: _layer(lambda c, i: c.compress_ratio(i) == 4),
    C128: _layer(lambda c, i: c.compress_ratio(i) == 128),
    COMPRESSED: _layer(lambda c, i: c.compress_ratio(i) in (4, 128)),
}

ShapeOf = Callable[[ModelConfig, int], tuple[int, ...]]


@dataclass(frozen=True)
class Rule:
    key: str  # checkpoint key relative to the scope prefix; `{e}` is the expert index
    target: str  # vLLM parameter name relative to the scope prefix
    shape: ShapeOf  # source shape from (config, compress ratio)
    dtype: str  # source safetensors dtype
    scope: str = LAYER
    when: str = ALL
    axis: str | None = None  # plan axis the sharded dim follows; None = replicated
    dim: int = 0  # sharded dim of the (per-expert) source tensor
    per_index: Callable[[ModelConfig], int] = lambda c: 1  # tensor elements per axis index
    unit: int = ELEM  # logical elements per stored index along `dim`
    segment: int = 0  # position in a fused target
    out_dtype: str | None = None  # None = same as source; U8 = byte view; I32/F32: exact (formats/dtypes.CONVERSIONS)
    pad: bytes = b"\x00"
    expert_tensor: str | None = None  # w13_weight / w13_weight_scale / w2_weight / w2_weight_scale
    padded: Callable[[ModelConfig], int] | None = None  # replicated, zero tail to this length along `dim`
    alias: bool = False  # reads a key another rule owns (a second parameter made of the same bytes)


def _fp8(key: str, target: str, shape: ShapeOf, **kw) -> list[Rule]:
    """An FP8 block-quantized linear: E4M3 weight and E8M0 block scale, partitioned alike."""
    def scale_shape(c: ModelConfig, r: int) -> tuple[int, ...]:
        rows, cols = shape(c, r)
        return (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))

    return [
        Rule(f"{key}.weight", f"{target}.weight", shape, "F8_E4M3", **kw),
        Rule(f"{key}.scale", f"{target}.weight_scale_inv", scale_shape, "F8_E8M0",
             **({"unit": FP8_BLOCK_SCALE} if kw.get("axis") else {}), **kw),
    ]


def _coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


H = lambda c, r: (c.hidden_size,)  # noqa: E731
HEAD_DIM = lambda c: c.head_dim  # noqa: E731
O_LORA = lambda c: c.o_lora_rank  # noqa: E731

RULES: tuple[Rule, ...] = tuple([
    # --- global
    Rule("embed.weight", "model.embed_tokens.weight", lambda c, r: (c.vocab_size, c.hidden_size), "BF16",
         scope=GLOBAL, axis="vocab"),
    Rule("head.weight", "lm_head.weight", lambda c, r: (c.vocab_size, c.hidden_size), "BF16",
         scope=GLOBAL, axis="vocab"),
    Rule("norm.weight", "model.norm.weight", H, "BF16", scope=GLOBAL),
    Rule("hc_head_fn", "model.hc_head_fn", lambda c, r: (c.hc_mult, c.hc_dim), "F32", scope=GLOBAL),
    Rule("hc_head_base", "model.hc_head_base", lambda c, r: (c.hc_mult,), "F32", scope=GLOBAL),
    Rule("hc_head_scale", "model.hc_head_scale", lambda c, r: (1,), "F32", scope=GLOBAL),
    # --- every decoder layer (main and MTP block)
    Rule("attn_norm.weight", "attn_norm.weight", H, "BF16"),
    Rule("ffn_norm.weight", "ffn_norm.weight", H, "BF16"),
    *[Rule(f"hc_{p}_fn", f"hc_{p}_fn", lambda c, r: (c.mix_hc, c.hc_dim), "F32") for p in ("attn", "ffn")],
    *[Rule(f"hc_{p}_base", f"hc_{p}_base", lambda c, r: (c.mix_hc,), "F32") for p in ("attn", "ffn")],
    *[Rule(f"hc_{p}_scale", f"hc_{p}_scale", lambda c, r: (3,), "F32") for p in ("attn", "ffn")],
    Rule("attn.attn_sink", "attn.attn_sink", lambda c, r: (c.num_heads,), "F32", axis="heads", pad=NEG_INF_F32),
    *_fp8("attn.wq_a", "attn.fused_wqa_wkv", lambda c, r: (c.q_lora_rank, c.hidden_size), segment=0),
    *_fp8("attn.wkv", "attn.fused_wqa_wkv", lambda c, r: (c.head_dim, c.hidden_size), segment=1),
    Rule("attn.q_norm.weight", "attn.q_norm.weight", lambda c, r: (c.q_lora_rank,), "BF16"),
    Rule("attn.kv_norm.weight", "attn.kv_norm.weight", lambda c, r: (c.head_dim,), "BF16"),
    *_fp8("attn.wq_b", "attn.wq_b", lambda c, r: (c.num_heads * c.head_dim, c.q_lora_rank),
          axis="heads", per_index=HEAD_DIM),
    *_fp8("attn.wo_a", "attn.wo_a",
          lambda c, r: (c.o_groups * c.o_lora_rank, c.num_heads // c.o_groups * c.head_dim),
          axis="groups", per_index=O_LORA),
    *_fp8("attn.wo_b", "attn.wo_b", lambda c, r: (c.hidden_size, c.o_groups * c.o_lora_rank),
          axis="groups", dim=1, per_index=O_LORA),
    # compressor (C4 and C128) and indexer (C4)
    Rule("attn.compressor.wkv.weight", "attn.compressor.fused_wkv_wgate.weight",
         lambda c, r: (_coff(r) * c.head_dim, c.hidden_size), "BF16", when=COMPRESSED, segment=0),
    Rule("attn.compressor.wgate.weight", "attn.compressor.fused_wkv_wgate.weight",
         lambda c, r: (_coff(r) * c.head_dim, c.hidden_size), "BF16", when=COMPRESSED, segment=1),
    Rule("attn.compressor.ape", "attn.compressor.ape", lambda c, r: (r, _coff(r) * c.head_dim), "F32",
         when=COMPRESSED),
    Rule("attn.compressor.norm.weight", "attn.compressor.norm.weight", lambda c, r: (c.head_dim,), "BF16",
         when=COMPRESSED),
    *_fp8("attn.indexer.wq_b", "attn.indexer.wq_b",
          lambda c, r: (c.index_n_heads * c.index_head_dim, c.q_lora_rank), when=C4),
    Rule("attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.weight",
         lambda c, r: (c.index_n_heads, c.hidden_size), "BF16", when=C4),
    Rule("attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.fused_wkv_wgate.weight",
         lambda c, r: (_coff(r) * c.index_head_dim, c.hidden_size), "BF16", when=C4, segment=0),
    Rule("attn.indexer.compressor.wgate.weight", "attn.indexer.compressor.fused_wkv_wgate.weight",
         lambda c, r: (_coff(r) * c.index_head_dim, c.hidden_size), "BF16", when=C4, segment=1),
    Rule("attn.indexer.compressor.ape", "attn.indexer.compressor.ape",
         lambda c, r: (r, _coff(r) * c.index_head_dim), "F32", when=C4),
    Rule("attn.indexer.compressor.norm.weight", "attn.indexer.compressor.norm.weight",
         lambda c, r: (c.index_head_dim,), "BF16", when=C4),
    # router
    Rule("ffn.gate.weight", "ffn.gate.weight", lambda c, r: (c.n_experts, c.hidden_size), "BF16"),
    Rule("ffn.gate.tid2eid", "ffn.gate.tid2eid", lambda c, r: (c.vocab_size, c.top_k), "I64", when=HASH,
         out_dtype="I32"),
    Rule("ffn.gate.bias", "ffn.gate.e_score_correction_bias", lambda c, r: (c.n_experts,), "F32", when=BIAS),
    # shared expert (FP8, column w1|w3 fused, row w2)
    *_fp8("ffn.shared_experts.w1", "ffn.shared_experts.gate_up_proj",
          lambda c, r: (c.shared_intermediate, c.hidden_size), axis="shared", segment=0),
    *_fp8("ffn.shared_experts.w3", "ffn.shared_experts.gate_up_proj",
          lambda c, r: (c.shared_intermediate, c.hidden_size), axis="shared", segment=1),
    *_fp8("ffn.shared_experts.w2", "ffn.shared_experts.down_proj",
          lambda c, r: (c.hidden_size, c.shared_intermediate), axis="shared", dim=1),
    # routed experts (MXFP4): stacked [E, ...] per rank, vLLM dtype uint8 for weights and scales
    Rule("ffn.experts.{e}.w1.weight", "ffn.experts.routed_experts.w13_weight",
         lambda c, r: (c.moe_intermediate, c.hidden_size // FP4_BYTE), "I8", scope=EXPERT,
         axis="routed", segment=0, out_dtype="U8", expert_tensor="w13_weight"),
    Rule("ffn.experts.{e}.w3.weight", "ffn.experts.routed_experts.w13_weight",
         lambda c, r: (c.moe_intermediate, c.hidden_size // FP4_BYTE), "I8", scope=EXPERT,
         axis="routed", segment=1, out_dtype="U8", expert_tensor="w13_weight"),
    Rule("ffn.experts.{e}.w1.scale", "ffn.experts.routed_experts.w13_weight_scale",
         lambda c, r: (c.moe_intermediate, c.hidden_size // E8M0_GROUP), "F8_E8M0", scope=EXPERT,
         axis="routed", segment=0, out_dtype="U8", expert_tensor="w13_weight_scale"),
    Rule("ffn.experts.{e}.w3.scale", "ffn.experts.routed_experts.w13_weight_scale",
         lambda c, r: (c.moe_intermediate, c.hidden_size // E8M0_GROUP), "F8_E8M0", scope=EXPERT,
         axis="routed", segment=1, out_dtype="U8", expert_tensor="w13_weight_scale"),
    Rule("ffn.experts.{e}.w2.weight", "ffn.experts.routed_experts.w2_weight",
         lambda c, r: (c.hidden_size, c.moe_intermediate // FP4_BYTE), "I8", scope=EXPERT,
         axis="routed", dim=1, unit=FP4_BYTE, out_dtype="U8", expert_tensor="w2_weight"),
    Rule("ffn.experts.{e}.w2.scale", "ffn.experts.routed_experts.w2_weight_scale",
         lambda c, r: (c.hidden_size, c.moe_intermediate // E8M0_GROUP), "F8_E8M0", scope=EXPERT,
         axis="routed", dim=1, unit=E8M0_GROUP, out_dtype="U8", expert_tensor="w2_weight_scale"),
    # MTP-only tensors, kept at layer level in vLLM (not under mtp_block)
    *_fp8("e_proj", "e_proj", lambda c, r: (c.hidden_size, c.hidden_size), scope=MTP_ONLY),
    *_fp8("h_proj", "h_proj", lambda c, r: (c.hidden_size, c.hidden_size), scope=MTP_ONLY),
    Rule("enorm.weight", "enorm.weight", H, "BF16", scope=MTP_ONLY),
    Rule("hnorm.weight", "hnorm.weight", H, "BF16", scope=MTP_ONLY),
    Rule("norm.weight", "shared_head.norm.weight", H, "BF16", scope=MTP_ONLY),
    Rule("hc_head_fn", "hc_head_fn", lambda c, r: (c.hc_mult, c.hc_dim), "F32", scope=MTP_ONLY),
    Rule("hc_head_base", "hc_head_base", lambda c, r: (c.hc_mult,), "F32", scope=MTP_ONLY),
    Rule("hc_head_scale", "hc_head_scale", lambda c, r: (1,), "F32", scope=MTP_ONLY),
    # DSpark drafter (DeepSeek-V4-Flash-0731): model-level tensors of DSparkDeepseekV4Model
    # (vllm/models/deepseek_v4/nvidia/dspark.py). main_proj reads the tapped target layers' hidden states.
    *_fp8("main_proj", "main_proj", lambda c, r: (c.hidden_size, len(c.dspark_target_layers) * c.hidden_size),
          scope=DSPARK_FIRST),
    Rule("main_norm.weight", "main_norm.weight", H, "BF16", scope=DSPARK_FIRST),
    # every stage's wkv again, stacked: the cross-layer context projection (`_duplicate_context_wkv_weights`)
    *_fp8("attn.wkv", "context_wkv_proj", lambda c, r: (c.head_dim, c.hidden_size), scope=DSPARK_STACK,
          alias=True),
    Rule("norm.weight", "norm.weight", H, "BF16", scope=DSPARK_LAST),
    Rule("hc_head_fn", "hc_head_fn", lambda c, r: (c.hc_mult, c.hc_dim), "F32", scope=DSPARK_LAST),
    Rule("hc_head_base", "hc_head_base", lambda c, r: (c.hc_mult,), "F32", scope=DSPARK_LAST),
    Rule("hc_head_scale", "hc_head_scale", lambda c, r: (1,), "F32", scope=DSPARK_LAST),
    # the Markov head, replicated (DSparkMarkovHead in vllm/model_executor/models/qwen3_dspark.py): w1 an
    # nn.Embedding, w2 a ParallelLMHead(disable_tp) whose rows vLLM pads to 64 only, never to the TP multiple
    Rule("markov_head.markov_w1.weight", "markov_head.markov_w1.weight",
         lambda c, r: (c.vocab_size, c.dspark_markov_rank), "BF16", scope=DSPARK_LAST),
    Rule("markov_head.markov_w2.weight", "markov_head.markov_w2.weight",
         lambda c, r: (c.vocab_size, c.dspark_markov_rank), "BF16", scope=DSPARK_LAST,
         padded=lambda c: stock_padded("vocab", c.vocab_size)),
    # vLLM's parameter is F32 (DSparkConfidenceHead: params_dtype=torch.float32): widened exactly from BF16
    Rule("confidence_head.proj.weight", "confidence_head.proj.weight",
         lambda c, r: (1, c.hidden_size + c.dspark_markov_rank), "BF16", scope=DSPARK_LAST, when=CONFIDENCE,
         out_dtype="F32"),
])

ROLES = ("target", "draft")
