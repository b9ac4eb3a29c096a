"""The kernels stock vLLM will ask for on the GPU family an output is served on, read before a start from vLLM's
and FlashInfer's own tables (no GPU needed): on the SM120 family (RTX PRO 6000, RTX 5090, DGX Spark's GB10)
vLLM 0.34.0's DeepseekV4FlashInferSM120Attention raises in its __init__, after vLLM's import and engine set-up on
every box, unless FlashInfer's DSV4 sparse-MLA decode dispatch admits the rank's query heads, padded to the
kernel's next size, and the top_k its sliding window (with a DSpark draft: window + k, rounded up) implies.
doctor and `serve --dry-run` say so first, with the fix. Imports vLLM inside the function, as doctor does."""
from __future__ import annotations

import json

from lucifer_shard.guarded_io import JSON_LIMIT, read_regular
from lucifer_shard.model.arches import ARCH
from lucifer_shard.model.config import DSPARK

from ..checks import FAIL, OK, WARN, Check, out_check
from ..manifest import Output, draft_kind, draft_tokens

NAME = "output SM12x attention kernel"
FIX = ("install a FlashInfer whose flashinfer.mla._sparse_mla_sm120 DSV4 decode dispatch admits it (flashinfer-python "
       "0.7.4 does: heads up to its maximum, any top_k from its minimum), as vLLM's own check "
       "(vllm/utils/flashinfer.has_flashinfer_sparse_mla_sm120_config) asks")


def sparse_mla_checks(output: Output, arch: str | None, draft: bool, tokens: int | None = None) -> list[Check]:
    """Whether FlashInfer's DSV4 decode dispatch admits what vLLM's SM120 attention will ask for, on `arch` (this
    GPU's family; None: OUT's --arch), for the target and, with `draft`, the DSpark draft's k (`tokens`, else the
    manifest's). Nothing where the family's attention needs no such kernel."""
    m = output.manifest
    family = ARCH.get(arch or m.arch or "")
    if family is None or not family.sparse_mla_dispatch:
        return []
    try:
        from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import pad_to_supported_q_heads
        from vllm.utils.flashinfer import has_flashinfer_sparse_mla_sm120_config
        from vllm.v1.attention.backends.mla.compressor_utils import get_dspark_swa_index_width
    except ImportError as e:  # another vLLM line: its own start checks, with its own words
        return [out_check(NAME, WARN, f"this vLLM has no DeepSeek-V4 SM120 attention requirement to read ({e})",
                          "serve on a vetted stock release (lucifer-shard doctor lists them)")]
    heads = m.plan.axes["heads"].local
    padded = pad_to_supported_q_heads(heads)
    window = json.loads(read_regular(output.path / "config.json", JSON_LIMIT, follow=False))["sliding_window"]
    wanted = [("the target", window)]
    if draft and draft_kind(m) == DSPARK:
        k = tokens or draft_tokens(m)
        wanted.append((f"the DSpark draft, k={k}", get_dspark_swa_index_width(window, k)))
    checks = []
    for what, top_k in wanted:
        shape = f"{heads} heads per rank padded to {padded}, top_k {top_k} ({what}, {family.name})"
        if has_flashinfer_sparse_mla_sm120_config(padded, top_k):
            checks.append(out_check(NAME, OK, f"FlashInfer's DSV4 sparse-MLA decode admits {shape}"))
        else:
            checks.append(out_check(NAME, FAIL, f"FlashInfer's DSV4 sparse-MLA decode dispatch does not admit {shape}: "
                                    f"vLLM's SM120 attention would refuse to start", FIX))
    return checks
