"""vLLM's own DeepSeek-V4 models, built on this CPU, one process per TP rank on gloo, and loaded.

The real-model harness of the shim suite (`test_real_model.py`, `test_fork_model.py`) and of the
load benchmark (`bench/load.py`). Each rank process builds the model class vLLM itself selects,
exactly as a vLLM worker does (`EngineArgs(...).create_engine_config()`,
`init_distributed_environment(backend="gloo")`, `ensure_model_parallel_initialized`,
`initialize_model` under the model's dtype and device), and per run of the spec loads a fresh model
with the run's loader through `loader.load_weights`: everything `BaseModelLoader.load_model` does
before `process_weights_after_loading`.

    python vllm_cpu_model.py SPEC.json

SPEC = {"tp": N, "results": DIR, "engine"?: {EngineArgs overrides}, "dump"?: [SUBSTRING, ...],
        "runs": [{"name", "model", "load_format", "extra"?, "engine"?, "role"?: "draft", "capability"?: [9, 0],
                  "model_class"?: DOTTED, "plan"?: "fork-helper", "files"?: ROLE_DIR,
                  (a "model" holding "{rank}" names each rank's own directory: a node's share)
                  "compare_to"?: RUN_NAME, "capture"?: false, "save_sharded"?: DIR, "post_load"?: true,
                  "moe_post_load"?: true}, ...]}

Each rank writes DIR/rank-<r>.json with, per run, the model class, the live virtual-TP plan (the fork's
plan or the plugin's stock padding) and the config sizes the layers were built from, every
parameter (shape, dtype, blake3), the construction and load times, what the load cost this process
(CPU seconds, /proc/self/io read_bytes and rchar, peak RSS during the load), or the one-line error
the configuration or load raised; with "compare_to", the parameters that differ from that run's
(first differing byte); with "moe_post_load", vLLM's own post-load step of every MXFP4 MoE layer run
after the load (`moe_post_load`), then the loader's checks after it; with "files", the run's rank-file
tensors compared with the loaded (and so processed) parameters; with "dump", the matching parameters as DIR/rank-<r>-<run>.safetensors. "capture":
false keeps nothing of the loaded model (no digests: the load benchmark must not hold a second
copy); "save_sharded" writes the loaded model with vLLM's `ShardedStateLoader.save_model`; "post_load"
then runs vLLM's own post-load step (`vllm_post_load`) and records how often each post-load hook ran,
the loader's replay included ("hook_calls"). The
pseudo load format "floor" builds no model: each rank reads its own rank files (ROLE_DIR/rank-<r>,
from "files") once, the floor of a load.

`run_world(spec, hook)` (the load benchmark) times every run on all ranks at once: all ranks wait
at a barrier while rank 0 calls `hook.before_load(run)` (evict the page cache, wait for a quiet
machine), load together, and rank 0 calls `hook.after_load(run)` once all have finished; what the
hook returns is recorded in rank 0's report.

Which vLLM runs is whatever `import vllm` finds: the vllm==0.33.0 venv (its DeepSeek-V4 CPU class
under VLLM_TARGET_DEVICE=cpu; its NVIDIA MTP class named by "model_class", the CPU one being a
stub), or the mlow/vllm fork's Python source put first on PYTHONPATH by tools/fork-overlay.sh (its
NVIDIA classes: the fork has no CPU model). The checks vLLM makes about the machine, not the model,
are replaced here and nowhere in the product (`allow_construction_on_this_cpu`); none changes which
parameters a layer creates, their shapes, dtypes or how they are loaded. No forward pass is run.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

MAX_MODEL_LEN = 256  # sizes only the model's scratch buffers (topk indices); weights do not depend on it
# The Lucifer tuple, for the NVIDIA classes: their DSv4 attention needs the fp8_ds_mla KV cache (the CUDA platform
# picks it by default, the CPU platform does not).
NVIDIA_ENGINE = {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4", "moe_backend": "flashinfer_cutlass",
               "kv_cache_dtype": "fp8"}
SM120 = (12, 0)  # the GPU the Lucifer tuple targets
CAPABILITY = list(SM120)  # what the NVIDIA classes are told the GPU is, per run ("capability" in the spec)
FLOOR = "floor"  # the pseudo load format: read the rank files once, build no model
HF_SIZES = ("num_attention_heads", "o_groups", "moe_intermediate_size", "vocab_size")  # what vLLM sizes the layers by


def allow_construction_on_this_cpu() -> None:
    """Harness-only: let vLLM build DeepSeek-V4 models on this CPU (no AMX tiles, no CUDA).

    Each replaced check is about the machine, not the model: it refuses before any parameter exists,
    or picks the class an SM120 GPU would get."""

    from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm_cpu
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe, flashinfer_cutlass_moe, marlin_moe
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    # The FP8 block-scaled linear kernel (fused_wqa_wkv, wq_b, wo_a, wo_b, shared experts) is the only
    # CPU kernel for these layers and refuses a CPU without AMX tiles: Fp8LinearMethod.create_weights
    # raises before any parameter exists.
    scaled_mm_cpu.CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, cc=None: (True, None))
    # Likewise the CPU MXFP4 MoE backend: select_deepseek_v4_mxfp4_moe_backend finds no backend.
    cpu_moe.CPUExpertsMxfp4._supports_current_device = staticmethod(lambda: True)

    # The NVIDIA classes (the fork's only DeepSeek-V4 classes; vLLM 0.33.0's MTP draft, whose CPU
    # class is a stub):
    class StreamStandIn:
        """DeepseekV4Model.__init__ creates three auxiliary CUDA streams, used only in forward."""

        def __init__(self, *args, **kwargs) -> None:
            pass

    torch.cuda.Stream = StreamStandIn
    # They pick the attention class and MoE variant from the GPU capability: at 12.0 the layers create
    # the parameters an SM120 GPU would (attn_sink padded to 32 by DeepseekV4FlashInferSM120Attention,
    # routed width rounded to 128 for the MXFP4 x MXFP8 CUTLASS MoE).
    # A run's "capability" picks another GPU family (9.0: FlashMLA's sink padded to 64).
    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(*CAPABILITY))
    # FlashInferExperts also requires current_platform.is_cuda(); its kernel is never called here. So does
    # MarlinExperts, the MXFP4 MoE stock vLLM runs on SM90 (lucifer-shard serve's choice there).
    flashinfer_cutlass_moe.FlashInferExperts._supports_current_device = staticmethod(lambda: True)
    marlin_moe.MarlinExperts._supports_current_device = staticmethod(lambda: True)
    # b12x's MoE (the SM120-family route of exact-width experts) asks for a CUDA GPU of that family and for
    # its fused-MoE module's own device check; its kernels run only in forward and post-load.
    from vllm.model_executor.layers.fused_moe import b12x as b12x_moe

    b12x_moe.B12xExperts._supports_current_device = staticmethod(lambda: True)
    # vLLM 0.34.0's CPU platform refuses an x86 CPU without Triton (triton-cpu) in check_and_update_config
    # (`vllm/platforms/cpu.py:242-243`, "vLLM on x86 CPUs requires Triton (triton-cpu)."; 0.33.0 only warned),
    # which every config of these worlds passes through. Triton runs CPU kernels of a forward pass, and none
    # runs here: the check sees Triton present for the duration of that call only.
    from vllm.platforms.cpu import CpuPlatform

    check_config = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        import vllm.triton_utils as triton_utils

        has_triton, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
        try:
            check_config(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = has_triton

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


@contextlib.contextmanager
def fork_plan_without_backend_gate():
    """The fork's own virtual-TP plan for a config its policy gate would refuse: its
    `maybe_apply_b12x_virtual_tp_padding` only pads for B12X backends, so the harness lets
    `VllmConfig.__post_init__` call the fork's gate-free `apply_b12x_virtual_tp_padding_to_model_config`
    instead, the helper the fork itself uses for the MTP draft. This is the audit's setup: the fork's
    loaders at the Lucifer tuple once its guard is bypassed."""
    import vllm.config.virtual_tp as vtp

    installed = vtp.maybe_apply_b12x_virtual_tp_padding
    vtp.maybe_apply_b12x_virtual_tp_padding = lambda vc: vtp.apply_b12x_virtual_tp_padding_to_model_config(
        vc.model_config, vc.parallel_config)
    try:
        yield
    finally:
        vtp.maybe_apply_b12x_virtual_tp_padding = installed


def engine_config(spec: dict, run: dict):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=run["model"], tensor_parallel_size=int(spec["tp"]), load_format=run["load_format"],
                      dtype="bfloat16", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
                      model_loader_extra_config=run.get("extra") or {},
                      **{**spec.get("engine", {}), **run.get("engine", {})})
    with fork_plan_without_backend_gate() if run.get("plan") == "fork-helper" else contextlib.nullcontext():
        return args.create_engine_config()


def resolve(dotted: str):
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(t: torch.Tensor) -> str:
    from blake3 import blake3

    return blake3(raw_bytes(t).numpy().tobytes()).hexdigest()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw_bytes(a), raw_bytes(b))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    neq = raw_bytes(a) != raw_bytes(b)
    idx = int(torch.nonzero(neq)[0])
    return (f"byte {idx}: {int(raw_bytes(a)[idx]):#04x} vs {int(raw_bytes(b)[idx]):#04x} "
            f"({int(neq.sum())} of {neq.numel()} bytes differ)")


def proc_io() -> dict[str, int]:
    """This process's I/O counters: `read_bytes`, the bytes it caused to be read from storage (page-cache
    misses, mmap page faults included); `rchar`, the bytes that passed through read calls (mmap not)."""
    counters = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        counters[key] = int(value)
    return counters


def status_bytes(key: str) -> int:
    """A memory figure of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> None:
    """Make VmHWM the current RSS (Linux `clear_refs` 5), so that it reads the peak of what follows."""
    Path("/proc/self/clear_refs").write_text("5")


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rank_files(role_dir: Path, rank: int) -> list[Path]:
    return sorted((role_dir / f"rank-{rank}").glob("*.safetensors"))


