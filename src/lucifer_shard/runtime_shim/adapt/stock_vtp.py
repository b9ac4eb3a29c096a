"""Virtual TP on stock vLLM, supplied by the plugin (docs/design/vllm-extension-points.md §3.2-3.3): the
padding its two wrappers apply and the checks of the result.

The rank files are already padded and `lucifer_tp3` is their only loader, so stock vLLM needs only
its *shapes* padded, and only when the manifest's plan pads (TP3; TP 1/2/4 need nothing): the
engine process (wrappers/stock_config.py) pads the hf configs through a callable `hf_overrides`
(`pad_config`; `config.json` on disk is never touched) and checks the result (`stock_problems`); the
worker processes (wrappers/stock_vocab.py) pad the vocabulary layers to what `applied` says.

Imports vLLM only inside the functions that run under it.
"""
from __future__ import annotations

from typing import Any

from lucifer_shard.model.arches import ARCH_TABLE, FLASHINFER_MLA
from lucifer_shard.model.plan import MOE_ROUTES
from lucifer_shard.model.runtimes import RELAYOUT, STOCK_CONFIG

from . import lucifer_tuple
from lucifer_shard.errors import CONVERT_AGAIN

from ..errors import ShimError
from ..manifest import Output, compare_plan, manifest_path, needs_virtual_tp
from .compat import installed, why_not_installed
from .configview import backend_name, model_problems, text_config
from .lucifer_tuple import parallel_problems, runtime_plan

FP8_BLOCK = 128  # the block-FP8 weights' block (quantization_config.weight_block_size)
# manifest plan axis -> the hf config key vLLM sizes it from
CONFIG_KEYS = {"heads": "num_attention_heads", "groups": "o_groups", "routed": "moe_intermediate_size"}
# hf config attribute `pad_config` leaves behind: what it applied, read by the vocabulary wrapper and
# the loader (a fork config has `vllm_virtual_tp_plan` instead)
MARKER = "lucifer_tp3_padding"
# attention backends a GPU family cannot run, with what to pass instead: FlashInfer's DSv4 sparse MLA runs where
# stock vLLM picks it (model/arches.py)
UNRUNNABLE_ATTENTION = {a.name: {FLASHINFER_MLA: a.attention} for a in ARCH_TABLE if a.attention != FLASHINFER_MLA}


