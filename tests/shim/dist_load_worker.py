"""3 processes, vLLM's own parallel state on gloo (CPU, TP=3): each loads its rank with the shim.

Usage: python dist_load_worker.py OUT PORT RESULTS_DIR   (writes RESULTS_DIR/rank-<r>.json)
OUT may hold `{rank}`: each process reads its own directory (a node's share, lucifer-shard stage). A rank
the loader refuses reports the refusal under "error" and loads nothing more.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(rank: int, out: str, port: int, results: str) -> None:
    t0 = time.time()
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    import shim_fixtures as sf

    load_general_plugins()  # vLLM's own plugin discovery registers lucifer_tp3 in this process
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        ps.init_distributed_environment(world_size=3, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.ensure_model_parallel_initialized(3, 1)
        tp_rank = ps.get_tensor_model_parallel_rank()
        out_p = Path(out.replace("{rank}", str(rank)))
        man = sf.manifest(out_p)
        loader = get_model_loader(LoadConfig(load_format="lucifer_tp3",
                                             model_loader_extra_config={"verify": "full"}))
        report = {"rank": rank, "tp_rank": tp_rank, "tp_size": ps.get_tensor_model_parallel_world_size(),
                  "loader": type(loader).__module__ + "." + type(loader).__name__}
        for role in ("target", "draft"):
            model = sf.build_model(man, role, rank=tp_rank)
            loader.loaded.clear()
            try:
                loader.load_weights(model, sf.model_config(out_p))
            except ValueError as e:  # the loader's refusal (ShimError): reported, and this rank loads no more
                report["error"] = str(e)
                break
            n = sf.assert_byte_exact(model, sf.file_tensors(out_p, man, role, tp_rank))
            report[role] = {"tensors": n, "files": sorted(set(loader.loaded.values())),
                            "params": {k: [list(v.shape), str(v.dtype)] for k, v in model.named_parameters()
                                       if "attn_sink" in k or "w2_weight_scale" in k}}
        else:
            import torch.distributed as dist

            gathered = [None] * 3
            dist.all_gather_object(gathered, tp_rank, group=ps.get_tp_group().cpu_group)
            report["all_ranks"] = gathered
            report["hooks"] = loader.hooks_called
            report["seconds"] = round(time.time() - t0, 2)
        Path(results, f"rank-{rank}.json").write_text(json.dumps(report))
        # also after a refusal: a refused rank that left its gloo group to the exit once died in std::terminate
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


if __name__ == "__main__":
    out, port, results = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(worker, args=(out, port, results), nprocs=3, join=True)
