"""`--load-format lucifer_tp3`: copy each rank file tensor verbatim into the parameter of the same name.

Glue between vLLM and the load plan: this module reads what vLLM knows (its parallel state, the model it
built), loadplan.py makes every check before the first byte and says what to read into what, loadcopy.py
reads it; then the experts are tagged for the re-layout wrapper and the model's post-load hooks replayed.
Design: docs/design/vllm-extension-points.md §2. Imported by `register()` (so after vLLM is importable); never
imported by the converter.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from lucifer_shard.model.layouts import EXPERT_TENSORS
from lucifer_shard.model.runtimes import MOE_BACKEND, RELAYOUT
from lucifer_shard.output.outwatch import ReadWatch

from . import crossnode, loadcopy, loadplan
from ..adapt import compat, lucifer_tuple, settings, stock_vtp
from ..adapt.versions import dist_version
from ..adapt.wrappers.relayout import TAG_ATTR, ExpertTag
from lucifer_shard.errors import DOCTOR

from ..errors import ShimError, ShimRuntimeError
from ..manifest import Output, check_watch, load_manifest, open_output, watch

logger = logging.getLogger("lucifer_shard.runtime_shim")

# the --model-loader-extra-config keys and values the loader accepts: `settings.LOADER_OPTIONS`
EXTRA_CONFIG_KEYS = settings.LOADER_OPTIONS
# Post-load hooks `model.load_weights` runs after copying (docs/design/vllm-extension-points.md §2.3); replayed in order.
TARGET_LAYER_HOOK = "refresh_b12x_mhc_bf16_weights"
TARGET_MODEL_HOOKS = ("finalize_mega_moe_weights", "finalize_mhc_broadcast_weights", "setup_b12x_wo_projection")
DRAFT_HOOKS = ("finalize_mega_moe_weights",)
# parallel group getter of vLLM's parallel_state -> loadplan.Engine.sizes key (a getter this build lacks: size 1)
PARALLEL_GROUPS = {"get_pp_group": "pp", "get_dp_group": "dp", "get_pcp_group": "pcp"}


def _gathered(mine: crossnode.ShareIdentity) -> list[crossnode.ShareIdentity]:
    """Every TP rank's identity, in rank order, over vLLM's CPU (gloo) group of the TP ranks; this rank's alone
    outside a distributed world (a TP-1 engine, or a test that sets the TP rank itself)."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    if not dist.is_initialized():
        return [mine]
    group = ps.get_tp_group()
    if group.world_size == 1:
        return [mine]
    gathered: list = [None] * group.world_size
    dist.all_gather_object(gathered, mine, group=group.cpu_group)
    return gathered


def _manifest_everywhere(out: Path, rank: int, check_digest: bool, opened: Output | None = None) -> Output:
    """OUT with its manifest (`opened`: already read in this process), once every TP rank has shown its
    share's identity to the others (crossnode.py): a rank whose manifest fails still joins the gather, so
    that no rank waits on it and every rank stops."""
    try:
        output = opened or open_output(out, check_digest=check_digest)
    except ShimError as e:
        _gathered(crossnode.ShareIdentity.unreadable(rank, str(out), str(e)))
        raise
    problem = crossnode.identity_problem(_gathered(crossnode.ShareIdentity.of(output, rank)))
    if problem:
        raise ShimError(problem)
    return output


def _group_size(ps, getter: str) -> int:
    fn = getattr(ps, getter, None)
    try:
        return int(fn().world_size) if fn is not None else 1
    except (AssertionError, AttributeError):  # a group this engine never initialised
        return 1


def _relayout_missing() -> str | None:
    return None if compat.installed(RELAYOUT) else compat.why_not_installed(RELAYOUT)


