"""The virtual-TP plan, computed exactly as vLLM's virtual-TP line computes it.

`local = align_up(ceil(orig / tp), a)`, `padded = local * tp`; alignments: heads 8, routed 32,
shared 128; the vocabulary is padded globally to `lcm(64, tp)`; output groups keep the original
heads per group. The MoE backend then rounds the routed width up to its own multiple
("kernel-local", a second padding recorded separately): 128 for FlashInfer-CUTLASS, Marlin and TRT-LLM, none
for b12x (`MOE_ROUTES`).
"""
from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import asdict, dataclass

from ..errors import PlanError
from ..formats.records import fld
from ..formats.schema import Int, Str
from .arches import B12X, FLASHINFER_CUTLASS, MARLIN, arch_of_capability, arches_running
from .config import ModelConfig

HEADS_ALIGN = 8
ROUTED_ALIGN = 32
SHARED_ALIGN = 128
VOCAB_ALIGN = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: every vocabulary is padded to it, virtual TP or not
KERNEL_ALIGN = 128
MAX_TP = 8

@dataclass(frozen=True)
class MoeRoute:
    """A way stock vLLM takes the routed MXFP4 experts: the per-rank width its backends round to
    (vllm/model_executor/layers/fused_moe/oracle/mxfp4.py, `mxfp4_round_up_hidden_size_and_intermediate_size`),
    the vLLM `--moe-backend` values that take that width, and the expert layouts the files may be in; the
    GPU families it runs on are those of model/arches.py that run all its backends."""

    kernel_align: int
    backends: tuple[str, ...]
    layouts: tuple[str, ...]

    @property
    def arches(self) -> tuple[str, ...]:
        return arches_running(self.backends)


DEFAULT_ROUTE = "cutlass"
# The default: FlashInfer-CUTLASS (kernel or model layout), Marlin or TRT-LLM (model layout) round to 128. b12x
# (`vllm[b12x]`, SM120/SM121 only: `B12xExperts._supports_current_device`) plans for the exact width, which
# only has to divide into MXFP4 blocks of 32 (`B12xExperts.is_supported_config`); its load path re-lays the
# model-layout experts itself (`B12xExperts.process_weights_after_loading`), so it has no kernel layout here.
MOE_ROUTES = {
    DEFAULT_ROUTE: MoeRoute(KERNEL_ALIGN, (FLASHINFER_CUTLASS, MARLIN), ("kernel", "model")),
    B12X: MoeRoute(ROUTED_ALIGN, (B12X,), ("model",)),
}


def serving_arch(arch: str | None, moe_backend: str | None) -> str:
    """What an output converted for `arch` on MoE route `moe_backend` (`Options`) serves on, in words: a route
    fixes the GPU families whatever --arch said (diff and doctor print it)."""
    if moe_backend is not None:
        return f"arch {'/'.join(MOE_ROUTES[moe_backend].arches)} only (--moe-backend {moe_backend})"
    return f"arch {arch}" if arch else "arch any (converted without --arch)"


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class Axis:
    """One padded axis. `kernel_local` >= `local` only for the routed-expert width."""

    name: str = fld(Str())
    original: int = fld(Int())
    padded: int = fld(Int())
    local: int = fld(Int())
    kernel_local: int = fld(Int())

    def start(self, rank: int) -> int:
        """First logical index owned by `rank`."""
        return self.local * rank

    def real(self, rank: int) -> int:
        """How many of `rank`'s `local` indices exist in the checkpoint (the rest are virtual)."""
        return max(0, min(self.local, self.original - self.local * rank))