def read_once(paths: list[Path], block: int = 16 << 20) -> None:
    """The floor of a load: the files read once, sequentially, in 16 MiB reads into one buffer."""
    view = memoryview(bytearray(block))
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [view]):
                pass
        finally:
            os.close(fd)


def measured_load(rec: dict, run: dict, load, hook) -> bool:
    """Run `load()` and record what it cost this process: wall (`load_s`), CPU, /proc/self/io
    read_bytes and rchar, RSS before and peak RSS during the load (VmHWM reset first; the file pages
    an mmap-based reader touches count). With a hook, every rank loads at once, between barriers
    around rank 0's `hook.before_load`/`after_load`. False (and rec["error"]) when the load raised."""
    import torch.distributed as dist

    lead = hook is not None and dist.get_rank() == 0
    if hook is not None:
        dist.barrier()
        if lead:
            rec["before"] = hook.before_load(run)
        dist.barrier()
    rec["rss_before"] = status_bytes("VmRSS")
    reset_peak_rss()
    io0, cpu0, t0 = proc_io(), cpu_seconds(), time.perf_counter()
    try:
        load()
    except Exception as e:  # noqa: BLE001 - the error line is this run's result
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["load_s"] = time.perf_counter() - t0
    io = proc_io()
    rec.update(cpu_s=cpu_seconds() - cpu0, read_bytes=io["read_bytes"] - io0["read_bytes"],
               rchar=io["rchar"] - io0["rchar"], peak_rss=status_bytes("VmHWM"))
    if hook is not None:
        dist.barrier()
        if lead:
            rec["after"] = hook.after_load(run)
    return "error" not in rec


