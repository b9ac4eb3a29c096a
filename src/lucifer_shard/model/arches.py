"""The one table of GPU families (`--arch`): CUDA capability, products, the MXFP4 MoE variant vLLM resolves,
the kernel layout of the routed experts, and the backends stock vLLM serves them with. plan, layouts, the
manifest, the CLI's --arch, and the shim's doctor and serve all read it (tests/test_arch_table.py finds
any second copy).

sm121 is GB10 (DGX Spark), 12.1: vLLM 0.33.0 and FlashInfer 0.7.2.post1 treat it as the SM120 family (the
MXFP4 x MXFP8 CUTLASS MoE, FlashInfer's "sparse" DSv4 MLA for SM120/SM121), so its files are sm120's.
"""
from __future__ import annotations

from dataclasses import dataclass

# The attention and MoE backends stock vLLM serves DeepSeek-V4-Flash's MXFP4 experts with.
FLASHINFER_MLA = "FLASHINFER_MLA_SPARSE_DSV4"
FLASHMLA = "FLASHMLA_SPARSE_DSV4"
FLASHINFER_CUTLASS = "flashinfer_cutlass"
MARLIN = "marlin"
B12X = "b12x"
# Kernel-layout experts are in FlashInfer CUTLASS's layout, so they take its MoE on every family.
KERNEL_MOE = FLASHINFER_CUTLASS
# The Lucifer tuple (docs/design/vllm-extension-points.md §3.4): the (attention, MoE) pair the mlow/vllm builds' policy accepts.
FORK_TUPLE = (FLASHINFER_MLA, FLASHINFER_CUTLASS)

# What FlashInfer-CUTLASS's post-load processing does per tensor (docs/design/kernel-layouts.md §2.1), per FlashInfer
# layout generation (--flashinfer-layout). sm100 and sm120 share the MXFP4 x MXFP8 path, which has no
# generation split.
_MXFP8_STEPS = {
    "w13_weight": ("swap_halves",),
    "w13_weight_scale": ("swap_halves", "swizzle_128x4"),
    "w2_weight": (),
    "w2_weight_scale": ("swizzle_128x4",),
}
_MXFP8_KERNEL = {"folded": _MXFP8_STEPS, "legacy": _MXFP8_STEPS}
_BF16_KERNEL = {
    "folded": {
        "w13_weight": ("swap_halves", "interleave_sm90"),
        "w13_weight_scale": ("swap_halves", "fold_scales_sm90"),
        "w2_weight": ("interleave_sm90",),
        "w2_weight_scale": ("fold_scales_sm90",),
    },
    "legacy": {
        "w13_weight": ("swap_halves", "interleave_sm90_legacy"),
        "w13_weight_scale": ("swap_halves", "fold_scales_sm90_legacy"),
        "w2_weight": ("interleave_sm90_legacy",),
        "w2_weight_scale": ("fold_scales_sm90_legacy",),
    },
}


@dataclass(frozen=True)
class Arch:
    """One --arch. `moe_backends`: the stock vLLM MoE backends that run its routed MXFP4 experts, the one
    serve picks for model layout first (a MoE route runs where all its backends do: model/plan.MOE_ROUTES)."""

    name: str
    capability: tuple[int, int | None]  # CUDA (major, minor); minor None: every minor of that major
    gpus: str  # its products, as doctor names them
    moe_variant: str  # the FlashInfer-CUTLASS MXFP4 variant vLLM resolves (`--moe-backend flashinfer_cutlass`)
    kernel_steps: dict[str, dict[str, tuple[str, ...]]]  # --flashinfer-layout -> expert tensor -> model/layouts steps
    attention: str  # stock vLLM's attention backend on it
    moe_backends: tuple[str, ...]
    caveat: str = ""  # what serve's --help adds to its backends
    # stock vLLM's attention here (DeepseekV4FlashInferSM120Attention) refuses to build unless FlashInfer's DSV4
    # sparse-MLA decode dispatch admits the rank's (padded heads, top_k): doctor reads it (serving/kernels.py)
    sparse_mla_dispatch: bool = False

    def backends(self, expert_layout: str) -> tuple[str, str]:
        """(attention, MoE backend) stock vLLM serves an output of this family in `expert_layout` with."""
        return self.attention, KERNEL_MOE if expert_layout == "kernel" else self.moe_backends[0]

    @property
    def layout_generations(self) -> bool:
        """Whether its kernel layout differs between FlashInfer's layout generations (--flashinfer-layout)."""
        first, *rest = self.kernel_steps.values()
        return any(steps != first for steps in rest)


