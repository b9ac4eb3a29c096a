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

from lucifer_shard.spec.layouts import EXPERT_TENSORS

from .. import compat
from ..configview import backend_name
from ..errors import ShimError, ShimRuntimeError
from ..patches import MOE_BACKEND, TAG_ATTR, ExpertTag, logger

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

_FORK_SETUP_KERNEL = "sha256:c0affd064e176be46068a4bf65c8a9a72da33bae8faab50fae29f23c5ba47a86"
# cece381c4 and 81564374e share every vetted function
_FORK_FF = {CONVERT.key: "sha256:450a446ab3afb7d3626aa9870434b54f318e01984b3ceede81a87f4abc63b4f0",
            SETUP_KERNEL.key: _FORK_SETUP_KERNEL}
HASHES = {
    "45c1582e9": {CONVERT.key: "sha256:ee8705dcabd3eec6a0b27b9a3f721de8b496a7c9bcd75a045477f2abc58c3acd",
                  SETUP_KERNEL.key: _FORK_SETUP_KERNEL},
    "cece381c4": _FORK_FF,
    "81564374e": _FORK_FF,
    # 0.34.0 changed both only in their Humming and Triton branches (docs/vllm-releases.md, Record)
    "0.34.0": {CONVERT.key: "sha256:2a7916b08841b51c9d770588ee56fd36569d2c5b389f7a02f384c7f6fbb96c99",
               SETUP_KERNEL.key: "sha256:64874c8a1b11399cfa3ac93aefbd3572269354f05727e08f50b8bcfecf8c9826"},
    # 0.33.0's re-layout: its FlashInfer-CUTLASS branch is the forks' (swap, then the 128x4 swizzle or the SM90
    # interleaves) behind three new pass-through parameters; _setup_kernel checks the 3-D shapes, calls it,
    # replace_parameter()s the result onto the same parameters and builds the kernel from them
    "0.33.0": {CONVERT.key: "sha256:171d153b1ce8445d970d97a3ced3238cbb6dd76300dc9990ae3fee3d50b1391e",
               SETUP_KERNEL.key: "sha256:447956c52e78fb61ca47c8664b2e0efb5fc03c06694a8120c34ff403c2aa5127"},
}


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
    name=compat.RELAYOUT,
    symbols=(CONVERT, SETUP_KERNEL),
    process="worker",
    does="identity re-layout for MoE layers whose experts the loader filled in kernel layout",
    why="the files already hold FlashInfer's kernel layout; laying them out again would scramble them",
    remove_when="vLLM accepts experts in kernel layout from a loader (a pre-laid-out flag)",
    upstream="https://github.com/vllm-project/vllm/blob/v0.34.0/vllm/model_executor/layers/quantization/mxfp4.py",
    read_in_diff="the FlashInfer CUTLASS MXFP4 x MXFP8 branch of the conversion must be unchanged, and "
                 "`_setup_kernel` must still look the conversion function up by its module-level name at call "
                 "time (the wrapper replaces that name)",
    hashes=HASHES,
    install=install,
)
