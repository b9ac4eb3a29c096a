"""The serving run's measurement of vLLM's post-load step, in every Python process it starts (test harness
only: tests/gpu/serve_run.py puts this folder first on PYTHONPATH of its servers).

With LUCIFER_PWAL_LOG=DIR, once vLLM's modules are imported:

* `Mxfp4MoEMethod.process_weights_after_loading` (one MXFP4 MoE layer's post-load step: vLLM's re-layout
  into FlashInfer CUTLASS's layout, or the plugin's identity for kernel-layout layers, and the kernel build)
  is timed per layer, the GPU synchronised on both sides;
* the whole post-load step (`process_weights_after_loading(model, ...)` as `BaseModelLoader.load_model`
  calls it) is timed, with the GPU memory allocated before it and the peak during it (the peak counter
  reset first), which is where a re-layout's transient copies show.

Each process appends JSON lines to DIR/<pid>.jsonl. Nothing is changed in what vLLM computes.

With FLASHINFER_W4A16_TRIM=1 (the shared/gpu kit: FlashInfer 0.7.2.post1 whose only module is the prebuilt
SM90 MXFP4 x BF16 CUTLASS MoE, JIT off), the kit's own sitecustomize runs (Python loads one only), and the
vLLM modules that would take other kernels from FlashInfer when it is importable (FLASHINFER_ELSEWHERE:
the logits' top-k, DeepSeek's scaling RoPE, the MLA k-concat, the indexer's opt-in top-k) see no FlashInfer,
so they run vLLM's own kernels, as in a run without FlashInfer: those kernels are not in the kit, the MoE is
what the run compares, and every server of the run has the same fallback.

With LUCIFER_ONE_GPU_TP=1 (tests/gpu/tp_run.py, for its servers of TP > 1 on one GPU; its docstring says
why each): every worker takes device 0 (`ParallelConfig.get_local_gpu_index`), and vLLM's distributed
backend on CUDA is gloo, not NCCL (`CudaPlatformBase.dist_backend`).
"""
import importlib.abc
import importlib.util
import json
import os
import sys
import time

if os.environ.get("FLASHINFER_W4A16_TRIM") == "1":  # the kit's own sitecustomize
    try:
        import fi_trim

        fi_trim.install()
    except Exception as exc:  # never break interpreter start-up
        print(f"[w4a16-trim] not installed: {exc!r}")

LOG = os.environ.get("LUCIFER_PWAL_LOG")
TRIM = os.environ.get("FLASHINFER_W4A16_TRIM") == "1"
FLASHINFER_ELSEWHERE = ("vllm.model_executor.layers.logits_processor",
                        "vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope",
                        "vllm.model_executor.layers.attention.mla_attention",
                        "vllm.model_executor.layers.attention.sparse_mla_attention",
                        "vllm.model_executor.layers.indexer_topk")
ONE_GPU = os.environ.get("LUCIFER_ONE_GPU_TP") == "1"
MOE_MODULE = "vllm.model_executor.layers.quantization.mxfp4"
PARALLEL_MODULE = "vllm.config.parallel"
CUDA_PLATFORM_MODULE = "vllm.platforms.cuda"
LOADER_MODULE = "vllm.model_executor.model_loader.base_loader"


def _write(record: dict) -> None:
    os.makedirs(LOG, exist_ok=True)
    with open(os.path.join(LOG, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_moe_layer(original):
    def process_weights_after_loading(self, layer):
        _sync()
        t = time.perf_counter()
        original(self, layer)
        _sync()
        _write({"what": "moe_layer", "backend": getattr(getattr(self, "mxfp4_backend", None), "name", None),
                "tagged": hasattr(layer, "_lucifer_tp3_tag"), "ms": (time.perf_counter() - t) * 1e3})

    return process_weights_after_loading


def _time_post_load(original):
    def process_weights_after_loading(model, model_config, target_device):
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t = time.perf_counter()
        original(model, model_config, target_device)
        if cuda:
            torch.cuda.synchronize()
        rec = {"what": "post_load", "s": time.perf_counter() - t}
        if cuda:
            rec.update(allocated_before=before, peak=torch.cuda.max_memory_allocated(),
                       allocated_after=torch.cuda.memory_allocated())
        _write(rec)

    return process_weights_after_loading


PATCHES = {}
if LOG:
    PATCHES[MOE_MODULE] = lambda m: setattr(m.Mxfp4MoEMethod, "process_weights_after_loading",
                                            _time_moe_layer(m.Mxfp4MoEMethod.process_weights_after_loading))
    PATCHES[LOADER_MODULE] = lambda m: setattr(m, "process_weights_after_loading",
                                               _time_post_load(m.process_weights_after_loading))
if ONE_GPU:
    PATCHES[PARALLEL_MODULE] = lambda m: setattr(m.ParallelConfig, "get_local_gpu_index",
                                                 lambda self, local_rank, dp_local_rank=None: 0)
    PATCHES[CUDA_PLATFORM_MODULE] = lambda m: setattr(m.CudaPlatformBase, "dist_backend", "gloo")
if TRIM:
    for _name in FLASHINFER_ELSEWHERE:
        PATCHES[_name] = lambda m: setattr(m, "has_flashinfer", lambda: False)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each module of PATCHES right after it executes."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if PATCHES:
    sys.meta_path.insert(0, _Finder())
