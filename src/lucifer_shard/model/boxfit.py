"""What fits on a box, per rank: the rank's weights, what vLLM keeps besides, the KV-cache room left and
the context that room holds. Pure arithmetic from config.json and the plan's per-rank bytes.

The KV side follows vLLM 0.34.0's own KV-cache spec for DeepSeek-V4 (paths under `vllm/`, lines of the
0.34.0 wheel; docs/cli.md#plan says the same):

* every layer (target and draft) keeps a sliding-window cache (`DeepseekV4SWACache`,
  v1/attention/backends/mla/sparse_swa.py:76-146): window `sliding_window`, 64 tokens a block, 584 bytes a
  token in the fp8_ds_mla layout (448 NoPE + 128 RoPE + 8 scale), pages rounded up to 576 bytes;
* a layer of compress ratio 4 or 128 also keeps its compressed MLA cache (models/deepseek_v4/attention.py:
  817-840: 584 bytes a state, one state per `ratio` tokens, vLLM's block of 256 tokens) and its compressor's
  state (compressor.py:139-195, 297-302: F32 `2 * coff * head_dim` a slot, a window of `coff * ratio`, coff
  2 at ratio 4, blocks of 4 or 8); a ratio-4 layer also its indexer's key cache (attention.py:868-880,
  977-987: `index_head_dim` FP8 bytes and 4 scale bytes per 128 a state) and the indexer compressor's
  state (F32 `2 * 2 * index_head_dim`);
* MLA keeps one KV head (`max_tp_shards=1`): every rank holds the whole cache, at any --tp;
* vLLM packs the layers into groups that share one pool of blocks (v1/core/kv_cache_planning.py:958-1085,
  `_get_packed_kv_cache_groups`, and :923-955 `_approximate_gcd`); a block costs the widest group's page;
  a request holds, per group, its context's blocks (full-attention groups) or its window plus the tokens in
  flight (sliding-window groups, v1/kv_cache_interface.py:932-969), and the pool's "GPU KV cache size" is
  `int(blocks / blocks_per_request * max_model_len)` (v1/core/kv_cache_utils.py:1082-1150).

tests/shim/test_boxfit_vllm.py builds the model with vLLM's own classes on CPU and checks these figures
against vLLM's planner; every run that printed vLLM's "GPU KV cache size" line (the H200 runs of
tests/gpu/results, the CPU server of docs/evidence/serving-proof.md) gives the same tokens (tests/test_boxfit.py).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Box:
    name: str
    memory: int  # bytes of GPU memory vLLM takes its share of (the whole unified memory on a GB10)
    unified: bool  # host and GPU share the memory: the host's part of the model counts against it
    batched_tokens: int  # vLLM's default --max-num-batched-tokens for `vllm serve` there
    source: str  # where `memory` comes from


# vLLM's default --max-num-batched-tokens for its API server (engine/arg_utils.py:3007-3043): 8192 on a GPU of
# 70 GiB or more that is not a GB10, 2048 on a GB10.
BOXES = (
    Box("DGX Spark (GB10)", 121 * GIB, True, 2048, "121 GiB of unified memory, host and GPU together"),
    Box("RTX PRO 6000", 97_887 * MIB, False, 8192, "96 GB: 97,887 MiB in published nvidia-smi output, not measured here"),
    Box("H100", 85_017_493_504, False, 8192, "80 GB: torch.cuda.mem_get_info's total on the H100 lent to this project"),
    Box("H200", 143_771 * MIB, False, 8192, "141 GB: 143,771 MiB, nvidia-smi on this project's H200"),
)
# vLLM's default --gpu-memory-utilization: 0.92 (config/cache.py:186, 0.33.0 cache.py:215). 0.34.0 on CUDA
# sizes the KV cache from all the memory left after warm-up instead (its extensible KV cache, cache.py:495-501),
# which on a unified-memory box leaves the host nothing: there, pass --gpu-memory-utilization yourself.
UTILIZATION = 0.92
# On a unified-memory box (a DGX Spark) vLLM's documentation says to set it (cache.py:216-234); the host guide
# (docs/three-boxes.md §4) and the public three-Spark lanes run 0.80: plan shows that box at it too.
UNIFIED_UTILIZATION = 0.80
# What vLLM keeps on the GPU besides the weights and the KV cache (v1/worker/gpu_worker.py:673-790: the
# profile run's peak, the CUDA-graph estimate, non-torch memory). Assumed, not measured on this model: a real
# run's "Available KV cache memory" line replaces the sum.
BESIDES = (
    ("CUDA context, NCCL and cuBLAS workspaces", 3 * GIB // 2),
    ("CUDA graphs", 1 * GIB),
)
ACTIVATION_BYTES_PER_BATCHED_TOKEN = 256 << 10  # the profile run's activation peak: 2 GiB at 8192 tokens
IN_FLIGHT_BATCHES = 2  # async scheduling, on by default (config/vllm.py:560-577, 1610-1637)
SERVED_LEN = 65_536  # the --max-model-len the token pool is shown at

# The fp8_ds_mla KV-cache layout (vLLM's default for DeepSeek-V4 on CUDA, attention.py:95-130).
MLA_TOKEN_BYTES = 584
PAGE_ALIGN = 576
MLA_BLOCK = 256  # the block size vLLM resolves for DeepSeek-V4 (its compressed caches' block)
SWA_BLOCK = 64
STATE_BLOCK = {4: 4, 128: 8}  # compressor state blocks per compress ratio
INDEX_QUANT_BLOCK = 128  # the indexer key's FP8 scale group: 4 bytes of F32 scale per 128 values
RATIOS = (0, 1, 4, 128)  # compress ratios vLLM's DeepSeek-V4 accepts with these caches


@dataclass(frozen=True)
class Cache:
    """One layer's KV cache of one kind, as vLLM specs it: a group bucket, its page and its window."""

    bucket: str  # layers vLLM can put in one group (same kind, block and window)
    block: int  # tokens a block
    page: int  # bytes a block, padded
    window: int | None  # sliding window (tokens); None: the whole context


