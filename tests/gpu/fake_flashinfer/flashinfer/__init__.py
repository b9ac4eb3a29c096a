"""CPU stand-in for FlashInfer, for the GPU suite's dry run only (LUCIFER_GPU_DRYRUN=1; see
gpu_harness.flashinfer_moe). It exposes what the suite calls, built from the converter's own layout
functions and `moe_reference`, so a dry run checks the suite's plumbing, shapes and tolerances on a
CPU box. It proves nothing about FlashInfer: the layout "identity" holds by construction, and the
"kernel" is the reference on the inverse-laid-out tensors."""
import numpy as np
import torch

from lucifer_shard.model.layouts import swizzle_128x4

from . import fused_moe  # noqa: F401  (import flashinfer.fused_moe as the real package allows)

IS_CPU_STAND_IN = True
__version__ = "cpu-stand-in"


def block_scale_interleave(x: torch.Tensor) -> torch.Tensor:
    """The 128x4 swizzle, flat as FlashInfer returns it (shapes needing no padding only)."""
    return torch.from_numpy(swizzle_128x4(np.ascontiguousarray(x.cpu().numpy()))).reshape(-1)
