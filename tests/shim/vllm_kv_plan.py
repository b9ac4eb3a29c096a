"""vLLM's own KV-cache plan for a DeepSeek-V4 config, computed on this CPU (the check of model/boxfit.py).

    python vllm_kv_plan.py SPEC.json

SPEC = {"model": DIR (its config.json), "engine": {EngineArgs overrides}, "draft_class"?: DOTTED,
        "capability": [major, minor], "memory": [BYTES, ...], "max_model_len": [TOKENS, ...]}

Builds the model as a worker does (`vllm_cpu_model`'s machine checks replaced, the NVIDIA classes told the
GPU's capability) on the meta device, so that no weight is allocated: the full-size config costs no memory.
With "draft_class", the draft model vLLM's speculative config derives is built beside it. Then vLLM's own
steps from `EngineCore._initialize_kv_caches` (v1/engine/core.py:320-350): every layer's spec
(`v1/worker/gpu/attn_utils.get_kv_cache_spec`), the layout the backends support, the groups
(`get_global_kv_cache_groups`), and per memory and --max-model-len `get_kv_cache_configs` and
`get_kv_cache_capacity` (the "GPU KV cache size" line). Prints one JSON object: the groups (block size,
page bytes, window), `max_in_flight_tokens`, and per (memory, max_model_len) the blocks and tokens.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # before vLLM resolves its platform


def main(spec: dict) -> dict:
    import importlib

    import torch

    import vllm_cpu_model as vcm

    vcm.CAPABILITY[:] = spec.get("capability", vcm.SM120)
    vcm.allow_construction_on_this_cpu()
    # Harness-only: the planner's inputs as a GPU's. vLLM's CPU platform keeps chunked prefill for DeepSeek-V4
    # only where the CPU has AMX tiles (platforms/cpu.py, check_and_update_config: `amx_mla_or_dsv4_enabled`);
    # elsewhere it sets max_num_batched_tokens to max_model_len, so the tokens in flight, and the KV figures,
    # would be the test machine's CPU's. The GPU platform has no such rule: told AMX is there, the CPU
    # platform leaves the engine's max_num_batched_tokens as given, whatever this CPU has.
    torch.cpu._is_amx_tile_supported = lambda: True
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts, record_kv_cache_layout,
                                                   resolve_kv_cache_layout)
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    cfg = EngineArgs(model=spec["model"], tensor_parallel_size=1, dtype="bfloat16", enforce_eager=True,
                     skip_tokenizer_init=True, load_format="dummy", max_model_len=max(spec["max_model_len"]),
                     **spec["engine"]).create_engine_config()
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{vcm.free_port()}")
        ps.ensure_model_parallel_initialized(1, 1)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("meta"):
            initialize_model(vllm_config=cfg, model_config=cfg.model_config)
            if spec.get("draft_class"):
                module, _, name = spec["draft_class"].rpartition(".")
                initialize_model(vllm_config=cfg, model_config=cfg.speculative_config.draft_model_config,
                                 model_class=getattr(importlib.import_module(module), name))
        specs = get_kv_cache_spec(cfg)
        names = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(cfg))]
        record_kv_cache_layout(cfg.cache_config, resolve_kv_cache_layout(cfg, [names], list(specs.values())).name)
        groups = get_global_kv_cache_groups(cfg, [specs])
        pools = []
        for max_model_len in spec["max_model_len"]:
            cfg.model_config.max_model_len = max_model_len
            for memory in spec["memory"]:
                config = get_kv_cache_configs(cfg, [specs], [memory], groups)[0]
                tokens, _ = get_kv_cache_capacity(cfg, config)
                pools.append({"memory": memory, "max_model_len": max_model_len, "blocks": config.num_blocks,
                              "tokens": tokens})
    return {"cache_dtype": cfg.cache_config.cache_dtype, "layers": len(specs),
            "in_flight": cfg.max_in_flight_tokens, "pools": pools,
            "groups": sorted([g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes,
                              getattr(next(iter(g.kv_cache_spec.kv_cache_specs.values())), "sliding_window", None)]
                             for g in groups)}


if __name__ == "__main__":
    print("KV-PLAN " + json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))))
