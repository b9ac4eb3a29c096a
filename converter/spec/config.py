"""The DeepSeek-V4 model config: parsing, validation and the derived geometry the rules need."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SourceError
from ..guarded_io import JSON_LIMIT, read_regular
from .schema import Int, ListOf, Num, Obj, SchemaError, Str, check, loads

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_TYPE = "deepseek_v4"

# Fields the tensor schema is derived from; a config lacking one cannot be planned.
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers",
    "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
    "compress_ratios", "index_n_heads", "index_head_dim", "hc_mult",
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "num_hash_layers", "swiglu_limit", "quantization_config",
)
# Config fields that belong to schema variants this tool does not know (V4-Flash-0731 DSpark).
UNKNOWN_VARIANT_FIELDS = ("dspark_config", "num_dspark_layers", "dspark_layers")

FP8_BLOCK = 128
MXFP4_GROUP = 32

# The type and range of every field the tool reads: integers are JSON integers (not 256.7, "256", true
# or null), every number is bounded, so no derived size overflows or goes negative. Bounds are far
# above V4-Flash (vocab 129280, hidden 4096, 43 layers, 64 heads, 256 experts) and far below absurd.
_SIZE = Int(1, 1 << 20)
FIELD_TYPES = Obj({
    "model_type": Str(), "architectures": ListOf(Str(), max_len=16),
    "vocab_size": Int(1, 1 << 24), "hidden_size": _SIZE, "num_hidden_layers": Int(1, 1024),
    "num_nextn_predict_layers": Int(0, 16), "num_attention_heads": Int(1, 4096), "head_dim": Int(1, 1 << 16),
    "q_lora_rank": _SIZE, "o_lora_rank": _SIZE, "o_groups": Int(1, 4096),
    "compress_ratios": ListOf(Int(0, 1 << 16), max_len=1040), "index_n_heads": Int(1, 4096),
    "index_head_dim": Int(1, 1 << 16), "hc_mult": Int(1, 64), "moe_intermediate_size": _SIZE,
    "n_routed_experts": Int(1, 1 << 16), "num_experts_per_tok": Int(1, 1 << 16), "n_shared_experts": Int(1, 64),
    "num_hash_layers": Int(0, 1024), "swiglu_limit": Num(0, 1e6),
    "quantization_config": Obj({"quant_method": Str(), "weight_block_size": ListOf(Int(1, 1 << 16), max_len=4)}),
}, optional={"expert_dtype": Str()})


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
        """vLLM layer indices of a role: main layers for the target, the MTP layers for the draft."""
        if role == "target":
            return list(range(self.num_layers))
        return list(range(self.num_layers, self.num_layers + self.num_mtp))


def parse_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Validate a config dict as a DeepSeek-V4 (V4-Flash schema) config; raise SourceError naming what differs."""
    archs = raw.get("architectures") or []
    if raw.get("model_type") != MODEL_TYPE or not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise SourceError(
            f"{where}: model_type={raw.get('model_type')!r}, architectures={archs!r}; "
            f"lucifer-shard converts only model_type={MODEL_TYPE!r} ({ARCHITECTURE})"
        )
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
    cfg = ModelConfig(
        raw=raw,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_mtp=raw["num_nextn_predict_layers"],
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
    )
    _check_geometry(cfg, where)
    return cfg


def _check_geometry(cfg: ModelConfig, where: str) -> None:
    n_ratios = cfg.num_layers + cfg.num_mtp
    if len(cfg.compress_ratios) != n_ratios:
        raise SourceError(
            f"{where}: compress_ratios has {len(cfg.compress_ratios)} entries, expected "
            f"num_hidden_layers + num_nextn_predict_layers = {n_ratios}"
        )
    bad = sorted({r for r in cfg.compress_ratios if r not in (0, 1, 4, 128)})
    if bad:
        raise SourceError(f"{where}: compress_ratios contains {bad}; the V4-Flash schema knows 0, 1, 4 and 128")
    if any(cfg.compress_ratios[i] not in (0, 1) for i in range(cfg.num_layers, n_ratios)):
        raise SourceError(f"{where}: MTP layers must have compress ratio 0 (sliding window only)")
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


def load_config(path: Path, follow: bool = True) -> ModelConfig:
    """Read and validate a config.json (`follow=False`: an output's copy, which must not be a link)."""
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
    return parse_config(raw, str(path))