class LuciferTP3Loader(BaseModelLoader):
    """Loads lucifer-shard rank files: exact keys, shapes and dtypes; experts possibly in kernel layout."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = settings.parse_extra_config(getattr(load_config, "model_loader_extra_config", None))
        self.tags: dict[str, ExpertTag] = {}
        self.hooks_called: list[str] = []
        self.loaded: dict[str, str] = {}  # param name -> file it came from
        self._role_hint: str | None = None
        # OUT as `load_model` read it, with the watch started before that read: its `load_weights` reads
        # nothing again (a worker reads and checks the manifest once)
        self._opened: tuple[ReadWatch, Output] | None = None

    def download_model(self, model_config) -> None:
        load_manifest(lucifer_tuple.model_dir(model_config))

    def load_model(self, vllm_config, model_config, prefix: str = "") -> nn.Module:
        self._role_hint = self._role_from_config(vllm_config, model_config)
        out = Path(lucifer_tuple.model_dir(model_config))
        seen = watch(out)
        output = open_output(out)
        loadplan.check_engine(output, settings.config_problems(vllm_config),
                              vllm_config.parallel_config.tensor_parallel_size, _relayout_missing(),
                              dist_version("flashinfer-python"))
        self._opened = (seen, output)
        try:
            model = super().load_model(vllm_config, model_config, prefix)  # calls load_weights
        finally:
            self._opened = None
        self.check_after_processing(model)
        return model

    def load_weights(self, model: nn.Module, model_config) -> None:
        from vllm.distributed import parallel_state as ps

        verify = self.options["verify"]
        out = Path(lucifer_tuple.model_dir(model_config))
        kept = self._opened is not None and self._opened[1].path == out  # called by this loader's load_model
        seen, opened = self._opened if kept else (watch(out), None)
        rank = ps.get_tensor_model_parallel_rank()
        output = _manifest_everywhere(out, rank, verify != "none", opened)
        arch, cap = lucifer_tuple.device_arch()
        sizes = {k: _group_size(ps, g) for g, k in PARALLEL_GROUPS.items()}
        engine = loadplan.Engine(
            ps.get_tensor_model_parallel_world_size(), rank, sizes, verify, self.options["role"], self._role_hint,
            _relayout_missing(), arch, cap, stock_vtp.plan_difference(model_config, output))
        plan = loadplan.plan_load(output, engine, loadcopy.model_view(model, rank, engine.tp))
        targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        with torch.no_grad():
            for f in plan.files:
                digests = loadcopy.copy_file(out, plan.role, rank, f, targets, digests=verify == "full")
                self.loaded.update({r.name: str(f.file.path) for r in f.reads})
                if verify == "full":
                    loadcopy.check_digests(f.file, plan.entry, digests)
        check_watch(seen)  # a convert that ran meanwhile: the bytes may be two outputs' mix
        if verify == "full":
            loadcopy.check_zero_regions(plan.entry, targets)
        self._tag(model, output.manifest, plan)
        self._replay_hooks(model, plan.role)
        logger.info("lucifer_tp3: loaded %d tensors of %s rank %d from %d file(s) (verify=%s)", len(self.loaded),
                    plan.role, rank, len(plan.files), verify)

    def check_after_processing(self, model: nn.Module) -> None:
        for prefix, tag in self.tags.items():
            module = model.get_submodule(prefix)
            if tag.relayout_calls != 1:
                raise ShimRuntimeError(f"expert re-layout wrapper ran {tag.relayout_calls} times on {prefix} "
                                       f"(expected exactly 1); this vLLM build processes MoE weights differently, "
                                       f"use a supported build", DOCTOR.at(out="OUT"))
            qm = getattr(module, "quant_method", None)
            if qm is not None and getattr(qm, "moe_kernel", None) is None:
                raise ShimRuntimeError(f"no MoE kernel was built for {prefix} after post-load processing; check "
                                       f"--moe-backend {MOE_BACKEND} and the FlashInfer install")
            for name, ptr in tag.data_ptrs.items():
                now = getattr(module, name).data_ptr()
                if now != ptr:
                    raise ShimRuntimeError(f"{prefix}.{name} was re-laid-out after loading (storage moved from "
                                           f"{ptr:#x} to {now:#x}); the kernel-layout experts were processed again, "
                                           f"use a supported vLLM build", DOCTOR.at(out="OUT"))
        if self.tags:
            tag = next(iter(self.tags.values()))
            logger.info("lucifer_tp3: %d MoE layer(s) loaded verbatim in kernel layout (%s): vLLM's re-layout skipped, "
                        "each kernel built on the storage the files filled (checked)", len(self.tags), tag.moe_variant)

    @staticmethod
    def _role_from_config(vllm_config, model_config) -> str:
        """The draft's when vLLM loads the draft model's config; a drafter without weights (ngram) has the
        target's config as its `draft_model_config` (vllm/config/speculative.py), so that one is the target's."""
        spec = getattr(vllm_config, "speculative_config", None)
        draft = getattr(spec, "draft_model_config", None)
        if draft is not None and model_config is draft and draft is not getattr(vllm_config, "model_config", None):
            return "draft"
        return "target"

    def _tag(self, model: nn.Module, doc, plan: loadplan.LoadPlan) -> None:
        layouts = {k: v.name for k, v in doc.layouts.items()}
        for prefix in plan.expert_groups:
            module = model.get_submodule(prefix)
            tag = ExpertTag(prefix=prefix, moe_variant=doc.moe_variant, layout=layouts)
            tag.data_ptrs = {n: getattr(module, n).data_ptr() for n in EXPERT_TENSORS}
            tag.shapes = {n: plan.entry.tensors[f"{prefix}.{n}"].shape for n in EXPERT_TENSORS}
            setattr(module, TAG_ATTR, tag)
            self.tags[prefix] = tag

    def _replay_hooks(self, model: nn.Module, role: str) -> None:
        """Run the post-load hooks the model's `load_weights` runs (this loader does not call it), except
        those its model-level post-load hook runs: vLLM calls that after every loader's `load_weights`
        (0.33.0: `process_weights_after_loading` in model_loader/utils.py; 0.34.0: `finalize_model_weights`),
        so replaying them too would run them twice (DeepSeek-V4's `finalize_mhc_broadcast_weights`)."""
        post_load = getattr(type(model), "process_weights_after_loading", None)
        vllm_runs = set(post_load.__code__.co_names) if hasattr(post_load, "__code__") else set()  # names it calls
        if role == "draft":
            for name in DRAFT_HOOKS:
                fn = getattr(model, name, None)
                if callable(fn) and name not in vllm_runs:
                    fn()
                    self.hooks_called.append(name)
            return
        inner = getattr(model, "model", None)
        for i, layer in enumerate(getattr(inner, "layers", []) or []):
            fn = getattr(layer, TARGET_LAYER_HOOK, None)
            if callable(fn) and TARGET_LAYER_HOOK not in vllm_runs:
                fn()
                self.hooks_called.append(f"layers.{i}.{TARGET_LAYER_HOOK}")
        for name in TARGET_MODEL_HOOKS:
            fn = getattr(inner, name, None)
            if callable(fn) and name not in vllm_runs:
                fn()
                self.hooks_called.append(name)