def _page(block: int, per_token: int, tokens_per_state: int = 1) -> int:
    """A page of `block` tokens, `tokens_per_state` tokens a state, rounded up to the 576-byte alignment."""
    raw = block // tokens_per_state * per_token
    return -(-raw // PAGE_ALIGN) * PAGE_ALIGN


def layer_caches(ratio: int, head_dim: int, index_head_dim: int, window: int) -> list[Cache]:
    """The KV caches vLLM gives one DeepSeek-V4 layer of compress ratio `ratio` (module docstring)."""
    out = [Cache("sliding window", SWA_BLOCK, _page(SWA_BLOCK, MLA_TOKEN_BYTES), window)]
    if ratio <= 1:
        return out
    coff = 2 if ratio == 4 else 1
    state = f"compressor state c{ratio}"
    out += [Cache("compressed", MLA_BLOCK, _page(MLA_BLOCK, MLA_TOKEN_BYTES, ratio), None),
            Cache(state, STATE_BLOCK[ratio], _page(STATE_BLOCK[ratio], 2 * coff * head_dim * 4), coff * ratio)]
    if ratio == 4:
        index_bytes = index_head_dim + index_head_dim // INDEX_QUANT_BLOCK * 4
        out += [Cache("compressed", MLA_BLOCK, _page(MLA_BLOCK, index_bytes, ratio), None),
                Cache(state, STATE_BLOCK[ratio], _page(STATE_BLOCK[ratio], 2 * 2 * index_head_dim * 4), 2 * ratio)]
    return out


def _approximate_gcd(values: list[int], lower: int) -> int:
    """vLLM's `_approximate_gcd`: the chunk in [lower, max] that pads `values` least, ties to the larger."""
    top = max(values)
    if lower > top:
        return lower
    return min(range(lower, top + 1), key=lambda d: (sum((d - x % d) % d for x in values), -d))


@dataclass(frozen=True)
class Group:
    block: int
    page: int  # bytes a block of this group (its layers' pages together)
    window: int | None


def groups(caches: list[Cache]) -> list[Group]:
    """vLLM's packing of the caches into groups that share the block pool (`_get_packed_kv_cache_groups`)."""
    buckets: dict[str, Counter] = {}
    meta: dict[str, Cache] = {}
    for c in caches:
        buckets.setdefault(c.bucket, Counter())[c.page] += 1
        meta[c.bucket] = c
    balanced = {b: len(set(n.values())) == 1 for b, n in buckets.items()}
    floor = max((max(n.values()) for b, n in buckets.items() if balanced[b] and len(n) > 1), default=0)
    repeats = _approximate_gcd([max(n.values()) for b, n in buckets.items() if balanced[b]], floor) if floor else None

    def split(b: str) -> int:  # how many groups a bucket becomes
        return -(-max(buckets[b].values()) // repeats) if balanced[b] and repeats else 1

    def widest(b: str, n: int) -> int:
        return sum(-(-count // n) * page for page, count in buckets[b].items())

    def is_state(b: str) -> bool:  # a sliding-window bucket vLLM may split down to one layer a group
        return repeats is None and meta[b].window is not None

    anchor = max(widest(b, sum(buckets[b].values()) if is_state(b) else split(b)) for b in buckets)
    out = []
    for b, counts in buckets.items():
        n = split(b)
        if is_state(b):
            n = max(n, -(-sum(counts.values()) // max(anchor // meta[b].page, 1)))
        # vLLM deals the layers round-robin: group i takes every n-th layer of each page size from the i-th
        out += [Group(meta[b].block, sum(len(range(i, count, n)) * page for page, count in counts.items()),
                      meta[b].window) for i in range(n)]
    return out


@dataclass(frozen=True)
class KVPool:
    """The block pool of one rank's KV cache: what a block costs and what a request holds."""

    groups: tuple[Group, ...]
    max_len: int  # the config's max_position_embeddings: --max-model-len's ceiling

    @property
    def block_bytes(self) -> int:
        return max(g.page for g in self.groups)

    def blocks_per_request(self, max_model_len: int, in_flight: int) -> int:
        """Blocks one request of `max_model_len` tokens holds (kv_cache_interface.py:654-659, 932-969)."""
        n = 0
        for g in self.groups:
            tokens = max_model_len if g.window is None else min(g.window - 1 + in_flight, max_model_len)
            n += -(-tokens // g.block) + (g.window is not None)
        return n

    def tokens(self, room: int, max_model_len: int, in_flight: int) -> tuple[int, float]:
        """vLLM's "GPU KV cache size" (tokens) and concurrency at `max_model_len`."""
        concurrency = (room // self.block_bytes) / self.blocks_per_request(max_model_len, in_flight)
        return int(concurrency * max_model_len), concurrency

    def longest(self, room: int, in_flight: int) -> int:
        """The largest --max-model-len one request fits in `room` (0: not even one block of context)."""
        blocks, lo, hi = room // self.block_bytes, 0, self.max_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_per_request(mid, in_flight) <= blocks else (lo, mid - 1)
        return lo


def kv_pool(raw: dict[str, Any], ratios: list[int]) -> KVPool | None:
    """The pool of a DeepSeek-V4 model whose served layers have `ratios` (target, then the draft's when it
    drafts); None where vLLM's spec is not this one (a ratio it has no cache for, no `sliding_window`)."""
    window = raw.get("sliding_window")
    if not isinstance(window, int) or window < 1 or any(r not in RATIOS for r in ratios):
        return None
    caches = [c for r in ratios for c in layer_caches(r, raw["head_dim"], raw["index_head_dim"], window)]
    max_len = raw.get("max_position_embeddings")
    return KVPool(tuple(groups(caches)), max_len if isinstance(max_len, int) and max_len > 0 else 1 << 20)


@dataclass(frozen=True)
class Fit:
    box: Box
    weights: int  # the rank's bytes in this box's memory (GPU weights; plus host tables on unified memory)
    besides: int  # what vLLM keeps besides (BESIDES and activations)
    room: int  # KV-cache room: memory x utilization - weights - besides (negative: does not fit)
    longest: int | None  # the largest --max-model-len of one request; None: KV not modelled
    served: tuple[int, float] | None  # (tokens, concurrency) at SERVED_LEN, or at `longest` if shorter
    utilization: float = UTILIZATION  # the --gpu-memory-utilization it is figured at

    @property
    def fits(self) -> bool:
        return self.room > 0 and self.longest != 0


def besides(box: Box) -> int:
    return sum(n for _, n in BESIDES) + ACTIVATION_BYTES_PER_BATCHED_TOKEN * box.batched_tokens


def fit(box: Box, weights: int, pool: KVPool | None, utilization: float = UTILIZATION) -> Fit:
    """One box, one rank: the room its KV cache gets and the context that room holds."""
    room = math.ceil(box.memory * utilization) - weights - besides(box)  # v1/worker/utils.py:743
    if pool is None or room <= 0:
        return Fit(box, weights, besides(box), room, None if pool is None else 0, None, utilization)
    in_flight = IN_FLIGHT_BATCHES * box.batched_tokens
    longest = pool.longest(room, in_flight)
    served = pool.tokens(room, min(SERVED_LEN, longest), in_flight) if longest else None
    return Fit(box, weights, besides(box), room, longest, served, utilization)


def fits(weights: int, pool: KVPool | None, host: int = 0, utilization: float = UTILIZATION) -> list[Fit]:
    """Every common box for a rank of `weights` GPU bytes and `host` bytes in host memory."""
    return [fit(b, weights + (host if b.unified else 0), pool, utilization) for b in BOXES]


def at_guide(fits: list[Fit], pool: KVPool | None) -> list[Fit]:
    """The unified-memory boxes of `fits` again at UNIFIED_UTILIZATION, the value the host guide gives them
    (none when `fits` were figured at a --gpu-memory-utilization the user gave)."""
    if any(f.utilization != UTILIZATION for f in fits):
        return []
    return [fit(f.box, f.weights, pool, UNIFIED_UTILIZATION) for f in fits if f.box.unified]


def per_token_bytes(pool: KVPool) -> float:
    """KV bytes a token of context costs in the full-attention groups, pages counted at the block's width."""
    return sum(pool.block_bytes / g.block for g in pool.groups if g.window is None)


def fit_json(f: Fit) -> dict:
    return {"box": f.box.name, "memory_bytes": f.box.memory, "memory_from": f.box.source, "unified": f.box.unified,
            "utilization": f.utilization,
            "weights_bytes": f.weights, "besides_bytes": f.besides, "kv_room_bytes": f.room, "fits": f.fits,
            "max_num_batched_tokens": f.box.batched_tokens, "longest_max_model_len": f.longest,
            "served": None if f.served is None else {"max_model_len": min(SERVED_LEN, f.longest or 0),
                                                      "kv_cache_tokens": f.served[0],
                                                      "concurrency": round(f.served[1], 2)}}


def window_bytes(pool: KVPool, in_flight: int) -> int:
    """Bytes a request holds in its sliding-window groups whatever its length (its windows and in-flight tokens)."""
    return sum((-(-(g.window - 1 + in_flight) // g.block) + 1) * pool.block_bytes for g in pool.groups
               if g.window is not None)
