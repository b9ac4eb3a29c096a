"""`--load-format lucifer_tp3`: copy each rank file tensor verbatim into the parameter of the same name.

Design: docs/design/vllm-extension-points.md §2. Imported by `register()` (so after vLLM is importable); never imported
by the converter.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from lucifer_shard.spec.config import ARCHITECTURE
from lucifer_shard.spec.drafts import DRAFT_KINDS, owned_by_runtime
from lucifer_shard.spec.dtypes import TORCH_DTYPE as TORCH_DTYPES
from lucifer_shard.spec.layouts import EXPERT_TENSORS, layout_by_name
from lucifer_shard.spec.manifest import file_digest, file_metadata
from lucifer_shard.spec.manifest_types import FileRecord, RankRecord, TensorRecord
from lucifer_shard.spec.runtimes import MOE_BACKEND, RELAYOUT, flashinfer_problem
from lucifer_shard.spec.share import share_problem
from lucifer_shard.spec.stheader import Header

from . import compat, crossnode, lucifer_tuple, reader, settings, stock_vtp
from .configview import backend_name
from .doctor import dist_version
from .errors import ShimError, ShimRuntimeError
from .wrappers.relayout import TAG_ATTR, ExpertTag
from .manifest import (
    Manifest,
    check_watch,
    load_manifest,
    open_rank_file,
    read_header,
    watch,
)

logger = logging.getLogger("lucifer_shard.runtime_shim")

# the --model-loader-extra-config keys and values the loader accepts: `settings.LOADER_OPTIONS`
EXTRA_CONFIG_KEYS = settings.LOADER_OPTIONS
TARGET_CLASSES = (ARCHITECTURE,)
DRAFT_CLASSES = {k.vllm_class: k.name for k in DRAFT_KINDS.values()}  # vLLM's draft class -> draft kind
# Post-load hooks `model.load_weights` runs after copying (docs/design/vllm-extension-points.md §2.3); replayed in order.
TARGET_LAYER_HOOK = "refresh_b12x_mhc_bf16_weights"
TARGET_MODEL_HOOKS = ("finalize_mega_moe_weights", "finalize_mhc_broadcast_weights", "setup_b12x_wo_projection")
DRAFT_HOOKS = ("finalize_mega_moe_weights",)

DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# The only reinterpretation allowed, and only where the manifest declares it (`view_as`).
VIEW_PAIRS = {frozenset((torch.uint8, torch.float8_e8m0fnu))}
NEG_INF = float("-inf")


@dataclass(frozen=True)
class CheckedRankFile:
    path: Path
    declared: FileRecord  # the manifest's entry
    header: Header  # validated: tensors in data order, offsets count from header.data_start
    identity: tuple[int, int]  # (st_dev, st_ino) of the file the header was read from: the data must be its


def dtype_name(dt: torch.dtype) -> str:
    return DTYPE_NAMES.get(dt, str(dt).replace("torch.", ""))


def _shape(s) -> str:
    return "(" + ",".join(str(int(x)) for x in s) + ")"


def _kernel_shape(t: TensorRecord, p: torch.Tensor) -> tuple[int, ...] | None:
    """The shape the file's kernel layout gives parameter `p` ([experts, rows, cols] in model layout), or None
    for model layout or a shape the layout cannot take. SM90's scale fold makes the 3-D parameter 5-D at the
    same byte count; the bytes then fill the parameter viewed in that shape, and the re-layout wrapper hands
    the kernel that view (wrappers/relayout.py): a reinterpretation, no narrowing."""
    if not t.kernel or p.dim() != 3 or not p.is_contiguous():
        return None
    try:
        return (int(p.shape[0]), *layout_by_name(t.layout).kernel_shape((int(p.shape[1]), int(p.shape[2]))))
    except ValueError:
        return None


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


def _few(names, n=5) -> str:
    names = sorted(names)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


class LuciferTP3Loader(BaseModelLoader):
    """Loads lucifer-shard rank files: exact keys, shapes and dtypes; experts possibly in kernel layout."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = settings.parse_extra_config(getattr(load_config, "model_loader_extra_config", None))
        self.tags: dict[str, ExpertTag] = {}
        self.hooks_called: list[str] = []
        self.loaded: dict[str, str] = {}  # param name -> file it came from
        self._role_hint: str | None = None
        self._vllm_config = None

    # ------------------------------------------------------------------ BaseModelLoader API

    def download_model(self, model_config) -> None:
        load_manifest(self._dir(model_config))

    def load_model(self, vllm_config, model_config, prefix: str = "") -> nn.Module:
        self._vllm_config = vllm_config
        self._role_hint = self._role_from_config(vllm_config, model_config)
        manifest = load_manifest(self._dir(model_config))
        self._check_parallel_config(vllm_config, manifest)
        if manifest.expert_layout != "model" and not compat.installed(RELAYOUT):
            raise ShimError(f"{manifest.path} has routed experts in kernel layout ({manifest.moe_variant}), but the "
                            f"expert re-layout wrapper is not installed: {compat.why_not_installed(RELAYOUT)}; "
                            f"use a supported vLLM build (lucifer-shard doctor) or convert with --expert-layout model")
        problem = flashinfer_problem(manifest.flashinfer_layout, dist_version("flashinfer-python"))
        if problem:
            raise ShimError(f"{manifest.path}: {problem[0]}; {problem[1]}")
        model = super().load_model(vllm_config, model_config, prefix)
        self.check_after_processing(model)
        return model

    def load_weights(self, model: nn.Module, model_config) -> None:
        verify = self.options["verify"]
        seen = watch(self._dir(model_config))
        tp, rank = self._tp_rank()
        manifest = self._manifest_everywhere(self._dir(model_config), rank, check_digest=verify != "none")
        mismatch = lucifer_tuple.tp_mismatch(manifest, tp)
        if mismatch:
            raise ShimError(mismatch)
        missing = share_problem(manifest.out, manifest.conversion_id, rank, manifest.tp_size)  # a node's share without this rank
        if missing:
            raise ShimError(missing)
        role = self._role(model)
        self._check_model_class(model, role, manifest)
        entry = manifest.rank_entry(role, rank)
        files = self._check_files(manifest, role, rank, entry, identity=verify != "none")
        params, buffers = self._targets(model)
        self._check_keys(manifest, role, rank, entry, params, buffers)
        diff = stock_vtp.plan_difference(model_config, manifest)
        if diff:
            raise ShimError(f"{diff}; start vLLM through lucifer-shard serve (the plugin's virtual-TP wrappers must "
                            f"be active) and check B12X_MOE_FORCE_A8 / NVFP4 env")
        expert_modules = self._expert_modules(manifest, entry, model)
        self._check_expert_modules(model, manifest, expert_modules, rank, tp)
        targets = {**buffers, **params}
        with torch.no_grad():
            for f in files:
                digests = self._copy_file(manifest, role, rank, f, entry.tensors, targets,
                                          digests=verify == "full")
                if verify == "full":
                    self._check_digests(f, entry, digests)
        check_watch(seen)  # a convert that ran meanwhile: the bytes may be two outputs' mix
        if verify == "full":
            self._check_zero_regions(entry, targets)
        self._tag(model, manifest, entry.tensors, expert_modules)
        self._replay_hooks(model, role)
        logger.info("lucifer_tp3: loaded %d tensors of %s rank %d from %d file(s) (verify=%s)", len(self.loaded),
                    role, rank, len(files), verify)

    # ------------------------------------------------------------------ checks after PWAL

    def check_after_processing(self, model: nn.Module) -> None:
        for prefix, tag in self.tags.items():
            module = model.get_submodule(prefix)
            if tag.relayout_calls != 1:
                raise ShimRuntimeError(f"expert re-layout wrapper ran {tag.relayout_calls} times on {prefix} "
                                       f"(expected exactly 1); this vLLM build processes MoE weights differently, "
                                       f"use a supported build (lucifer-shard doctor)")
            qm = getattr(module, "quant_method", None)
            if qm is not None and getattr(qm, "moe_kernel", None) is None:
                raise ShimRuntimeError(f"no MoE kernel was built for {prefix} after post-load processing; check "
                                       f"--moe-backend {MOE_BACKEND} and the FlashInfer install")
            for name, ptr in tag.data_ptrs.items():
                now = getattr(module, name).data_ptr()
                if now != ptr:
                    raise ShimRuntimeError(f"{prefix}.{name} was re-laid-out after loading (storage moved from "
                                           f"{ptr:#x} to {now:#x}); the kernel-layout experts were processed again, "
                                           f"use a supported vLLM build (lucifer-shard doctor)")
        if self.tags:
            tag = next(iter(self.tags.values()))
            logger.info("lucifer_tp3: %d MoE layer(s) loaded verbatim in kernel layout (%s): vLLM's re-layout skipped, "
                        "each kernel built on the storage the files filled (checked)", len(self.tags), tag.moe_variant)

    # ------------------------------------------------------------------ pieces

    @staticmethod
    def _manifest_everywhere(out: Path, rank: int, check_digest: bool) -> Manifest:
        """OUT's manifest, once every TP rank has shown its share's identity to the others (crossnode.py): a rank
        whose manifest fails still joins the gather, so that no rank waits on it and every rank stops."""
        try:
            manifest = load_manifest(out, check_digest=check_digest)
        except ShimError as e:
            _gathered(crossnode.ShareIdentity.unreadable(rank, str(out), str(e)))
            raise
        problem = crossnode.identity_problem(_gathered(crossnode.ShareIdentity.of(manifest, rank)))
        if problem:
            raise ShimError(problem)
        return manifest

    def _dir(self, model_config) -> Path:
        return Path(lucifer_tuple.model_dir(model_config))

    def _tp_rank(self) -> tuple[int, int]:
        from vllm.distributed import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        rank = ps.get_tensor_model_parallel_rank()
        pp = ps.get_pp_group().world_size
        if pp != 1:
            raise ShimError(f"pipeline parallel size {pp}; lucifer_tp3 rank files are per TP rank, start with "
                            f"--pipeline-parallel-size 1")
        for getter, flag in (("get_dp_group", "--data-parallel-size"), ("get_pcp_group", "--prefill-context-parallel-size")):
            fn = getattr(ps, getter, None)
            try:
                size = fn().world_size if fn is not None else 1
            except (AssertionError, AttributeError):
                size = 1
            if size != 1:
                raise ShimError(f"{getter[4:-6]} size {size}; the MoE shard index flattens dp/pcp into TP, so "
                                f"lucifer_tp3 files need {flag} 1")
        return tp, rank

    def _check_parallel_config(self, vllm_config, manifest: Manifest) -> None:
        problems = settings.config_problems(vllm_config)
        if problems:
            raise ShimError("cannot load per-TP-rank files with " + "; ".join(problems))
        mismatch = lucifer_tuple.tp_mismatch(manifest, vllm_config.parallel_config.tensor_parallel_size)
        if mismatch:
            raise ShimError(mismatch)

    @staticmethod
    def _role_from_config(vllm_config, model_config) -> str:
        """The draft's when vLLM loads the draft model's config; a drafter without weights (ngram) has the
        target's config as its `draft_model_config` (vllm/config/speculative.py), so that one is the target's."""
        spec = getattr(vllm_config, "speculative_config", None)
        draft = getattr(spec, "draft_model_config", None)
        if draft is not None and model_config is draft and draft is not getattr(vllm_config, "model_config", None):
            return "draft"
        return "target"

    def _role(self, model: nn.Module) -> str:
        found = "draft" if type(model).__name__ in DRAFT_CLASSES else "target"
        forced = self.options["role"]
        if forced != "auto" and forced != found:
            raise ShimError(f"--model-loader-extra-config role={forced!r} but the model being loaded is the {found} "
                            f"model; drop the role key")
        if self._role_hint is not None and self._role_hint != found:
            raise ShimError(f"vLLM is loading the {self._role_hint} model but its parameters look like the {found} "
                            f"model; check the speculative config")
        return found

    @staticmethod
    def _check_model_class(model: nn.Module, role: str, manifest: Manifest) -> None:
        """The class vLLM built is the one the files are for: the target's, or the class of OUT's draft kind
        (a DSpark output served with method "mtp" builds DeepSeekV4MTP, which has none of its weights)."""
        name = type(model).__name__
        if role == "target":
            if name not in TARGET_CLASSES:
                raise ShimError(f"model class {name} is not {' / '.join(TARGET_CLASSES)}; lucifer_tp3 files hold "
                                f"DeepSeek-V4 target weights, check config.json in the output directory")
            return
        kind = DRAFT_KINDS[manifest.draft_kind or DRAFT_CLASSES[name]]
        if name != kind.vllm_class:
            raise ShimError(f"vLLM built the draft as {name} but {manifest.out}/draft holds a {kind.label} "
                            f"({kind.vllm_class}); start with --speculative-config '{{\"method\":\"{kind.method}\"}}' "
                            f"(lucifer-shard serve --draft sets it)")

    def _check_files(self, manifest: Manifest, role: str, rank: int, entry: RankRecord,
                     identity: bool) -> list[CheckedRankFile]:
        """Every file of the rank: present, its header's tensors exactly the manifest's (names, dtypes,
        shapes); with `identity`, also its size and identity stamp."""
        out = []
        declared = entry.files
        if not declared:
            raise ShimError(f"rank files missing: {manifest.path} lists no files for {role} rank {rank}; re-run "
                            f"lucifer-shard convert")
        by_file: dict[str, list[str]] = {}
        for name, t in entry.tensors.items():
            by_file.setdefault(t.file, []).append(name)
        for f in declared:
            path = manifest.out / f.path
            fd = open_rank_file(manifest.out, f.path, role, rank)
            try:
                st = os.fstat(fd)
                if identity and st.st_size != f.bytes:
                    raise ShimError(f"{path} is {st.st_size} bytes, the manifest says {f.bytes}; the copy is "
                                    f"truncated or from another conversion, re-copy it")
                header = read_header(path, fd=fd)
            finally:
                os.close(fd)
            meta = header.metadata
            want_meta = (file_metadata(manifest.conversion_id, role, rank, 0, manifest.tp_size, f.content)
                         if identity else {})
            for k, v in want_meta.items():
                if k != "lucifer.part" and meta.get(k) != v:  # the part index is the file's name
                    what = {"lucifer.conversion_id": "from another conversion",
                            "lucifer.content": "made from other source weights (another checkpoint or revision)"
                            }.get(k, "misplaced")
                    raise ShimError(f"{path} metadata {k}={meta.get(k)!r}, manifest expects {v!r}: the file is {what}; "
                                    f"do not mix outputs, re-run lucifer-shard convert into a fresh directory")
            names = by_file.get(f.path, [])
            if set(header.tensors) != set(names):
                extra, miss = set(header.tensors) - set(names), set(names) - set(header.tensors)
                raise ShimError(f"{path} holds tensors the manifest does not list ({_few(extra) or 'none'}) or lacks "
                                f"listed ones ({_few(miss) or 'none'}); re-run lucifer-shard convert --force")
            for name in names:
                t, h = entry.tensors[name], header.tensors[name]
                if h.dtype != t.dtype or tuple(h.shape) != t.shape:
                    raise ShimError(f"{path}: tensor {name} is {h.dtype}{_shape(h.shape)} but the manifest says "
                                    f"{t.dtype}{_shape(t.shape)}; re-run lucifer-shard convert --force")
            out.append(CheckedRankFile(path, f, header, (st.st_dev, st.st_ino)))
        return out

    @staticmethod
    def _targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        params = dict(model.named_parameters())
        non_persistent = set()
        for mname, mod in model.named_modules():
            for b in getattr(mod, "_non_persistent_buffers_set", ()):
                non_persistent.add(f"{mname}.{b}" if mname else b)
        buffers = {n: b for n, b in model.named_buffers() if n not in non_persistent}
        return params, buffers

    @staticmethod
    def _runtime_owned(manifest: Manifest, role: str, params) -> set[str]:
        """The draft's parameters vLLM aliases from the target (spec/drafts); the target owns none."""
        return owned_by_runtime(manifest.draft_kind, params) if role == "draft" else set()

    def _check_keys(self, manifest, role, rank, entry, params, buffers) -> None:
        files = set(entry.tensors)
        owned = self._runtime_owned(manifest, role, params)
        want = set(params) - owned
        missing = want - files
        unexpected = files - want - (set(buffers) - owned)
        if missing:
            raise ShimError(f"key missing: {len(missing)} parameter(s) of the {role} model are not in rank {rank} "
                            f"files: {_few(missing)}; the output was converted for another model/vLLM build, "
                            f"re-run lucifer-shard convert")
        if unexpected:
            raise ShimError(f"key unexpected: {len(unexpected)} tensor(s) of {role} rank {rank} files have no "
                            f"parameter in the model: {_few(unexpected)}; the output was converted for another "
                            f"model/vLLM build, re-run lucifer-shard convert")
        targets = {**buffers, **params}
        for name in sorted(files):
            self._check_tensor(name, entry.tensors[name], targets[name])

    @staticmethod
    def _is_sink(name: str, t: TensorRecord) -> bool:
        return name.endswith("attn_sink") and t.pad == "-inf" and len(t.shape) == 1

    def _destination(self, name: str, t: TensorRecord, p: torch.Tensor) -> torch.Tensor:
        """Where the file tensor's bytes go: the parameter; `attn_sink`'s prefix; a kernel-layout tensor whose
        layout reshapes it (SM90's folded scales), the parameter's storage viewed in the file's shape."""
        if self._is_sink(name, t):
            return p[: t.shape[0]]
        return p if tuple(p.shape) == t.shape else p.view(t.shape)

    def _check_tensor(self, name: str, t: TensorRecord, p: torch.Tensor) -> None:
        fdt = TORCH_DTYPES.get(t.dtype)
        shape = t.shape
        view = t.view_as
        if fdt != p.dtype:
            declared = view is not None and TORCH_DTYPES.get(view) == p.dtype
            if not (declared and frozenset((fdt, p.dtype)) in VIEW_PAIRS):
                raise ShimError(f"dtype mismatch: tensor {name} is {t.dtype} in the files, param is "
                                f"{dtype_name(p.dtype)}; no casting is performed, re-convert for this vLLM build")
        if self._is_sink(name, t):
            if p.dim() != 1 or p.shape[0] < shape[0]:
                raise ShimError(f"shape mismatch: tensor {name} {_shape(shape)} does not fit param {_shape(p.shape)} "
                                f"(attn_sink is copied into a prefix only)")
            return
        if tuple(p.shape) != shape and _kernel_shape(t, p) != shape:
            raise ShimError(f"shape mismatch: tensor {name} shape {_shape(shape)} != param {_shape(p.shape)}; no "
                            f"narrowing is performed, re-convert for this vLLM build and attention backend")

    def _expert_modules(self, manifest: Manifest, entry: RankRecord, model: nn.Module) -> dict[str, list[str]]:
        """Prefixes of the MoE modules whose routed experts arrive in kernel layout (expert_layout=kernel).

        Only the four routed-expert tensors may carry a kernel layout (w2_weight keeps the model
        layout on sm120/sm100, its bytes are unchanged by the kernel's re-layout); all four must be
        in the files for a tagged module."""
        groups: dict[str, list[str]] = {}
        for name, t in entry.tensors.items():
            prefix, _, leaf = name.rpartition(".")
            if leaf in EXPERT_TENSORS and ".experts." in f".{name}":
                groups.setdefault(prefix, []).append(leaf)
            elif t.kernel:
                raise ShimError(f"{manifest.path}: tensor {name} has layout {t.layout!r}; only the four "
                                f"routed-expert tensors may be in kernel layout, re-run lucifer-shard convert --force")
        if manifest.expert_layout == "model":
            bad = sorted(manifest.kernel_tensors(entry))
            if bad:
                raise ShimError(f"{manifest.path}: expert_layout is 'model' but {bad[0]} has layout "
                                f"{entry.tensors[bad[0]].layout!r}; re-run lucifer-shard convert --force")
            return {}
        for prefix, leaves in groups.items():
            if sorted(leaves) != sorted(EXPERT_TENSORS):
                raise ShimError(f"{manifest.path}: {prefix} has only {', '.join(sorted(leaves))} of "
                                f"{', '.join(EXPERT_TENSORS)}; re-run lucifer-shard convert --force")
        return groups

    def _check_expert_modules(self, model: nn.Module, manifest: Manifest, groups: dict[str, list[str]], rank: int, tp: int) -> None:
        if not groups:
            return
        arch, cap = lucifer_tuple.device_arch()
        if arch is not None and arch != manifest.arch:
            raise ShimError(f"GPU capability {cap} but files were laid out for {manifest.arch} "
                            f"({manifest.moe_variant}); re-convert with --arch {arch} or --expert-layout model")
        for prefix in groups:
            module = model.get_submodule(prefix)
            qm = getattr(module, "quant_method", None)
            if qm is None:
                continue
            if not compat.installed(RELAYOUT):
                raise ShimError(f"{prefix}: experts arrive in kernel layout but the re-layout wrapper is not "
                                f"installed ({compat.why_not_installed(RELAYOUT)}); use a supported vLLM build "
                                f"or convert with --expert-layout model")
            backend = backend_name(getattr(qm, "mxfp4_backend", None))
            if backend != manifest.moe_variant:
                raise ShimError(f"MoE backend resolved to {backend} on layer {prefix}; files require "
                                f"{manifest.moe_variant} (--moe-backend {MOE_BACKEND}, unset VLLM_USE_B12X_MOE)")
            mpc = getattr(getattr(qm, "moe", None), "moe_parallel_config", None)
            if mpc is not None:
                got = (getattr(mpc, "tp_rank", rank), getattr(mpc, "tp_size", tp), getattr(mpc, "ep_size", 1))
                if tuple(int(x) for x in got) != (rank, tp, 1):
                    raise ShimError(f"{prefix}: MoE parallel (tp_rank, tp_size, ep_size)={got}, files need "
                                    f"({rank}, {tp}, 1); disable DP/PCP/expert parallel")

    def _copy_file(self, manifest: Manifest, role: str, rank: int, f: CheckedRankFile, tensors: dict[str, TensorRecord],
                   targets: dict, digests: bool) -> dict[str, str]:
        """Read every tensor of `f` straight into its parameter (`attn_sink`: into the prefix, whose
        backend-padded rest must be -inf), from the very file whose header was checked; the tensors'
        BLAKE3 digests when `digests`."""
        reads = []
        for name, h in f.header.tensors.items():
            dst = self._destination(name, tensors[name], targets[name].data)
            # the span is dtype x shape (stheader), = the manifest's (_check_files), = the parameter's
            reads.append(reader.TensorRead(name, f.header.data_start + h.start, dst))
        fd = open_rank_file(manifest.out, f.declared.path, role, rank)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != f.identity:
                raise ShimError(f"{f.path} was replaced while vLLM loaded it (a lucifer-shard convert ran meanwhile?); "
                                f"start vLLM again when nothing writes the output directory")
            got = reader.read_tensors(f.path, reads, digests=digests, fd=fd)
        finally:
            os.close(fd)
        for name in f.header.tensors:
            t, p = tensors[name], targets[name].data
            if self._is_sink(name, t):
                n = t.shape[0]
                tail = p[n:]
                if tail.numel() and not bool(torch.all(tail == NEG_INF)):
                    raise ShimError(f"{name}: param entries [{n}:{p.shape[0]}) are not -inf after loading the "
                                    f"{n} logical heads; the attention backend initialised the padded heads "
                                    f"differently, this vLLM build is not supported")
            self.loaded[name] = str(f.path)
        return got

    def _tag(self, model: nn.Module, manifest: Manifest, entry_tensors: dict[str, TensorRecord],
             groups: dict[str, list[str]]) -> None:
        layouts = {k: v.name for k, v in manifest.doc.layouts.items()}
        for prefix in groups:
            module = model.get_submodule(prefix)
            tag = ExpertTag(prefix=prefix, moe_variant=manifest.moe_variant, layout=layouts)
            tag.data_ptrs = {n: getattr(module, n).data_ptr() for n in EXPERT_TENSORS}
            tag.shapes = {n: entry_tensors[f"{prefix}.{n}"].shape for n in EXPERT_TENSORS}
            setattr(module, TAG_ATTR, tag)
            self.tags[prefix] = tag

    @staticmethod
    def _check_digests(f: CheckedRankFile, entry: RankRecord, digests: dict[str, str]) -> None:
        """verify=full: each tensor's BLAKE3 (computed while reading, a GPU parameter's on its GPU) and the
        file's digest over its header and those (`lucifer_shard.spec.manifest.file_digest`, as lucifer-shard
        writes them) against the manifest."""
        for name, got in digests.items():
            want = entry.tensors[name].digest.removeprefix("blake3:")
            if got != want:
                raise ShimError(f"verify=full: loaded {name} digest {got[:16]}... != manifest {want[:16]}...; "
                                f"the rank file {f.path} is corrupt or tampered with, re-run lucifer-shard convert")
        got_file = file_digest(f.header.block, [digests[name] for name in f.header.tensors])  # data order
        want_file = f.declared.digest.removeprefix("blake3:")
        if got_file != want_file:
            raise ShimError(f"verify=full: {f.path} digest {got_file[:16]}... != manifest {want_file[:16]}...; "
                            f"the file header differs from the conversion, re-copy it or re-run lucifer-shard convert")

    def _check_zero_regions(self, entry: RankRecord, targets: dict) -> None:
        """verify=full: every pad region of a model-layout tensor is zero (-inf for `attn_sink`)."""
        for name, t in entry.tensors.items():
            if not t.zero_regions or t.kernel:
                continue  # kernel-layout tensors: covered by their digests
            p = targets[name].data
            if self._is_sink(name, t):
                p = p[: t.shape[0]]
            offset = 1 if t.stacked else 0
            want_inf = t.pad == "-inf"
            for dim, start, end in t.zero_regions:
                region = p.narrow(dim + offset, start, end - start)
                ok = bool(torch.all(region == NEG_INF)) if want_inf else not bool(torch.any(self._u8(region)))
                if not ok:
                    raise ShimError(f"verify=full: {name} pad region dim {dim} [{start}:{end}) is not "
                                    f"{'-inf' if want_inf else 'zero'}; the rank file was tampered with, re-run "
                                    f"lucifer-shard convert")

    @staticmethod
    def _u8(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous().reshape(-1)
        return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)

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
