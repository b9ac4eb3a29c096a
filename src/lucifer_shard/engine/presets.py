"""synth's presets: each one's config.json, and the files it writes (their sizes, before any byte:
synth's room check and its help read them). Imports no torch: `synth --help` computes the sizes."""
from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources

from ..errors import LuciferError
from ..formats.dtypes import DTYPE_SIZE
from ..model.config import DSPARK_FIELDS, parse_config
from ..model.tensorspecs import ExpectedTensor, expected_sources

PRESETS = {
    "tiny": "tiny.json",
    "flash-layer": "deepseek-v4-flash.json",
    "flash-moe": "flash-moe.json",
    # tiny's padded axes with the geometry vLLM's DeepSeek-V4 CPU kernels require (tests/forward):
    # head_dim 512 (the sparse-MLA kernel and fp8_ds_mla cache), index_topk 512 (the CPU indexer's
    # top-k), 64 experts (the CPU top-k routers take 64/128/256/384 only).
    "forward": "forward.json",
    # tiny's target with DeepSeek-V4-Flash-0731's draft: a three-stage DSpark drafter (the 0731 config's
    # dspark_* keys, 0731's stale num_nextn_predict_layers 1) reading target layers 1-3, Markov rank 64
    "dspark": "dspark.json",
    # flash-layer's exact Flash dimensions with DeepSeek-V4-Flash-0731's config and draft: the three-stage
    # DSpark drafter at Flash size (Markov rank 256), for GPU runs of the drafter's real shapes
    "flash-0731-layer": "deepseek-v4-flash-0731.json",
}
TRUNCATED_BY_DEFAULT = ("flash-layer", "flash-0731-layer")  # 1 decoder layer unless --layers says more
MAX_SHARD_BYTES = 1 << 30
MIN_SHARDS = 4  # a small checkpoint's shards (synth --shards: more, for streaming from a Hub stand-in)
# A bound on a shard's safetensors header per tensor (its name, dtype, shape and offsets as JSON, the
# longest DeepSeek-V4 name is under 80 characters) and on the four JSON files synth writes besides.
HEADER_BYTES_PER_TENSOR = 192
JSON_FILES_BYTES = 64 << 10


def preset_config(preset: str, layers: int | None = None, mtp: bool = True) -> dict:
    """The config dict of a preset; `layers` truncates the decoder (flash-layer), `mtp=False` drops the draft.
    A DSpark drafter of a truncated decoder reads its last layers, as 0731's reads layers 40-42 of 43."""
    if preset not in PRESETS:
        raise LuciferError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    raw = json.loads(resources.files("lucifer_shard.configs").joinpath(PRESETS[preset]).read_text())
    if preset in TRUNCATED_BY_DEFAULT and layers is None:
        layers = 1
    if layers is not None:
        n, ratios = raw["num_hidden_layers"], raw["compress_ratios"]
        if not 1 <= layers <= n:
            raise LuciferError(f"--layers {layers}: preset {preset!r} has 1..{n} layers")
        raw["compress_ratios"] = ratios[:layers] + ratios[n:]
        raw["num_hidden_layers"] = layers
        raw["num_hash_layers"] = min(raw["num_hash_layers"], layers)
        if "dspark_target_layer_ids" in raw:
            reads = min(len(raw["dspark_target_layer_ids"]), layers)
            raw["dspark_target_layer_ids"] = list(range(layers - reads, layers))
    if not mtp:
        raw["compress_ratios"] = raw["compress_ratios"][: raw["num_hidden_layers"]]
        raw["num_nextn_predict_layers"] = 0
        for key in DSPARK_FIELDS:
            raw.pop(key, None)
    return raw


def nbytes(src: ExpectedTensor) -> int:
    n = DTYPE_SIZE[src.dtype]
    for d in src.shape:
        n *= d
    return n


def shards(sources: list[ExpectedTensor], count: int = MIN_SHARDS,
           most: int = MAX_SHARD_BYTES) -> Iterator[list[ExpectedTensor]]:
    """Group keys in order into shards (at least `count` for small models, at most `most` bytes each)."""
    limit = min(most, max(1, sum(map(nbytes, sources)) // count))
    shard: list[ExpectedTensor] = []
    total = 0
    for src in sources:
        n = nbytes(src)
        if shard and total + n > limit:
            yield shard
            shard, total = [], 0
        shard.append(src)
        total += n
    if shard:
        yield shard


def ordered_sources(raw: dict, name: str = "preset") -> list[ExpectedTensor]:
    """The checkpoint's tensors in the order synth writes them (by layer, then key)."""
    sources = expected_sources(parse_config(raw, name)).values()
    return sorted(sources, key=lambda s: (s.layer if s.layer is not None else -1, s.key))


def file_sizes(raw: dict, count: int = MIN_SHARDS) -> list[int]:
    """The files synth writes for config `raw` (in at least `count` shards), in bytes: each shard (its
    tensors' bytes and a bound on its header), then the JSON files; a bound within a few KiB of what is
    written."""
    groups = list(shards(ordered_sources(raw), count))
    return [sum(map(nbytes, g)) + len(g) * HEADER_BYTES_PER_TENSOR for g in groups] + [JSON_FILES_BYTES]


def preset_bytes(preset: str, layers: int | None = None) -> int:
    """What `synth PRESET` writes, in bytes (with its draft)."""
    return sum(file_sizes(preset_config(preset, layers)))
