"""The DeepSeek-V4 model config: parsing, validation and the derived geometry the rules need."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PLAN, SourceError
from ..formats.schema import Bool, Int, ListOf, Num, Obj, SchemaError, Str, check, loads
from ..guarded_io import JSON_LIMIT, read_regular

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_TYPE = "deepseek_v4"
V41_MODEL_TYPE = "deepseek_v41"  # DeepSeek-V4.1-Flash: planned (model/v41.py), refused by convert

# Fields the tensor schema is derived from; a config lacking one cannot be planned.
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers",
    "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
    "compress_ratios", "index_n_heads", "index_head_dim", "hc_mult",
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "num_hash_layers", "swiglu_limit", "quantization_config",
)
# Config fields that belong to schema variants this tool does not know.
UNKNOWN_VARIANT_FIELDS = ("dspark_config", "num_dspark_layers", "dspark_layers")
# DeepSeek-V4-Flash-Vision-Exp keeps 0731's architecture string and adds `vision_*` keys: a vision tower
# (vision.*, aligner.*, image_* tensors, an ffn.gate.bias_vl in every layer) and a 3-layer drafter that
# stock vLLM's text class cannot load (docs/checkpoints.md). Refused from config.json alone.
VISION_PREFIX = "vision_"
# The keys that make a config a DSpark checkpoint (DeepSeek-V4-Flash-0731): its `mtp.*` tensors are a
# DSpark drafter, and `num_nextn_predict_layers` no longer describes them.
DSPARK_FIELDS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
# vLLM's DSpark stage count when the config names none (`num_dspark_layers` in
# vllm/models/deepseek_v4/nvidia/dspark.py: `n_mtp_layers` or 3).
DSPARK_DEFAULT_STAGES = 3
# The draft kinds: what `mtp.*` holds. MTP: `num_nextn_predict_layers` MTP layers; DSpark: a stage stack
# with a context projection and Markov/confidence heads (docs/checkpoints.md).
MTP, DSPARK = "mtp", "dspark"

FP8_BLOCK = 128
MXFP4_GROUP = 32

# The type and range of every field the tool reads: integers are JSON integers (not 256.7, "256", true
# or null), every number is bounded, so no derived size overflows or goes negative. Bounds are far
# above V4-Flash (vocab 129280, hidden 4096, 43 layers, 64 heads, 256 experts) and far below absurd.
SIZE = Int(1, 1 << 20)
FIELD_TYPES = Obj({
    "model_type": Str(), "architectures": ListOf(Str(), max_len=16),
    "vocab_size": Int(1, 1 << 24), "hidden_size": SIZE, "num_hidden_layers": Int(1, 1024),
    "num_nextn_predict_layers": Int(0, 16), "num_attention_heads": Int(1, 4096), "head_dim": Int(1, 1 << 16),
    "q_lora_rank": SIZE, "o_lora_rank": SIZE, "o_groups": Int(1, 4096),
    "compress_ratios": ListOf(Int(0, 1 << 16), max_len=1040), "index_n_heads": Int(1, 4096),
    "index_head_dim": Int(1, 1 << 16), "hc_mult": Int(1, 64), "moe_intermediate_size": SIZE,
    "n_routed_experts": Int(1, 1 << 16), "num_experts_per_tok": Int(1, 1 << 16), "n_shared_experts": Int(1, 64),
    "num_hash_layers": Int(0, 1024), "swiglu_limit": Num(0, 1e6),
    "quantization_config": Obj({"quant_method": Str(), "weight_block_size": ListOf(Int(1, 1 << 16), max_len=4)}),
}, optional={"expert_dtype": Str(), "n_mtp_layers": Int(1, 16), "dspark_block_size": Int(1, 64),
              "dspark_noise_token_id": Int(0, 1 << 24), "dspark_target_layer_ids": ListOf(Int(0, 1023), 1, 16),
              "dspark_markov_rank": SIZE, "enable_confidence_head": Bool()})


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a V4-Flash-schema config that decide tensor names and shapes."""

    raw: dict[str, Any]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_mtp: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    hc_mult: int
    moe_intermediate: int
    n_experts: int
    top_k: int
    n_shared: int
    num_hash_layers: int
    swiglu_limit: float
    draft_kind: str = MTP  # what `mtp.*` holds: MTP or DSPARK
    dspark_target_layers: tuple[int, ...] = ()  # DSpark: the target layers whose hidden states it reads
    dspark_markov_rank: int = 0
    dspark_block_size: int = 0
    confidence_head: bool = False  # DSpark: vLLM builds (and loads) mtp.<last>.confidence_head

    @property
    def shared_intermediate(self) -> int:
        return self.moe_intermediate * self.n_shared

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def layer_ids(self, role: str) -> list[int]:
        """Layer indices of a role: main layers for the target; for the draft the indices its layers are
        built with (`num_hidden_layers + i`: their compress ratio and router type follow from it)."""
        if role == "target":
            return list(range(self.num_layers))
        return list(range(self.num_layers, self.num_layers + self.num_mtp))

    @property
    def draft_tokens(self) -> int:
        """vLLM's default draft tokens per step: one per MTP layer pass; DSpark's block size."""
        return self.dspark_block_size if self.draft_kind == DSPARK else 1


