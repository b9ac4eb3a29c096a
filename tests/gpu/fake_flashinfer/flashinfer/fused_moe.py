"""CPU stand-in of flashinfer.fused_moe (dry run only; see __init__.py)."""
import numpy as np
import torch

from lucifer_shard.model.layouts import expert_layout, fold_scales_sm90, interleave_sm90
from lucifer_shard.proof.numerics import moe_reference

_NAMES = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.cpu().numpy())


def interleave_moe_weights_for_sm90_mixed_gemm(w: torch.Tensor, quant_type: str = "fp4") -> torch.Tensor:
    assert quant_type == "fp4", quant_type
    return torch.from_numpy(interleave_sm90(_np(w)))


def interleave_moe_scales_for_sm90_mixed_gemm(s: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    assert group_size == 32, group_size
    return torch.from_numpy(fold_scales_sm90(_np(s)))


def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                      output_dtype, quant_scales, swiglu_limit=None, tp_size=1, tp_rank=0,
                      use_w4_group_scaling=False, output=None, workspace_buffer=None, **_):
    """moe_reference on the tensors brought back to model layout (sm90 folded) by our inverse layouts."""
    assert use_w4_group_scaling and output_dtype == torch.bfloat16
    kernel = (fc1_expert_weights, quant_scales[0], fc2_expert_weights, quant_scales[1])
    model = [torch.from_numpy(expert_layout("sm90", "kernel", "folded", n).inverse(_np(t))) for n, t in zip(_NAMES, kernel)]
    limit = float(swiglu_limit.reshape(-1)[0]) if isinstance(swiglu_limit, torch.Tensor) else swiglu_limit
    out = moe_reference(input, token_selected_experts, token_final_scales, *model, limit)
    if output is None:
        return out
    output.copy_(out)
    return output
