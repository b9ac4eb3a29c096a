"""The expert re-layout (the forks, stock 0.33.0 and 0.34.0): wraps the name
`convert_weight_to_mxfp4_moe_kernel_format` that `Mxfp4MoEMethod._setup_kernel` looks up at call time.

For layers the loader tagged (experts already in kernel layout) it is the identity: the same storage
comes back, viewed in the kernel's shape (SM90's folded scales are 5-D, held in the 3-D parameter
whose shape `_setup_kernel` checks); it refuses a tagged layer whose resolved backend is not the
manifest's variant. Untagged layers go to the original.
"""
from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass, field

from lucifer_shard.model.layouts import EXPERT_TENSORS
from lucifer_shard.model.runtimes import MOE_BACKEND, RELAYOUT

from .. import compat
from ...errors import ShimError, ShimRuntimeError
from ..configview import backend_name

logger = logging.getLogger("lucifer_shard.runtime_shim")
TAG_ATTR = "_lucifer_tp3_tag"  # the attribute the loader sets on a layer whose experts it filled in kernel layout

CONVERT = compat.Symbol(
    "convert_weight_to_mxfp4_moe_kernel_format", "vllm.model_executor.layers.fused_moe.oracle.mxfp4",
    "convert_weight_to_mxfp4_moe_kernel_format",
    ("mxfp4_backend", "layer", "w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
     "w13_bias", "w2_bias", "_cache_permute_indices"),
    # vLLM 0.33.0+: three more, which the identity never reads (the backend comes from mxfp4_backend)
    (("mxfp4_backend", "layer", "w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
      "w13_bias", "w2_bias", "_cache_permute_indices", "activation", "use_separated_a4w4", "activation_key"),))
SETUP_KERNEL = compat.Symbol("Mxfp4MoEMethod._setup_kernel", "vllm.model_executor.layers.quantization.mxfp4",
                             "Mxfp4MoEMethod._setup_kernel",
                             ("self", "layer", "w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias"))
# Where the wrapper is installed: the name `_setup_kernel` looks up at call time.
PATCH_MODULE = SETUP_KERNEL.module
PATCH_ATTR = CONVERT.qualname


@dataclass
class ExpertTag:
    """Marks a RoutedExperts module whose four expert tensors were loaded in kernel layout."""

    prefix: str
    moe_variant: str
    layout: dict[str, str]
    data_ptrs: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the files' (kernel) shapes
    relayout_calls: int = 0


def make_relayout_wrapper(original):
    sig = inspect.signature(original)

    def convert_weight_to_mxfp4_moe_kernel_format(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        layer = bound.arguments.get("layer")
        tag: ExpertTag | None = getattr(layer, TAG_ATTR, None)
        if tag is None:
            return original(*args, **kwargs)
        backend = backend_name(bound.arguments.get("mxfp4_backend"))
        if backend != tag.moe_variant:
            raise ShimError(f"MoE backend resolved to {backend} on layer {tag.prefix}; files require "
                            f"{tag.moe_variant} (--moe-backend {MOE_BACKEND}, unset VLLM_USE_B12X_MOE)")
        a = bound.arguments
        for name in EXPERT_TENSORS:
            t = a.get(name)
            want = tag.data_ptrs.get(name)
            if want is not None and (t is None or t.data_ptr() != want):
                raise ShimRuntimeError(f"expert tensor {tag.prefix}.{name} reached the re-layout step with other "
                                       f"storage than the loader filled; vLLM's post-load path changed, this build "
                                       f"is not supported")
        tag.relayout_calls += 1
        kernel = {name: a[name].data.view(tag.shapes.get(name, a[name].shape)) for name in EXPERT_TENSORS}
        logger.debug("lucifer_tp3: %s: experts loaded in kernel layout, re-layout skipped", tag.prefix)
        return (kernel["w13_weight"], kernel["w2_weight"], kernel["w13_weight_scale"], kernel["w2_weight_scale"],
                a.get("w13_bias"), a.get("w2_bias"))

    convert_weight_to_mxfp4_moe_kernel_format.__lucifer_wrapped__ = original
    convert_weight_to_mxfp4_moe_kernel_format.__wrapped__ = original
    return convert_weight_to_mxfp4_moe_kernel_format


def install() -> None:
    mod = importlib.import_module(PATCH_MODULE)
    current = getattr(mod, PATCH_ATTR)
    if getattr(current, "__lucifer_wrapped__", None) is not None:
        return
    oracle = compat.unwrap(compat.resolve(CONVERT))
    if compat.unwrap(current) is not oracle:
        raise RuntimeError(f"{PATCH_MODULE}.{PATCH_ATTR} is not the oracle function")
    setattr(mod, PATCH_ATTR, make_relayout_wrapper(current))


WRAPPER = compat.Wrapper(
    name=RELAYOUT,
    symbols=(CONVERT, SETUP_KERNEL),
    process="worker",
    does="identity re-layout for MoE layers whose experts the loader filled in kernel layout",
    why="the files already hold FlashInfer's kernel layout; laying them out again would scramble them",
    remove_when="vLLM accepts experts in kernel layout from a loader (a pre-laid-out flag)",
    upstream="https://github.com/vllm-project/vllm/blob/v0.34.0/vllm/model_executor/layers/quantization/mxfp4.py",
    read_in_diff="the FlashInfer CUTLASS MXFP4 x MXFP8 branch of the conversion must be unchanged, and "
                 "`_setup_kernel` must still look the conversion function up by its module-level name at call "
                 "time (the wrapper replaces that name)",
    install=install,
)