def v41_refusal(where: str) -> SourceError:
    """DeepSeek-V4.1-Flash's refusal by convert (v41.py sizes it for plan; nothing converts it yet)."""
    return SourceError(f"{where}: DeepSeek-V4.1-Flash (model_type {V41_MODEL_TYPE!r}) is not supported yet: it needs its "
                       f"own TP3 plan (Engram tables split by hash head, 32x32 FP8 scale blocks, heads and Engram wkv "
                       f"padding, docs/deepseek-v4.1.md)", remedy=PLAN.at(model="config.json"))


def parse_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Validate a config dict as a DeepSeek-V4 (V4-Flash schema) config; raise SourceError naming what differs."""
    archs = raw.get("architectures") or []
    if raw.get("model_type") == V41_MODEL_TYPE:
        raise v41_refusal(where)
    if raw.get("model_type") != MODEL_TYPE or not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise SourceError(
            f"{where}: model_type={raw.get('model_type')!r}, architectures={archs!r}; "
            f"lucifer-shard converts only model_type={MODEL_TYPE!r} ({ARCHITECTURE})"
        )
    vision = sorted(k for k in raw if k.startswith(VISION_PREFIX))
    if vision:
        raise SourceError(f"{where}: a vision model ({len(vision)} {VISION_PREFIX}* keys: {', '.join(vision[:3])}"
                          f"{', ...' if len(vision) > 3 else ''}; DeepSeek-V4-Flash-Vision-Exp's shape): its vision "
                          f"tensors and its {raw.get('num_nextn_predict_layers')}-layer drafter are not supported; "
                          f"lucifer-shard converts the text models DeepSeek-V4-Flash and -0731 (and their derivatives)")
    missing = [k for k in REQUIRED_FIELDS if k not in raw]
    if missing:
        raise SourceError(f"{where}: missing field(s) {', '.join(missing)} required by the V4-Flash schema")
    variant = [k for k in UNKNOWN_VARIANT_FIELDS if k in raw]
    if variant:
        raise SourceError(f"{where}: field(s) {', '.join(variant)} belong to an unsupported schema variant (DSpark)")
    try:
        check(FIELD_TYPES, raw)
    except SchemaError as e:
        raise SourceError(f"{where}: field {e}; fix config.json (or re-download it)") from None
    expert_dtype = raw.get("expert_dtype", "fp4")
    if expert_dtype != "fp4":
        raise SourceError(f"{where}: expert_dtype={expert_dtype!r}; only MXFP4 ('fp4') experts are supported")
    q = raw["quantization_config"]
    if q.get("quant_method") != "fp8" or list(q.get("weight_block_size", [])) != [FP8_BLOCK, FP8_BLOCK]:
        raise SourceError(
            f"{where}: quantization_config {q!r}; expected quant_method 'fp8' with weight_block_size [128, 128]"
        )
    dspark = [k for k in DSPARK_FIELDS if k in raw]
    if dspark and len(dspark) != len(DSPARK_FIELDS):
        missing = ", ".join(k for k in DSPARK_FIELDS if k not in raw)
        raise SourceError(f"{where}: has DSpark field(s) {', '.join(dspark)} but not {missing}; a DSpark config "
                          f"(DeepSeek-V4-Flash-0731) has all of {', '.join(DSPARK_FIELDS)}")
    draft = _draft_fields(raw) if dspark else {"num_mtp": raw["num_nextn_predict_layers"]}
    cfg = ModelConfig(
        raw=raw,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        head_dim=raw["head_dim"],
        q_lora_rank=raw["q_lora_rank"],
        o_lora_rank=raw["o_lora_rank"],
        o_groups=raw["o_groups"],
        compress_ratios=tuple(raw["compress_ratios"]),
        index_n_heads=raw["index_n_heads"],
        index_head_dim=raw["index_head_dim"],
        hc_mult=raw["hc_mult"],
        moe_intermediate=raw["moe_intermediate_size"],
        n_experts=raw["n_routed_experts"],
        top_k=raw["num_experts_per_tok"],
        n_shared=raw["n_shared_experts"],
        num_hash_layers=raw["num_hash_layers"],
        swiglu_limit=float(raw["swiglu_limit"]),
        **draft,
    )
    _check_geometry(cfg, where)
    return cfg


def _draft_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A DSpark config's draft fields. The stage count is vLLM's (`n_mtp_layers`, else 3); the config's
    `num_nextn_predict_layers` is stale there (0731 keeps 1) and is not read."""
    return {"draft_kind": DSPARK, "num_mtp": raw.get("n_mtp_layers") or DSPARK_DEFAULT_STAGES,
            "dspark_target_layers": tuple(raw["dspark_target_layer_ids"]),
            "dspark_markov_rank": raw["dspark_markov_rank"], "dspark_block_size": raw["dspark_block_size"],
            "confidence_head": bool(raw.get("enable_confidence_head", True))}