def file_tensors(role_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in rank_files(role_dir, rank):
        out.update(load_file(f))
    return out


def compare_to_files(params: dict[str, torch.Tensor], files: dict[str, torch.Tensor]) -> list[str]:
    """Every rank-file tensor equals the parameter of its name (attn_sink: the parameter's prefix,
    the rest of which must stay -inf)."""
    problems = []
    for name, t in files.items():
        p = params.get(name)
        if p is None:
            problems.append(f"{name}: in the rank file, no such parameter")
            continue
        if name.endswith("attn_sink") and p.dim() == 1 and p.shape[0] > t.shape[0]:
            if not bool(torch.all(p[t.shape[0]:] == float("-inf"))):
                problems.append(f"{name}: padded heads [{t.shape[0]}:{p.shape[0]}) are not -inf")
            p = p[: t.shape[0]]
        if not same_bytes(p, t):
            problems.append(f"{name}: parameter differs from the rank file, {first_difference(p, t)}")
    return problems


def run_one(spec: dict, run: dict, rank: int, hook=None) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Build a fresh model under the run's config, load it with the run's loader, capture it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    if "{rank}" in run.get("model", ""):  # one directory per rank: a node's share (lucifer-shard stage)
        run = {**run, "model": run["model"].replace("{rank}", str(rank))}
    rec: dict = {"load_format": run["load_format"], "model": run.get("model")}
    CAPABILITY[:] = run.get("capability", SM120)
    if run["load_format"] == FLOOR:
        measured_load(rec, run, lambda: read_once(rank_files(Path(run["files"]), rank)), hook)
        return rec, None
    try:
        cfg = engine_config(spec, run)
    except Exception as e:  # noqa: BLE001 - a refused configuration is this run's result
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec, None
    # The MTP draft: the model config vLLM's speculative config derived from the target's.
    model_config = cfg.speculative_config.draft_model_config if run.get("role") == "draft" else cfg.model_config
    text = getattr(model_config, "hf_text_config", None)
    rec["virtual_tp_plan"] = getattr(text, "vllm_virtual_tp_plan", None)  # the fork's
    rec["stock_padding"] = getattr(text, "lucifer_tp3_padding", None)  # the plugin's, on stock vLLM
    rec["hf_sizes"] = {k: getattr(text, k, None) for k in HF_SIZES}
    loader = get_model_loader(cfg.load_config)
    rec["loader"] = type(loader).__name__
    with set_current_vllm_config(cfg), set_default_torch_dtype(model_config.dtype):
        t0 = time.perf_counter()
        with torch.device(cfg.device_config.device):
            model = initialize_model(vllm_config=cfg, model_config=model_config,
                                     model_class=resolve(run["model_class"]) if run.get("model_class") else None)
        rec["construct_s"] = time.perf_counter() - t0
        rec["model_class"] = f"{type(model).__module__}.{type(model).__name__}"
        calls = count_post_load_hooks(model) if run.get("post_load") else None
        loaded = measured_load(rec, run, lambda: loader.load_weights(model, model_config), hook)
        if loaded and run.get("moe_post_load"):
            rec["moe_post_load"] = moe_post_load(model, loader)
        if loaded and calls is not None:
            try:
                vllm_post_load(model, model_config, cfg.device_config.device)
            except Exception as e:  # noqa: BLE001 - the error line is this run's result
                rec["error"] = f"post-load: {type(e).__name__}: {e}"
            rec["hook_calls"] = calls
    try:
        return finish_run(spec, run, rank, rec, model) if loaded else (rec, None)
    finally:
        release(model)


def moe_post_load(model: torch.nn.Module, loader) -> dict:
    """vLLM's own `Mxfp4MoEMethod.process_weights_after_loading` on every MXFP4 MoE layer, as
    `process_weights_after_loading(model, ...)` runs it after a load (`_setup_kernel`'s shape checks, the
    re-layout the plugin replaces for tagged layers, `replace_parameter`, the kernel build), then the
    loader's own checks after it (`check_after_processing`). Per layer: the re-layout calls the tag counted,
    whether each expert tensor kept its storage, its shape after, and the kernel built. The other layers'
    post-load steps pack CPU kernels and do not touch the experts."""
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

    from lucifer_shard.runtime_shim.adapt.wrappers import relayout

    layers, prefix, qm = {}, None, None
    try:
        for prefix, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if not isinstance(qm, Mxfp4MoEMethod):
                continue
            names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
            before = {n: getattr(module, n).data_ptr() for n in names}
            qm.process_weights_after_loading(module)
            tag = getattr(module, relayout.TAG_ATTR, None)
            layers[prefix] = {"backend": qm.mxfp4_backend.name, "relayout_calls": tag and tag.relayout_calls,
                              "storage_kept": {n: getattr(module, n).data_ptr() == before[n] for n in names},
                              "shapes": {n: list(getattr(module, n).shape) for n in names},
                              "kernel": type(qm.moe_kernel.fused_experts).__name__ if qm.moe_kernel else None}
        loader.check_after_processing(model)
    except Exception as e:  # noqa: BLE001 - the error line is this run's result
        # where it stopped: the layer, the backend vLLM had selected for it, and the innermost frames of the call
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)[-4:]]
        return {"layers": layers, "error": f"{type(e).__name__}: {e}", "failed_layer": prefix,
                "failed_backend": getattr(getattr(qm, "mxfp4_backend", None), "name", None), "frames": frames}
    return {"layers": layers}