def _virtual_axis(name: str, original: int, tp: int, align: int, kernel_align: int = 1) -> Axis:
    local = align_up(-(-original // tp), align)
    return Axis(name, original, local * tp, local, align_up(local, kernel_align))


@dataclass(frozen=True)
class Plan:
    tp: int
    heads: Axis
    groups: Axis
    routed: Axis
    shared: Axis
    vocab: Axis

    @property
    def axes(self) -> dict[str, Axis]:
        return {a.name: a for a in (self.heads, self.groups, self.routed, self.shared, self.vocab)}

    def to_dict(self) -> dict:
        return {"tp": self.tp, "axes": {n: asdict(a) for n, a in self.axes.items()}}

    @property
    def pads(self) -> bool:
        return any(a.padded != a.original or a.kernel_local != a.local for a in self.axes.values())


# What a rank holds along each axis, for the remark on a rank whose share of an axis is only padding.
AXIS_HOLDS = {"heads": "attention heads", "groups": "output groups", "routed": "routed-expert columns",
              "shared": "shared-expert columns", "vocab": "vocabulary rows"}


@dataclass(frozen=True)
class PaddingOnly:
    """A rank whose whole share of one or more axes is virtual-TP padding (zeros)."""

    rank: int
    axes: tuple[str, ...]
    message: str


def padding_only(plan: Plan) -> list[PaddingOnly]:
    """Each rank that holds no real index of some axis: its weights there are zeros that take memory
    and compute for nothing (`plan` shows it, `convert` warns; one text)."""
    found = []
    for rank in range(plan.tp):
        axes = tuple(a.name for a in plan.axes.values() if a.real(rank) == 0)
        if not axes:
            continue
        held = [f"{plan.axes[n].local} {AXIS_HOLDS[n]}" for n in axes]
        what = ", ".join(held[:-1]) + " and " + held[-1] if len(held) > 1 else held[0]
        found.append(PaddingOnly(rank, axes, (
            f"--tp {plan.tp}: rank {rank} holds only padding on {', '.join(axes)}: its {what} are zeros that cost "
            f"memory and compute for nothing")))
    return found


def make_plan(cfg: ModelConfig, tp: int, moe_route: str | None = None) -> Plan:
    """The plan for `tp` ranks; raises PlanError where the model cannot be served at that size."""
    if not 1 <= tp <= MAX_TP:
        raise PlanError(f"--tp {tp} is outside the supported range 1..{MAX_TP}")
    heads = _virtual_axis("heads", cfg.num_heads, tp, HEADS_ALIGN)
    per_group = cfg.num_heads // cfg.o_groups
    if heads.local % per_group:
        raise PlanError(
            f"--tp {tp}: {heads.local} local heads do not fill whole output groups of {per_group} heads"
        )
    groups = Axis("groups", cfg.o_groups, heads.padded // per_group, heads.local // per_group,
                  heads.local // per_group)
    lcm = math.lcm(VOCAB_ALIGN, tp)
    vocab_padded = align_up(cfg.vocab_size, lcm)
    vocab = Axis("vocab", cfg.vocab_size, vocab_padded, vocab_padded // tp, vocab_padded // tp)
    return Plan(
        tp=tp,
        heads=heads,
        groups=groups,
        routed=_virtual_axis("routed", cfg.moe_intermediate, tp, ROUTED_ALIGN,
                             MOE_ROUTES[moe_route or DEFAULT_ROUTE].kernel_align),
        shared=_virtual_axis("shared", cfg.shared_intermediate, tp, SHARED_ALIGN),
        vocab=vocab,
    )


def stock_padded(axis: str, original: int) -> int:
    """What vLLM pads `axis` to without virtual TP: its VocabParallelEmbedding rounds the vocabulary
    up to a multiple of 64 at every TP size; no other axis is padded. Padding beyond this is
    virtual TP and needs vLLM's virtual-TP plan at run time."""
    return align_up(original, VOCAB_ALIGN) if axis == "vocab" else original


def gpu_capability() -> tuple[str, str] | None:
    """(name, 'major.minor') of this machine's first GPU, from nvidia-smi (no torch, no CUDA context: a
    tenth of a second); None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.splitlines()
        name, cap = (x.strip() for x in out[0].rsplit(",", 1))
        int(cap.split(".")[0])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None
    return name, cap


def local_gpu() -> str | None:
    """'NVIDIA ... (capability 12.0 = sm120)' for this machine's first GPU, from nvidia-smi; None without one."""
    found = gpu_capability()
    if found is None:
        return None
    name, cap = found
    arch = arch_of_capability(*map(int, cap.split(".")[:2]))
    return f"{name} (capability {cap} = {arch or 'no --arch'})"