def _check_geometry(cfg: ModelConfig, where: str) -> None:
    n_ratios = cfg.num_layers + cfg.num_mtp
    if len(cfg.compress_ratios) != n_ratios:
        draft = ("num_nextn_predict_layers" if cfg.draft_kind == MTP
                 else f"the {cfg.num_mtp} DSpark stages (n_mtp_layers, else vLLM's {DSPARK_DEFAULT_STAGES})")
        raise SourceError(
            f"{where}: compress_ratios has {len(cfg.compress_ratios)} entries, expected "
            f"num_hidden_layers + {draft} = {n_ratios}"
        )
    if cfg.draft_kind == DSPARK:
        _check_dspark(cfg, where)
    bad = sorted({r for r in cfg.compress_ratios if r not in (0, 1, 4, 128)})
    if bad:
        raise SourceError(f"{where}: compress_ratios contains {bad}; the V4-Flash schema knows 0, 1, 4 and 128")
    if any(cfg.compress_ratios[i] not in (0, 1) for i in range(cfg.num_layers, n_ratios)):
        raise SourceError(f"{where}: {cfg.draft_kind.upper()} draft layers must have compress ratio 0 "
                          f"(sliding window only)")
    if cfg.top_k > cfg.n_experts:
        raise SourceError(f"{where}: num_experts_per_tok {cfg.top_k} > n_routed_experts {cfg.n_experts}")
    if cfg.num_heads % cfg.o_groups:
        raise SourceError(f"{where}: num_attention_heads {cfg.num_heads} is not a multiple of o_groups {cfg.o_groups}")
    if cfg.num_hash_layers > cfg.num_layers:
        raise SourceError(f"{where}: num_hash_layers {cfg.num_hash_layers} > num_hidden_layers {cfg.num_layers}")
    checks = {
        "hidden_size": (cfg.hidden_size, FP8_BLOCK),
        "moe_intermediate_size": (cfg.moe_intermediate, FP8_BLOCK),
        "q_lora_rank": (cfg.q_lora_rank, FP8_BLOCK),
        "o_lora_rank": (cfg.o_lora_rank, FP8_BLOCK),
        "head_dim": (cfg.head_dim, 16),
    }
    for name, (value, mult) in checks.items():
        if value <= 0 or value % mult:
            raise SourceError(f"{where}: {name}={value} must be a positive multiple of {mult} for block-scaled weights")


def _check_dspark(cfg: ModelConfig, where: str) -> None:
    bad = [i for i in cfg.dspark_target_layers if i >= cfg.num_layers]
    if bad:
        raise SourceError(f"{where}: dspark_target_layer_ids {list(cfg.dspark_target_layers)} name layer(s) {bad} "
                          f"of a {cfg.num_layers}-layer model")
    noise = cfg.raw["dspark_noise_token_id"]
    if noise >= cfg.vocab_size:
        raise SourceError(f"{where}: dspark_noise_token_id {noise} is outside the vocabulary ({cfg.vocab_size})")


def load_config(path: Path, follow: bool = True, where: str | None = None) -> ModelConfig:
    """Read and validate a config.json (`follow=False`: an output's copy, which must not be a link); `where`:
    how its refusals name it (a repo's, rather than its path in the Hugging Face cache), else `path`."""
    return parse_config(read_config(path, follow), where or str(path))


def read_config(path: Path, follow: bool = True) -> dict[str, Any]:
    """config.json as a JSON object (bounded, no link when `follow=False`); SourceError otherwise."""
    try:
        raw = loads(read_regular(path, JSON_LIMIT, follow=follow))
    except FileNotFoundError:
        raise SourceError(f"{path}: not found; a model directory needs config.json") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot read config ({e.strerror})") from None
    except SchemaError as e:
        raise SourceError(f"{path}: config is {e}; fix or re-download it") from None
    if not isinstance(raw, dict):
        raise SourceError(f"{path}: config is not a JSON object")
    return raw