def count_post_load_hooks(model: torch.nn.Module) -> dict[str, int]:
    """Count, from now on, the calls of each post-load hook the lucifer_tp3 loader knows
    (`runtime_shim.loader`'s hook tables) that this model has, whoever calls it."""
    from lucifer_shard.runtime_shim.load import loader as lucifer

    inner = getattr(model, "model", None)
    owners = [(model, lucifer.DRAFT_HOOKS), (inner, lucifer.TARGET_MODEL_HOOKS),
              *((layer, (lucifer.TARGET_LAYER_HOOK,)) for layer in getattr(inner, "layers", None) or [])]
    calls: dict[str, int] = {}

    def counted(name, fn):
        def hook(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return hook

    for owner, names in owners:
        for name in names:
            fn = getattr(owner, name, None)
            if callable(fn):
                calls.setdefault(name, 0)
                object.__setattr__(owner, name, counted(name, fn))  # this instance only
    return calls


def vllm_post_load(model: torch.nn.Module, model_config, device) -> None:
    """vLLM's own step after `load_weights` in `BaseModelLoader.load_model`
    (`model_loader.utils.process_weights_after_loading`: per-layer quant processing, then the model's
    post-load hooks; 0.34.0 runs those through `finalize_model_weights`). Harness-only: the quant
    methods' processing builds GPU kernels (FlashInfer, Marlin), a matter of the machine, so it is
    replaced by nothing here; every hook of the model runs as vLLM runs it."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading = lambda layer: None
    process_weights_after_loading(model, model_config, torch.device(device))


def release(model: torch.nn.Module) -> None:
    """Free a run's weights now (what was captured keeps its own reference): vLLM's MoE layers sit in a
    reference cycle through their parameters' `weight_loader` (a bound method of the layer) that
    Python's collector does not free, and every run builds a new model."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def finish_run(spec: dict, run: dict, rank: int, rec: dict, model) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """After a load: save the sharded state, capture the parameters, dump and compare them as the run asks."""
    if run.get("save_sharded"):
        from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

        t0 = time.perf_counter()
        ShardedStateLoader.save_model(model, run["save_sharded"])
        rec["save_s"] = time.perf_counter() - t0
    if not run.get("capture", True):
        return rec, None
    params = {n: p.detach() for n, p in model.named_parameters()}
    rec["params"] = {n: [list(p.shape), str(p.dtype).removeprefix("torch."), digest(p)] for n, p in params.items()}
    dump = {n: p for n, p in params.items() if any(k in n for k in spec.get("dump", ()))}
    if dump:  # raw parameters for checks against the source made by the test itself
        from safetensors.torch import save_file

        save_file({n: p.contiguous() for n, p in dump.items()},
                  str(Path(spec["results"]) / f"rank-{rank}-{run['name']}.safetensors"))
    if run.get("files"):
        files = file_tensors(Path(run["files"]), rank)
        rec["file_tensors"] = len(files)
        rec["file_problems"] = compare_to_files(params, files)
    return rec, params


def versus(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    common = sorted(set(params) & set(reference))
    return {
        "only_here": sorted(set(params) - set(reference)),
        "only_reference": sorted(set(reference) - set(params)),
        "differ": [f"{n}: {first_difference(params[n], reference[n])}" for n in common
                   if not same_bytes(params[n], reference[n])],
        "bytes_compared": sum(raw_bytes(params[n]).numel() for n in common),
    }


def rank_main(rank: int, spec: dict, port: int, hook=None) -> None:
    report: dict = {"rank": rank, "runs": {}}
    try:
        t_start = time.perf_counter()
        allow_construction_on_this_cpu()
        import vllm
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.platforms import current_platform
        from vllm.plugins import load_general_plugins

        from shim_fixtures import allow_vet_candidate

        allow_vet_candidate()  # `vet`'s candidate row, before the plugin judges this vLLM
        load_general_plugins()  # vLLM's own entry-point discovery registers lucifer_tp3 here
        report.update(vllm=vllm.__version__, vllm_path=str(Path(vllm.__file__).parent),
                      platform=type(current_platform).__name__)
        tp = int(spec["tp"])
        model_run = next(run for run in spec["runs"] if run["load_format"] != FLOOR)
        with set_current_vllm_config(engine_config(spec, model_run)):
            ps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{port}")
            ps.ensure_model_parallel_initialized(tp, 1)
        report["tp_rank"] = ps.get_tensor_model_parallel_rank()
        captured: dict[str, dict[str, torch.Tensor] | None] = {}
        for run in spec["runs"]:
            rec, captured[run["name"]] = run_one(spec, run, report["tp_rank"], hook)
            ref = captured.get(run.get("compare_to", ""))
            if ref is not None and captured[run["name"]] is not None:
                rec["vs_reference"] = versus(captured[run["name"]], ref)
            report["runs"][run["name"]] = rec
        report["seconds"] = time.perf_counter() - t_start
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    except Exception:  # noqa: BLE001 - reported to the parent through the results file
        report["crash"] = traceback.format_exc()
    (Path(spec["results"]) / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(spec: dict, hook=None) -> list[dict]:
    """All ranks of `spec`, one spawned process each; their reports, in rank order. `hook` (picklable:
    its class importable in the ranks) times every run on all ranks at once (module docstring)."""
    Path(spec["results"]).mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # inherited by the ranks, before vLLM resolves its platform
    mp.spawn(rank_main, args=(spec, free_port(), hook), nprocs=int(spec["tp"]), join=True)
    return [json.loads((Path(spec["results"]) / f"rank-{r}.json").read_text()) for r in range(int(spec["tp"]))]


if __name__ == "__main__":
    reports = run_world(json.loads(Path(sys.argv[1]).read_text()))
    crashed = [r for r in reports if "crash" in r]
    for r in crashed:
        print(f"rank {r['rank']} crashed:\n{r['crash']}", file=sys.stderr)
    sys.exit(1 if crashed else 0)