def block_shared_local(moe_intermediate: int, tp: int, block: int = FP8_BLOCK) -> int:
    """The per-rank width vLLM's NVIDIA DeepSeek-V4 class gives the block-FP8 shared expert built from
    `moe_intermediate`: whole 128-blocks, their count per rank rounded up (`DeepseekV4MLP.__init__`,
    vllm/models/deepseek_v4/nvidia/model.py, both vetted releases). The CPU class splits it unpadded."""
    return -(-(moe_intermediate // block) // tp) * block


def padding(output: Output) -> dict[str, Any]:
    """What the model configs must say for OUT's padded plan: per hf key (original, padded),
    and the padded vocabulary. The expert width is the routed experts' kernel-local width times TP:
    at TP3 768 per rank on the default route (704 real + 64 zero columns), 704 on the b12x route. vLLM
    builds the shared expert from the same field: 768 per rank at TP3 either way on the NVIDIA class
    (`block_shared_local`); the CPU class splits it unpadded, which only the default route matches (the b12x
    route is refused there by its MoE backend, `stock_problems`)."""
    out, manifest = output.path, output.manifest
    axes, tp = manifest.plan.axes, manifest.tp_size
    routed, shared = axes["routed"], axes.get("shared")
    width = routed.kernel_local * tp
    if shared is not None and shared.local not in (routed.kernel_local, block_shared_local(width, tp)):
        raise ShimError(f"{manifest_path(out)}: routed experts are {routed.kernel_local} and shared experts "
                        f"{shared.local} wide per rank; stock vLLM sizes both from moe_intermediate_size "
                        f"({width} gives shared experts {block_shared_local(width, tp)} per rank); serve this "
                        f"output on a vetted mlow/vllm build")
    padded = {"heads": axes["heads"].padded, "groups": axes["groups"].padded, "routed": width}
    return {"sizes": {CONFIG_KEYS[a]: (axes[a].original, padded[a]) for a in CONFIG_KEYS},
            "vocab": (axes["vocab"].original, axes["vocab"].padded), "tp": tp}


def pad_config(hf_config, padding: dict[str, Any]):
    """vLLM `hf_overrides` callable: the padded sizes into the (text) config, each original kept as
    `original_<key>` (the fork's convention), and `MARKER`. Refuses a config that is not the one
    converted. Applying it twice is a no-op."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(text, MARKER, None) == padding or all(getattr(text, k, None) is None for k in padding["sizes"]):
        return hf_config  # padded already, or the bare config vLLM's get_config probes before the model's own
    for key, (original, padded) in padding["sizes"].items():
        found = getattr(text, key, None)
        if found != original:
            raise ShimError(f"config {key}={found!r}, but the rank files were converted from {original}; the output "
                            f"directory's config.json was changed", CONVERT_AGAIN)
        setattr(text, f"original_{key}", original)
        setattr(text, key, padded)
    setattr(text, MARKER, padding)
    return hf_config


def applied(model_config) -> dict[str, Any] | None:
    """The padding `pad_config` applied to a vLLM model config, None if it did not."""
    return getattr(text_config(model_config), MARKER, None)


def plan_difference(model_config, output: Output) -> str | None:
    """How the live model config's virtual-TP geometry differs from the manifest's plan (None: equal):
    the fork's `vllm_virtual_tp_plan`, or on stock vLLM the padding the plugin applied."""
    fork_plan = runtime_plan(model_config)
    if fork_plan is None and (applied(model_config) is not None or installed(STOCK_CONFIG)):
        return geometry_problem(model_config, output)
    return compare_plan(fork_plan, output.manifest.plan)


def geometry_problem(model_config, output: Output) -> str | None:
    """How a model config's padded geometry differs from the manifest's plan (None: equal)."""
    want = padding(output) if needs_virtual_tp(output.manifest) else None
    got = applied(model_config)
    if want is None:
        return None if got is None else "the config is padded but the manifest's plan pads nothing"
    if got != want:
        needs = ", ".join(f"{k} {o} -> {p}" for k, (o, p) in want["sizes"].items())
        found = "was not padded" if got is None else f"was padded for another plan ({got['sizes']})"
        return f"stock virtual TP: the model config {found}; the manifest's plan needs {needs}"
    hf = text_config(model_config)
    for key, (_, padded) in want["sizes"].items():
        if getattr(hf, key, None) != padded:
            return f"stock virtual TP: config {key}={getattr(hf, key, None)}, the manifest's plan needs {padded}"
    return None


# ---------------------------------------------------------------------------- engine process


def stock_problems(vllm_config, output: Output) -> list[str]:
    """Each way a stock vLLM config cannot serve OUT's manifest with lucifer_tp3 (empty: it can)."""
    from vllm.platforms import current_platform

    manifest = output.manifest

    mc = vllm_config.model_config
    problems = model_problems(vllm_config) + parallel_problems(vllm_config, manifest)
    if manifest.expert_layout != "model" and not installed(RELAYOUT):
        problems.append(f"routed experts in kernel layout ({manifest.moe_variant}), which this vLLM cannot load "
                        f"verbatim: {why_not_installed(RELAYOUT)} (use a vetted build, see lucifer-shard "
                        f"doctor, or re-convert with --expert-layout model)")
    for role, cfg in (("target", mc), ("draft", getattr(getattr(vllm_config, "speculative_config", None),
                                                         "draft_model_config", None))):
        diff = geometry_problem(cfg, output) if cfg is not None else None
        if diff:
            problems.append(f"{role}: {diff} (this vLLM did not apply the plugin's hf_overrides to it)")
    moe = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", None)
    route = manifest.options.moe_backend
    if route is not None and moe not in MOE_ROUTES[route].backends:
        routed = manifest.plan.axes["routed"].kernel_local
        problems.append(f"the routed experts are {routed} wide per rank for vLLM's {route} MoE, which "
                        f"MoE backend {moe!r} would round to another width (pass --moe-backend {route}, "
                        f"as lucifer-shard serve does, or re-convert without --moe-backend {route})")
    if current_platform.is_cpu():
        experts = int(getattr(text_config(mc), "n_routed_experts", 0) or 0)
        if manifest.tp_size > 1 and experts % manifest.tp_size:
            # cpu/model.py asserts it; the values it computes from it are unused, but the assert is vLLM's
            problems.append(f"vLLM's CPU DeepSeek-V4 class requires n_routed_experts ({experts}) % tp "
                            f"({manifest.tp_size}) == 0; serve on GPUs (the NVIDIA class has no such requirement)")
        return problems
    arch, cap = lucifer_tuple.device_arch()
    attn = backend_name(getattr(getattr(vllm_config, "attention_config", None), "backend", None))
    instead = UNRUNNABLE_ATTENTION.get(arch or "", {}).get(attn or "")
    if instead:
        problems.append(f"attention backend {attn} does not run on capability {cap} (pass --attention-backend "
                        f"{instead})")
    return problems
