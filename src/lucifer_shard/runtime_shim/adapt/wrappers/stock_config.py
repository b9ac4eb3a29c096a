"""Stock virtual TP, engine process (stock releases): wraps `EngineArgs.create_engine_config`.

For lucifer_tp3 outputs on a padded plan the target's hf config gets the manifest's padded heads,
output groups and expert width through a callable `hf_overrides` (`stock_vtp.pad_config`, bound with
`functools.partial` so that it pickles into the engine core); vLLM composes a callable override into
the draft's config itself (`SpeculativeConfig.compose_draft_hf_overrides`), so the MTP draft is padded
by the same call. The resulting config is then checked (`stock_vtp.stock_problems`).
"""
from __future__ import annotations

import functools
from pathlib import Path

from lucifer_shard.model.runtimes import LOAD_FORMAT, STOCK_CONFIG

from .. import compat
from ...errors import ShimError
from ...manifest import manifest_path, needs_virtual_tp, open_output
from ..lucifer_tuple import tp_mismatch
from ..stock_vtp import pad_config, padding, stock_problems

CREATE_ENGINE_CONFIG = compat.Symbol("EngineArgs.create_engine_config", "vllm.engine.arg_utils",
                                     "EngineArgs.create_engine_config", ("self", "usage_context", "headless"))


def make_engine_config_wrapper(original):
    """`EngineArgs.create_engine_config` with the manifest's padding for lucifer_tp3 outputs."""

    def create_engine_config(self, usage_context=None, headless=False):
        if str(getattr(self, "load_format", "")).lower() != LOAD_FORMAT:
            return original(self, usage_context, headless)
        out = Path(self.model)
        output = open_output(out)
        manifest = output.manifest
        mismatch = tp_mismatch(manifest, self.tensor_parallel_size)
        if mismatch:
            raise ShimError(mismatch)
        if needs_virtual_tp(manifest):
            want = functools.partial(pad_config, padding=padding(output))
            current = self.hf_overrides
            if current and not _is_ours(current, want):
                raise ShimError(f"--hf-overrides {current!r} with --load-format {LOAD_FORMAT}: the model must be the "
                                f"config the rank files were converted from (the padding comes from "
                                f"{manifest_path(out)}); drop --hf-overrides")
            self.hf_overrides = want
        vllm_config = original(self, usage_context, headless)
        problems = stock_problems(vllm_config, output)
        if problems:
            raise ShimError(f"--load-format {LOAD_FORMAT} on this vLLM cannot serve {out}: "
                            + "; ".join(problems))
        return vllm_config

    create_engine_config.__lucifer_wrapped__ = original
    create_engine_config.__wrapped__ = original
    return create_engine_config


def _is_ours(current, want: functools.partial) -> bool:
    return (isinstance(current, functools.partial) and current.func is want.func
            and current.keywords == want.keywords)


WRAPPER = compat.Wrapper(
    name=STOCK_CONFIG,
    symbols=(CREATE_ENGINE_CONFIG,),
    process="engine",
    does="with lucifer_tp3 on a padded plan, gives the target's and the draft's hf configs the manifest's padded "
         "heads, output groups and expert width (a callable hf_overrides, which vLLM composes into the draft's) "
         "and checks the result: the stock tuple for the output's arch, the padding on both configs",
    why="stock vLLM has no virtual TP: 64 heads and a 2048-wide expert do not divide by 3",
    remove_when="upstream vLLM pads DeepSeek-V4's heads, groups and experts for uneven TP (vllm-project/vllm#52435)",
    upstream="https://github.com/vllm-project/vllm/blob/v0.34.0/vllm/engine/arg_utils.py",
    read_in_diff="`hf_overrides` must still reach `ModelConfig` before its checks (DeepSeek-V4's \"heads must "
                 "divide by TP\" check in `config/model.py`); the MTP draft's config must still be derived through "
                 "`SpeculativeConfig.compose_draft_hf_overrides` (so the draft gets the padding too); no new check "
                 "on TP, heads or the load format may be added there; the parameters must be unchanged. New keyword "
                 "arguments passed to unrelated configs (cache, scheduler) are harmless",
    install=lambda: compat.replace(CREATE_ENGINE_CONFIG, make_engine_config_wrapper),
)
