"""Layout identity: the converter's CPU layout functions equal FlashInfer's own helpers byte for byte,
at the per-rank DeepSeek-V4-Flash TP3 shapes (E = 4 experts of random bytes).

  interleave_sm90   == flashinfer.fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")  (CUDA kernel)
  fold_scales_sm90  == flashinfer.fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(s)         (torch, on the GPU)
  swizzle_128x4     == flashinfer.block_scale_interleave(s)   (sm100/sm120 128x4 swizzle, CUDA kernel)
"""
from __future__ import annotations

import time
import zlib

import numpy as np
import pytest
import torch

import gpu_harness as H
from lucifer_shard.model.layouts import fold_scales_sm90, interleave_sm90, swizzle_128x4

pytestmark = pytest.mark.gpu

E = 4
CASES = [  # (id, our function, FlashInfer helper name, per-rank shape)
    ("weights-w13", interleave_sm90, "interleave_moe_weights_for_sm90_mixed_gemm", (E, 1536, 2048)),
    ("weights-w2", interleave_sm90, "interleave_moe_weights_for_sm90_mixed_gemm", (E, 4096, 384)),
    ("scales-fold-w13", fold_scales_sm90, "interleave_moe_scales_for_sm90_mixed_gemm", (E, 1536, 128)),
    ("scales-fold-w2", fold_scales_sm90, "interleave_moe_scales_for_sm90_mixed_gemm", (E, 4096, 24)),
    ("scales-swizzle-w13", swizzle_128x4, "block_scale_interleave", (E, 1536, 128)),
    ("scales-swizzle-w2", swizzle_128x4, "block_scale_interleave", (E, 4096, 24)),
]


def _flashinfer(fi, helper: str, x: torch.Tensor) -> torch.Tensor:
    flashinfer, fmoe = fi
    if helper == "interleave_moe_weights_for_sm90_mixed_gemm":
        return fmoe.interleave_moe_weights_for_sm90_mixed_gemm(x, "fp4")
    if helper == "interleave_moe_scales_for_sm90_mixed_gemm":
        return fmoe.interleave_moe_scales_for_sm90_mixed_gemm(x)  # group_size 32, uint8 E8M0
    if helper == "block_scale_interleave":
        y = flashinfer.block_scale_interleave(x)  # flat [E * padded rows * padded cols]
        assert y.numel() == x.numel(), (
            f"block_scale_interleave padded {list(x.shape)} to {y.numel()} bytes; these shapes need no padding")
        return y.reshape(x.shape)
    raise AssertionError(helper)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_layout_equals_flashinfer(case, fi):
    name, ours, helper, shape = case
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    t0 = time.perf_counter()
    want = _flashinfer(fi, helper, x.to(H.DEVICE).contiguous())
    H.sync()
    fi_s = time.perf_counter() - t0
    want = want.cpu().contiguous().numpy()
    t0 = time.perf_counter()
    got = ours(x.numpy())
    cpu_s = time.perf_counter() - t0
    same_shape = tuple(got.shape) == tuple(want.shape)
    mismatches = int((got != want).sum()) if same_shape else -1
    H.record("layout_identity", case=name, ours=ours.__name__, flashinfer=helper, shape=list(shape),
             out_shape=list(want.shape), our_shape=list(got.shape), dtype=str(want.dtype),
             equal=bool(same_shape and mismatches == 0), mismatches=mismatches, nbytes=int(want.size),
             flashinfer_s=round(fi_s, 4), cpu_s=round(cpu_s, 4))
    assert same_shape, f"{name}: ours {list(got.shape)} vs FlashInfer {list(want.shape)}"
    assert want.dtype == np.uint8
    assert mismatches == 0, f"{name}: {mismatches} of {want.size} bytes differ from FlashInfer's {helper}"