# SM90 has no FlashInfer DSv4 sparse MLA (`_resolve_dsv4_sparse_mla_backend`: SM100/103/107/120/121), so FlashMLA
# sparse (24 local heads padded to 64); its model-layout MoE is Marlin, compiled into the wheel (FlashInfer's SM90
# CUTLASS MoE is a JIT build of an hour or more unless a prebuilt module is installed). b12x runs on the SM120
# family only (`B12xExperts._supports_current_device`). Order: --arch's choices.
ARCH_TABLE = (
    Arch("sm120", (12, 0), "RTX PRO 6000, RTX 5090", "FLASHINFER_CUTLASS_MXFP4_MXFP8", _MXFP8_KERNEL, FLASHINFER_MLA,
         (FLASHINFER_CUTLASS, MARLIN, B12X), sparse_mla_dispatch=True),
    Arch("sm121", (12, 1), "DGX Spark GB10", "FLASHINFER_CUTLASS_MXFP4_MXFP8", _MXFP8_KERNEL, FLASHINFER_MLA,
         (FLASHINFER_CUTLASS, MARLIN, B12X), caveat="GB10: not yet run", sparse_mla_dispatch=True),
    Arch("sm100", (10, None), "B200, GB200", "FLASHINFER_CUTLASS_MXFP4_MXFP8", _MXFP8_KERNEL, FLASHINFER_MLA,
         (FLASHINFER_CUTLASS, MARLIN)),
    Arch("sm90", (9, None), "H100, H200", "FLASHINFER_CUTLASS_MXFP4_BF16", _BF16_KERNEL, FLASHMLA,
         (MARLIN, FLASHINFER_CUTLASS)),
)
ARCH = {a.name: a for a in ARCH_TABLE}
ARCHES = tuple(ARCH)
MOE_VARIANT = {a.name: a.moe_variant for a in ARCH_TABLE}


def family(arch: str) -> str:
    """The --arch whose files `arch`'s are: the first of the table with its CUDA major and kernel layout."""
    a = ARCH[arch]
    return next(f.name for f in ARCH_TABLE if f.capability[0] == a.capability[0] and f.kernel_steps == a.kernel_steps)


FAMILIES = tuple(dict.fromkeys(map(family, ARCHES)))  # one --arch per family (a CUDA major and its kernel layout)
# The families whose kernel-layout files the forks' policy serves (their stock tuple is the Lucifer tuple).
FORK_KERNEL_ARCHES = tuple(a.name for a in ARCH_TABLE if a.backends("kernel") == FORK_TUPLE)
# The families whose kernel layout follows FlashInfer's layout generation (--flashinfer-layout).
GENERATION_ARCHES = tuple(a.name for a in ARCH_TABLE if a.layout_generations)


def arch_of_capability(major: int, minor: int = 0) -> str | None:
    """The --arch of a GPU of CUDA compute capability `major`.`minor` (None: no layout for it)."""
    return next((a.name for a in ARCH_TABLE if a.capability[0] == major and a.capability[1] in (minor, None)), None)


def arches_running(backends: tuple[str, ...]) -> tuple[str, ...]:
    """The --arch values on which stock vLLM runs every one of `backends`."""
    return tuple(a.name for a in ARCH_TABLE if set(backends) <= set(a.moe_backends))


def gpu_families() -> str:
    """'sm90 (H100, H200), ...': the families by product name, oldest first (doctor's refusal)."""
    return ", ".join(f"{a.name} ({a.gpus})" for a in sorted(ARCH_TABLE, key=lambda a: (a.capability[0],
                                                                                       a.capability[1] or 0)))


def backends_help() -> list[str]:
    """serve --help's lines of (attention, MoE backend) per --arch on stock vLLM, families of one pair together."""
    pairs = {a.backends("model"): [b.name for b in ARCH_TABLE if b.backends("model") == a.backends("model")]
             for a in ARCH_TABLE}
    heads = {pair: ", ".join(names) + ":" for pair, names in pairs.items()}
    width = max(map(len, heads.values()))
    lines = []
    for (attention, moe), names in pairs.items():
        kernel = "" if moe == KERNEL_MOE else f" (model layout) or {KERNEL_MOE} (kernel layout)"
        caveats = "; ".join(f"{n}, {ARCH[n].caveat}" for n in names if ARCH[n].caveat)
        lines.append(f"{heads[(attention, moe)]:<{width}} {attention}, {moe}{kernel}" + (f"  ({caveats})" if caveats
                                                                                          else ""))
    return lines
