"""The pad scale byte 0x00 through vLLM 0.34.0's own scale transforms, on CPU: each function below is pure torch
and is what a GPU family's fast path does to an E8M0 block scale before its kernel sees it
(docs/output-format.md, "Pad values on vLLM 0.34.0's fast paths"). Each is called on rank 2's padded blocks
(the rank with the most padding) of a real conversion, and must give a zero block on the same path as the
real blocks: no check, no rejection, no other encoding that reads 0x00 as anything but "this block is zero".
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

L = "model.layers.0."
WQ_B, SHARED_UP, W13_SCALE = (f"{L}attn.wq_b", f"{L}ffn.shared_experts.gate_up_proj",
                              f"{L}ffn.experts.routed_experts.w13_weight_scale")


def _rank2(out: Path, *names: str) -> tuple[list[torch.Tensor], dict]:
    """Rank 2's tensors `names` as stored (vLLM's dtypes) and their manifest entries."""
    man = json.loads((out / "lucifer-manifest.json").read_text())
    entry = man["roles"]["target"]["ranks"][2]
    with safe_open(out / entry["tensors"][names[0]]["file"], "pt") as f:
        return [f.get_tensor(n) for n in names], {n: entry["tensors"][n] for n in names}


def _pad_rows(info: dict) -> slice:
    ((dim, lo, hi), *_) = info["zero_regions"]
    assert dim == 0
    return slice(lo, hi)


def test_the_fp8_linears_upcast_makes_a_padded_block_scale_plus_zero(out_model, shim):
    """SM90/SM100 DeepGEMM (`deepgemm_post_process_weight_scale_block`) and SM120 b12x
    (`B12xFp8BlockScaledMMKernel.process_weights_after_loading`) take an E8M0 block scale through
    `_upcast_e8m0_to_fp32`, a shift of the byte into float32's exponent: 0x00 becomes +0.0 exactly, not the
    denormal 2^-127, and the padded block dequantizes to zero; the real blocks keep their powers of two."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import _upcast_e8m0_to_fp32

    (w, s), info = _rank2(out_model, f"{WQ_B}.weight", f"{WQ_B}.weight_scale_inv")
    assert s.dtype == torch.float8_e8m0fnu and w.dtype == torch.float8_e4m3fn
    rows = _pad_rows(info[f"{WQ_B}.weight_scale_inv"])
    up = _upcast_e8m0_to_fp32(s)
    assert up[rows].view(torch.int32).eq(0).all()  # +0.0: no float32 denormal reaches the kernel
    real = s.view(torch.uint8)[: rows.start].to(torch.int32)
    assert torch.equal(up[: rows.start], torch.exp2((real - 127).to(torch.float32)))
    block = 128
    dq = w.to(torch.float32) * up.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
    assert not dq[rows.start * block:].any() and dq[: rows.start * block].any()


def test_the_sm100_megamoe_shared_expert_scales_keep_0x00(out_model, shim):
    """SM100 MegaMoE re-encodes the shared expert's 128x128 scales at its 1x32 granularity
    (`DeepGemmMegaMoEExperts._pack_scale`): a byte copy, so a padded block's 0x00 stays 0x00."""
    from vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe import DeepGemmMegaMoEExperts

    (s,), info = _rank2(out_model, f"{SHARED_UP}.weight_scale_inv")
    rows, groups = s.shape[0] * 128, s.shape[1] * 4  # groups: the 1x32 scales along K, as `_load_weight` asks
    packed = DeepGemmMegaMoEExperts._pack_scale(s, rows, groups).view(torch.uint8).view(rows, groups)
    assert torch.equal(packed, s.view(torch.uint8).repeat_interleave(128, 0).repeat_interleave(4, 1))
    for lo, hi in ((a, b) for d, a, b in info[f"{SHARED_UP}.weight_scale_inv"]["zero_regions"]):
        assert not packed[lo * 128: hi * 128].any()


def test_the_sm90_marlin_moe_scales_keep_0x00(out_model, shim):
    """SM90 Marlin MoE (`prepare_moe_mxfp4_layer_for_marlin`) widens the MXFP4 scales to the activation dtype
    (E8M0 -> BF16, where 2^-127 is a BF16 subnormal, held exactly), permutes them, and narrows them back
    (`mxfp4_marlin_process_scales`): every byte comes back, 0x00 as 0x00."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import mxfp4_marlin_process_scales

    (s,), info = _rank2(out_model, W13_SCALE)
    expert = s[0].view(torch.float8_e8m0fnu)
    wide = expert.to(torch.bfloat16)
    rows = _pad_rows(info[W13_SCALE])
    assert wide[rows].view(torch.int16).eq(0x0040).all()  # 2^-127, not flushed to zero nor rounded up
    back = mxfp4_marlin_process_scales(wide).view(torch.uint8)
    assert torch.equal(back, expert.view(torch.uint8).view(-1, 4)[:, [0, 2, 1, 3]].reshape(expert.shape))
    assert not back[rows].any()
