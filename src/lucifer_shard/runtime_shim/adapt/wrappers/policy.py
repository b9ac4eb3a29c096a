"""The fork's virtual-TP policy (mlow/vllm builds): wraps `vllm.config.virtual_tp.maybe_apply_b12x_virtual_tp_padding`.

With `--load-format lucifer_tp3` it accepts exactly the Lucifer tuple, builds the plan with the fork's
own `apply_b12x_virtual_tp_padding_to_model_config` (no B12X backend gate) and checks the plan equals
the manifest's. With any other load format the Lucifer tuple is refused (the stock MXFP4 loader
mis-slices W2); everything else goes to the original unchanged.
"""
from __future__ import annotations

import importlib
import logging
from pathlib import Path

from lucifer_shard.model.runtimes import ATTENTION_BACKEND, LOAD_FORMAT, MOE_BACKEND, POLICY, REPOSITORY

from .. import compat
from lucifer_shard.errors import SERVE

from ...errors import ShimError
from ...manifest import compare_plan, load_manifest, manifest_path
from ..lucifer_tuple import is_lucifer_request, load_format, model_dir, runtime_plan, tuple_problems

logger = logging.getLogger("lucifer_shard.runtime_shim")

MAYBE_APPLY = compat.Symbol("maybe_apply_b12x_virtual_tp_padding", "vllm.config.virtual_tp",
                            "maybe_apply_b12x_virtual_tp_padding", ("vllm_config",))
APPLY = compat.Symbol("apply_b12x_virtual_tp_padding_to_model_config", "vllm.config.virtual_tp",
                      "apply_b12x_virtual_tp_padding_to_model_config", ("model_config", "parallel_config"))


def make_policy_wrapper(original, apply_to_model_config):
    def maybe_apply_b12x_virtual_tp_padding(vllm_config):
        mc = getattr(vllm_config, "model_config", None)
        if mc is None:
            return original(vllm_config)
        lf = load_format(vllm_config)
        if lf != LOAD_FORMAT:
            if is_lucifer_request(vllm_config):
                raise ShimError(
                    f"DeepSeek-V4 at tensor_parallel_size {vllm_config.parallel_config.tensor_parallel_size} with "
                    f"{ATTENTION_BACKEND} + {MOE_BACKEND} needs virtual TP, which is only supported with "
                    f"--load-format {LOAD_FORMAT} (found --load-format {lf}; the stock MXFP4 loader mis-slices W2)",
                    SERVE.at(out="OUT").after("convert the checkpoint into OUT"))
            return original(vllm_config)
        out = Path(model_dir(mc))
        manifest = load_manifest(out)
        problems = tuple_problems(vllm_config, manifest)
        if problems:
            raise ShimError(f"--load-format {LOAD_FORMAT} serves only the Lucifer tuple; found " + "; ".join(problems))
        apply_to_model_config(mc, vllm_config.parallel_config)
        diff = compare_plan(runtime_plan(mc), manifest.plan)
        if diff:
            raise ShimError(f"{diff}; check B12X_MOE_FORCE_A8 / NVFP4 env and that {out} was converted for "
                            f"this model with --tp {manifest.tp_size}")
        logger.info("lucifer_tp3: virtual-TP plan applied and equal to %s", manifest_path(out))

    maybe_apply_b12x_virtual_tp_padding.__lucifer_wrapped__ = original
    maybe_apply_b12x_virtual_tp_padding.__wrapped__ = original
    return maybe_apply_b12x_virtual_tp_padding


def install() -> None:
    mod = importlib.import_module(APPLY.module)
    compat.replace(MAYBE_APPLY, lambda current: make_policy_wrapper(current, mod.apply_b12x_virtual_tp_padding_to_model_config))


WRAPPER = compat.Wrapper(
    name=POLICY,
    symbols=(MAYBE_APPLY, APPLY),
    process="engine",
    does="with lucifer_tp3, accepts exactly the Lucifer tuple, applies the fork's plan without its B12X gate "
         "and checks it equals the manifest's; refuses the tuple with any other load format",
    why="the fork pads only for its B12X backends, and its stock loader mis-slices packed FP4 W2",
    remove_when="the fork's loader slices packed FP4 in storage units and its plan accepts FlashInfer CUTLASS",
    upstream=f"{REPOSITORY}/blob/45c1582e9/vllm/config/virtual_tp.py",
    read_in_diff="the fork's plan function must still take (model_config, parallel_config), write "
                 "`vllm_virtual_tp_plan` on the hf text config and pad heads, o_groups and moe_intermediate_size "
                 "keeping `original_<key>`; the policy must still be the one call that decides whether to pad",
    install=install,
)
