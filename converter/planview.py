"""The `plan` report: the audit's axis table, per-family source ranges per rank, byte totals."""
from __future__ import annotations

import re

from .config import ModelConfig
from .convert import layout_name, stored_shape, tensor_layouts
from .manifest import Options
from .plan import MOE_VARIANT, Plan
from .rules import DTYPE_SIZE, TensorSpec, build_specs

_LAYER = re.compile(r"^model\.layers\.\d+\.")


def family(name: str) -> str:
    return _LAYER.sub("model.layers.*.", name)


def plan_specs(cfg: ModelConfig, plan: Plan, mtp: bool) -> dict[str, list[list[TensorSpec]]]:
    roles = ["target"] + (["draft"] if mtp and cfg.num_mtp else [])
    return {role: build_specs(cfg, plan, role) for role in roles}


def plan_json(cfg: ModelConfig, plan: Plan, options: Options) -> dict:
    """Per role, rank and output tensor: name, shape, dtype, layout and source slices."""
    layouts = tensor_layouts(options)
    roles = {}
    for role, ranks in plan_specs(cfg, plan, options.mtp).items():
        roles[role] = [
            {"rank": r, "tensors": [{
                "name": s.name, "shape": list(stored_shape(s, layouts)), "model_shape": list(s.shape),
                "dtype": s.dtype, "layout": layout_name(s, layouts), "experts": s.experts,
                "sources": [{"key": p.source, "dim": p.dim, "start": p.src_start, "length": p.length,
                             "dst_offset": p.dst_start, "segment": p.seg_len} for p in s.pieces],
            } for s in specs]}
            for r, specs in enumerate(ranks)
        ]
    return {"plan": plan.to_dict(), "arch": options.arch, "moe_variant": MOE_VARIANT[options.arch],
            "expert_layout": options.expert_layout, "roles": roles}


def _fmt_bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**30:.2f} GiB)"


def plan_lines(cfg: ModelConfig, plan: Plan, options: Options) -> list[str]:
    lines = [f"virtual-TP plan for TP={plan.tp} ({'padded' if plan.pads else 'plain split, nothing pads'}); "
             f"arch {options.arch}: {MOE_VARIANT[options.arch]}, experts in {options.expert_layout} layout", ""]
    lines.append(f"{'axis':<8} {'original':>9} {'padded':>9} {'per rank':>9} {'kernel-local':>13}   real per rank")
    for a in plan.axes.values():
        reals = "/".join(str(a.real(r)) for r in range(plan.tp))
        lines.append(f"{a.name:<8} {a.original:>9} {a.padded:>9} {a.local:>9} {a.kernel_local:>13}   {reals}")
    specs = plan_specs(cfg, plan, options.mtp)
    layouts = tensor_layouts(options)
    lines += ["", "per tensor family: source range per rank in stored units [start, end) -> tail"]
    seen = set()
    for role, ranks in specs.items():
        for i, spec in enumerate(ranks[0]):
            fam = family(spec.name)
            if fam.replace("mtp_block.", "") in seen or all(
                    p.length == p.seg_len and p.src_start == 0 for r in ranks for p in r[i].pieces):
                continue  # replicated, or an MTP block family already shown for the target
            seen.add(fam)
            lines.append(f"  [{role}] {fam}  {spec.dtype}{list(stored_shape(spec, layouts))}  "
                         f"layout {layout_name(spec, layouts)}")
            for seg, _ in enumerate(spec.pieces):
                parts = []
                for r in range(plan.tp):
                    p = ranks[r][i].pieces[seg]
                    parts.append(f"r{r} [{p.src_start},{p.src_start + p.length})+{p.seg_len - p.length}")
                key = spec.pieces[seg].source.split(".", 2)[-1] if spec.layer is not None else spec.pieces[seg].source
                lines.append(f"      {key} dim {spec.pieces[seg].dim}: " + "  ".join(parts))
    lines.append("  (every other tensor is replicated whole on each rank; the MTP block's families match the target's)")
    lines += ["", "bytes per rank (zero padding = virtual-TP and kernel tails)"]
    for role, ranks in specs.items():
        for r, rank_specs in enumerate(ranks):
            total = sum(s.nbytes for s in rank_specs)
            pad = sum(_pad_bytes(s) for s in rank_specs)
            lines.append(f"  {role} rank {r}: {len(rank_specs)} tensors, {_fmt_bytes(total)}, "
                         f"zero padding {_fmt_bytes(pad)}")
    return lines


def _pad_bytes(spec: TensorSpec) -> int:
    """Bytes of pad in one rank's tensor: pad-region extent times the other dims."""
    item = DTYPE_SIZE[spec.dtype]
    shape = spec.matrix_shape
    n = 0
    for p in spec.pieces:
        lo, hi = p.tail
        other = 1
        for d, size in enumerate(shape):
            if d != p.dim:
                other *= size
        n += (hi - lo) * other * item
    return n * (spec.experts or 1)
