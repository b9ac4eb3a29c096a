"""Stock virtual TP, worker processes (stock releases): wraps `VocabParallelEmbedding.__init__`
(ParallelLMHead's too), so the vocabulary layers of a lucifer_tp3 model on a padded plan pad to
`lcm(64, tp)`, which must give the manifest's padded vocabulary.
"""
from __future__ import annotations

import inspect
import math

from lucifer_shard.model.runtimes import LOAD_FORMAT, STOCK_VOCAB

from .. import compat
from lucifer_shard.errors import CONVERT_AGAIN

from ...errors import ShimError
from ..stock_vtp import applied

VOCAB_INIT = compat.Symbol(
    "VocabParallelEmbedding.__init__", "vllm.model_executor.layers.vocab_parallel_embedding",
    "VocabParallelEmbedding.__init__",
    ("self", "num_embeddings", "embedding_dim", "params_dtype", "org_num_embeddings", "padding_size",
     "quant_config", "prefix", "disable_tp", "reduce_results", "quant_method", "parallel_group"))


def vocab_padded(num_embeddings: int) -> int | None:
    """The manifest's padded vocabulary when the layer being built is the vocabulary of a lucifer_tp3
    model that `stock_vtp.pad_config` padded; None for every other layer and model."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    load = getattr(getattr(cfg, "load_config", None), "load_format", None)
    if cfg is None or str(load).lower() != LOAD_FORMAT or cfg.model_config is None:
        return None
    pad = applied(cfg.model_config)
    if pad is None or int(num_embeddings) != pad["vocab"][0]:
        return None
    return pad["vocab"][1]


def make_vocab_wrapper(original):
    """`VocabParallelEmbedding.__init__` (ParallelLMHead's too) padding to lcm(padding_size, tp)."""
    sig = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        want = vocab_padded(a["num_embeddings"])
        if want is not None and not a["disable_tp"]:
            from vllm.distributed import get_tensor_model_parallel_world_size
            from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size

            group = a["parallel_group"]
            tp = group.world_size if group is not None else get_tensor_model_parallel_world_size()
            size = a["org_num_embeddings"] or a["num_embeddings"]
            step = math.lcm(int(a["padding_size"]), tp)
            if pad_vocab_size(size, step) != want:
                raise ShimError(f"vocabulary {size} padded to a multiple of {step} is {pad_vocab_size(size, step)}, "
                                f"the rank files hold {want} rows: converted for another TP size", CONVERT_AGAIN)
            a["padding_size"] = step
        return original(*bound.args, **bound.kwargs)

    __init__.__lucifer_wrapped__ = original
    __init__.__wrapped__ = original
    return __init__


WRAPPER = compat.Wrapper(
    name=STOCK_VOCAB,
    symbols=(VOCAB_INIT,),
    process="worker",
    does="pads the vocabulary layers of a lucifer_tp3 model on a padded plan to lcm(64, tp) (129408 at TP3), "
         "keeping org_vocab_size so logits stay sliced to the real vocabulary",
    why="VocabParallelEmbedding pads to 64 only, and 129280 does not divide by 3",
    remove_when="upstream vLLM pads the vocabulary to a multiple of the TP size (as sglang did, sgl-project/sglang#31801)",
    upstream="https://github.com/vllm-project/vllm/blob/v0.34.0/vllm/model_executor/layers/vocab_parallel_embedding.py",
    read_in_diff="`padding_size` must still decide the padded vocabulary (`pad_vocab_size`), `org_vocab_size` must "
                 "still be kept (logits are sliced to it) and the per-rank shard must still be the padded size "
                 "divided by TP",
    install=lambda: compat.replace(VOCAB_INIT, make_vocab_wrapper),
)
