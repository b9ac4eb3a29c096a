"""check-numerics: the rank files, summed over ranks, compute what the unsharded source computes.

For each chosen layer the same random activations and routing go through
  (a) the unsharded SOURCE tensors (routed w13 built as [w1 ; w3] with I = moe_intermediate_size,
      unpadded; shared w1/w3/w2; wo_a/wo_b over the original heads), and
  (b) every rank's tensors as written, read back through the manifest's inverse layout
      (`Output.model_tensor`), with the rank's slice of the (padded) head axis;
the rank partials are summed in fp32, as the all-reduce would, and compared with (a).

Components and tolerances (relative Frobenius error ||sum - ref|| / ||ref||):
  routed MoE          5e-3  docs/design/kernel-layouts.md §5.4 (TP3 sum vs TP1): each rank rounds its GEMM2
                             rows and its finalize output to BF16, the unsharded run rounds once.
  shared expert       1e-4  } exact in fp32 up to summation order: the column-parallel halves
  output projection   1e-4  } compute the same dot products, the row-parallel down/wo_b sums
                             over K in pieces; BF16 activations may flip one ulp rarely. Observed
                             errors are ~1e-7; a misplaced slice gives O(1).
  virtual heads       0     (exact) heads past num_attention_heads (rank tp-1's virtual heads and
                             output group `o_groups`), fed non-zero attention output, contribute 0.
Everything is done one layer at a time, and for routed experts only the experts the random
routing picks are read (at most tokens*top_k per layer), so it runs on the real checkpoint on a
CPU box. A source on the Hub (not in the Hugging Face cache) is read the same way, each tensor by a
ranged request (`source.checkpoint.Checkpoint.ranged`): the bytes of the tensors checked, not the checkpoint.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import stops
from ..errors import LuciferError, OutputError, SourceError
from ..model.tensorspecs import draft_prefixes
from ..output.manifest_types import source_model
from ..source.checkpoint import Checkpoint, open_source
from .numerics import (attn_output_reference, dequant_fp8_block, mlp_reference, moe_reference, moe_reference_streamed,
                       shared_expert_reference)
from .outdir import Output

logger = logging.getLogger("lucifer_shard.check_numerics")  # -v: one line per layer, -vv: per component

ROUTED, SHARED, ATTN, VIRTUAL = "routed MoE", "shared expert", "output projection", "virtual heads"
TOLERANCE = {ROUTED: 5e-3, SHARED: 1e-4, ATTN: 1e-4, VIRTUAL: 0.0}
MAX_TOKENS = 4096  # x, attention output and routing per token: about 5 MiB each at Flash size
MAX_SEED = (1 << 32) - 1  # seeds per layer are seed * 1_000_003 + layer: inside torch's 64 bits


@dataclass
class Result:
    layer: int
    component: str
    max_abs: float | None  # max |sum - ref|; None (JSON null) where it is not a finite number
    max_ref: float | None  # max |ref|
    rel_fro: float | None  # ||sum - ref||_F / ||ref||_F (for virtual heads: max |contribution|)
    tol: float
    ok: bool
    detail: str = ""

    def __post_init__(self) -> None:  # the report holds numbers or null, never NaN (strict JSON)
        for name in ("max_abs", "max_ref", "rel_fro"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                setattr(self, name, None)


@dataclass
class NumericsReport:
    out: str
    model: str
    tp: int
    tokens: int
    seed: int
    layers: list[int]
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def to_dict(self) -> dict:
        return {"out": self.out, "model": self.model, "tp": self.tp, "tokens": self.tokens, "seed": self.seed,
                "layers": self.layers, "tolerances": TOLERANCE, "ok": self.ok,
                "results": [asdict(r) for r in self.results]}

    def lines(self) -> list[str]:
        head = f"{'layer':>5}  {'component':<18} {'max|err|':>10} {'max|ref|':>10} {'rel.Frob':>10} {'tol':>8}  result"
        rows = [head, "-" * len(head)]
        for r in self.results:
            rows.append(f"{r.layer:>5}  {r.component:<18} {_num(r.max_abs)} {_num(r.max_ref)} {_num(r.rel_fro)} "
                        f"{r.tol:>8.0e}  {'ok' if r.ok else 'FAIL'}{'  ' + r.detail if r.detail else ''}")
        bad = sum(not r.ok for r in self.results)
        rows.append(f"TP{self.tp} sum vs unsharded, {self.tokens} tokens, seed {self.seed}: "
                    + ("all within tolerance" if not bad else f"{bad} component(s) past tolerance"))
        return rows


def _num(x: float | None) -> str:
    return f"{x:>10.3e}" if x is not None else f"{'NaN/Inf':>10}"


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, float]:
    """(max |got - ref|, max |ref|, relative Frobenius error), in fp64; NaN propagates."""
    ref, got = ref.double().cpu(), got.double().cpu()
    d = got - ref
    norm = float(ref.norm())
    rel = float(d.norm()) / norm if norm > 0 else float(d.norm())
    return float(d.abs().max()), float(ref.abs().max()), rel


def _result(layer: int, comp: str, ref: torch.Tensor, got: torch.Tensor) -> Result:
    max_abs, max_ref, rel = compare(ref, got)
    if not bool(torch.isfinite(ref).all()):
        raise NotFiniteReference(comp)  # the source's fault, not the rank files': `check_layer` says which tensors
    finite = bool(torch.isfinite(got).all())
    ok = finite and rel <= TOLERANCE[comp]
    return Result(layer, comp, max_abs, max_ref, rel, TOLERANCE[comp], ok, "" if finite else "NaN/Inf in the rank sum")


class NotFiniteReference(Exception):
    """The unsharded reference of a component is not finite (raised to `check_layer`)."""

    def __init__(self, component: str):
        super().__init__(component)
        self.component = component


# The source tensors each component's reference computes with (routed: the experts the routing picked).
REFERENCE_SOURCES = {
    ROUTED: lambda sp, experts: [f"{sp}ffn.experts.{e}.{w}.{k}" for e in experts for w in ("w1", "w3", "w2")
                                 for k in ("weight", "scale")],
    SHARED: lambda sp, experts: [f"{sp}ffn.shared_experts.{w}.{k}" for w in ("w1", "w3", "w2")
                                 for k in ("weight", "scale")],
    ATTN: lambda sp, experts: [f"{sp}attn.{w}.{k}" for w in ("wo_a", "wo_b") for k in ("weight", "scale")],
}
# An E8M0 scale past 2^SCALE_EXP_LIMIT is no model's (MXFP4 and FP8 block scales sit near 2^-8..2^4); two
# such scaled products in a row pass BF16's range (2^128).
SCALE_EXP_LIMIT = 32
FLOAT_DTYPES = ("BF16", "F16", "F32", "F8_E4M3")


def not_numbers(ckpt: Checkpoint, key: str) -> str | None:
    """Why the source tensor `key` does not hold a model's numbers (NaN/Inf values, NaN or absurd
    scales), or None when it does."""
    dtype = ckpt.tensors[key].dtype
    t = _full(ckpt, key)
    if dtype == "F8_E8M0":
        b = _u8(t)
        nan, top = int((b == 0xFF).sum()), int(b.max()) - 127
        if nan:
            return f"{key}: {nan} of {b.numel()} scales are NaN (0xFF)"
        return f"{key}: scales up to 2^{top}" if top > SCALE_EXP_LIMIT else None
    if dtype in FLOAT_DTYPES:
        bad = int((~torch.isfinite(t.float())).sum())
        return f"{key}: {bad} of {t.numel()} values are NaN/Inf" if bad else None
    return None


def refuse_not_finite(ckpt: Checkpoint, model: str | Path, layer: int, component: str, sp: str,
                      experts: list[int]) -> SourceError:
    """One line: the layer and the source tensors whose values make the reference not finite, and why."""
    whys = [w for w in (not_numbers(ckpt, k) for k in REFERENCE_SOURCES[component](sp, experts)) if w]
    shown = "; ".join(whys[:3]) + (f"; and {len(whys) - 3} more tensors" if len(whys) > 3 else "")
    found = (f"{model}'s weights are not a model's finite numbers ({shown}): a `synth --fill pattern` checkpoint? "
             if whys else f"{model}'s weights overflow in it: ")
    return SourceError(f"layer {layer} {component}: the unsharded reference is not finite, so nothing can be compared; "
                       f"{found}check-numerics needs real numbers (the real weights, or `synth --fill random`; diff "
                       f"proves a pattern checkpoint byte for byte)")


# ------------------------------------------------------------------ inputs


@dataclass
class Inputs:
    x: torch.Tensor  # bf16 [T, H]
    topk_ids: torch.Tensor  # int64 [T, k], distinct experts per token
    topk_weights: torch.Tensor  # fp32 [T, k]
    o: torch.Tensor  # bf16 [T, padded_heads, head_dim], non-zero everywhere (virtual heads too)


def make_inputs(hidden: int, n_experts: int, top_k: int, padded_heads: int, head_dim: int,
                tokens: int, seed: int) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, n_experts, generator=g).argsort(dim=1)[:, :top_k]
    w = torch.rand(tokens, top_k, generator=g) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    o = torch.randn(tokens, padded_heads, head_dim, generator=g).to(torch.bfloat16)
    return Inputs(x, ids, w, o)


# ------------------------------------------------------------------ tensor access


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _full(ckpt: Checkpoint, key: str) -> torch.Tensor:
    shape = ckpt.tensors[key].shape
    return ckpt.read(key, tuple(slice(0, n) for n in shape))


def source_experts(ckpt: Checkpoint, prefix: str, experts: list[int]) -> tuple[torch.Tensor, ...]:
    """Unsharded (w13 [U, 2I, H/2], w13_scale, w2 [U, H, I/2], w2_scale) uint8 in model layout,
    w13 = [w1 ; w3] with I = moe_intermediate_size (no padding), for the listed experts in order."""
    fetch = SourceExperts(ckpt, prefix)
    return tuple(torch.stack(t) for t in zip(*(fetch(e) for e in experts)))


class SourceExperts:
    """expert(e) -> unsharded (w13 = [w1 ; w3], w13_scale, w2, w2_scale) uint8, read on demand."""

    def __init__(self, ckpt: Checkpoint, prefix: str):
        self.ckpt, self.prefix = ckpt, prefix
        self.n_experts = ckpt.config.n_experts

    def __call__(self, e: int) -> tuple[torch.Tensor, ...]:
        def get(name: str) -> torch.Tensor:
            return _u8(_full(self.ckpt, f"{self.prefix}ffn.experts.{e}.{name}"))

        return (torch.cat([get("w1.weight"), get("w3.weight")]), torch.cat([get("w1.scale"), get("w3.scale")]),
                get("w2.weight"), get("w2.scale"))


class RankExperts:
    """expert(e) -> one rank's (w13, w13_scale, w2, w2_scale) of expert e as written, in model
    layout (the manifest's inverse layout applied to that expert only), read on demand."""

    NAMES = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    def __init__(self, output: Output, role: str, rank: int, prefix: str):
        self.output, self.role, self.rank = output, role, rank
        self.names = [f"{prefix}ffn.experts.routed_experts.{n}" for n in self.NAMES]
        self.n_experts = output.info(role, rank, self.names[0]).experts

    def __call__(self, e: int) -> tuple[torch.Tensor, ...]:
        return tuple(_u8(self.output.model_tensor(self.role, self.rank, n, index=slice(e, e + 1)))[0]
                     for n in self.names)


class Cached:
    """An expert fetch that keeps what it read (for repeated evaluations of a small model)."""

    def __init__(self, fetch):
        self.fetch, self.n_experts, self.seen = fetch, fetch.n_experts, {}

    def __call__(self, e: int) -> tuple[torch.Tensor, ...]:
        if e not in self.seen:
            self.seen[e] = self.fetch(e)
        return self.seen[e]


def moe_run(x, ids, w, experts, limit) -> torch.Tensor:
    """BF16 MoE output for experts given as a tensor tuple (w13, w13s, w2, w2s) or an expert fetch."""
    if isinstance(experts, tuple):
        return moe_reference(x, ids, w, *experts, limit)
    return moe_reference_streamed(x, ids, w, experts.n_experts, experts, limit)


def moe_tp_sum(x, ids, w, rank_experts, limit) -> torch.Tensor:
    """fp32 sum of the BF16 MoE partials of every rank (tensor tuples or expert fetches)."""
    return sum(moe_run(x, ids, w, t, limit).float() for t in rank_experts)


# ------------------------------------------------------------------ per layer


def _prefixes(cfg, layer: int) -> tuple[str, str, str]:
    """(role, source key prefix, vLLM name prefix) of a vLLM layer index."""
    if layer in cfg.layer_ids("target"):
        return "target", f"layers.{layer}.", f"model.layers.{layer}."
    draft = cfg.layer_ids("draft")
    if layer in draft:
        return ("draft", *draft_prefixes(cfg, layer))
    raise LuciferError(f"--layers: layer {layer} does not exist (target 0..{cfg.num_layers - 1}"
                       + (f", {cfg.draft_kind.upper()} {draft[0]}..{draft[-1]})" if draft else ")"))


@dataclass
class LayerWeights:
    """One layer's tensors: unsharded from the source, and per rank as written (model layout)."""

    layer: int
    src_moe: SourceExperts | Cached  # unsharded experts, w13 = [w1 ; w3], read on demand
    rank_moe: list[RankExperts | Cached]  # per rank, as written (model layout)
    src_shared: tuple  # (w1, w3, w2) dequantised fp32
    rank_shared: list[tuple]  # per rank (gate_up, gate_up_scale, down, down_scale) as stored
    src_attn: tuple  # (wo_a, wo_a_scale, wo_b, wo_b_scale) over the original heads/groups
    rank_attn: list[tuple]  # per rank, the same
    local_heads: int  # heads per rank implied by the rank's wo_a
    num_heads: int  # original heads
    heads_per_group: int
    swiglu_limit: float


def load_layer(ckpt: Checkpoint, output: Output, layer: int, cache: bool = False) -> LayerWeights:
    """One layer's tensors from the source and from every rank. Routed experts are read on
    demand, one expert at a time (kept when `cache`, for repeated evaluations)."""
    cfg = ckpt.config
    role, sp, tp_ = _prefixes(cfg, layer)
    if role not in output.roles:
        raise OutputError(f"layer {layer} is a draft layer but {output.root} has no draft role (converted --no-mtp)")
    tp = output.tp
    wrap = Cached if cache else (lambda f: f)

    def fp8(key: str) -> torch.Tensor:
        return dequant_fp8_block(_full(ckpt, f"{key}.weight"), _full(ckpt, f"{key}.scale"))

    s, t = f"{sp}ffn.shared_experts.", f"{tp_}ffn.shared_experts."
    a, w = f"{sp}attn.", f"{tp_}attn."
    rank_attn = [tuple(output.model_tensor(role, r, w + k) for k in
                       ("wo_a.weight", "wo_a.weight_scale_inv", "wo_b.weight", "wo_b.weight_scale_inv"))
                 for r in range(tp)]
    hpg = cfg.num_heads // cfg.o_groups
    return LayerWeights(
        layer=layer,
        src_moe=wrap(SourceExperts(ckpt, sp)),
        rank_moe=[wrap(RankExperts(output, role, r, tp_)) for r in range(tp)],
        src_shared=(fp8(s + "w1"), fp8(s + "w3"), fp8(s + "w2")),
        rank_shared=[tuple(output.model_tensor(role, r, t + k) for k in
                           ("gate_up_proj.weight", "gate_up_proj.weight_scale_inv",
                            "down_proj.weight", "down_proj.weight_scale_inv")) for r in range(tp)],
        src_attn=tuple(_full(ckpt, a + k) for k in ("wo_a.weight", "wo_a.scale", "wo_b.weight", "wo_b.scale")),
        rank_attn=rank_attn,
        local_heads=rank_attn[0][0].shape[0] // cfg.o_lora_rank * hpg,
        num_heads=cfg.num_heads, heads_per_group=hpg, swiglu_limit=cfg.swiglu_limit,
    )


def evaluate(lw: LayerWeights, inp: Inputs) -> list[Result]:
    """Every component of one layer: the unsharded result vs the fp32 sum of the rank partials."""
    layer, limit, tp = lw.layer, lw.swiglu_limit, len(lw.rank_moe)
    results = []

    # routed MoE: only the experts the routing picks are read, one at a time
    ref = moe_run(inp.x, inp.topk_ids, inp.topk_weights, lw.src_moe, limit).float()
    got = moe_tp_sum(inp.x, inp.topk_ids, inp.topk_weights, lw.rank_moe, limit)
    results.append(_result(layer, ROUTED, ref, got))

    # shared expert
    ref = mlp_reference(inp.x, *lw.src_shared, limit)
    got = sum(shared_expert_reference(inp.x, *t, limit) for t in lw.rank_shared)
    results.append(_result(layer, SHARED, ref, got))

    # output projection: the original heads through the source; each rank its slice of the padded heads
    lh = lw.local_heads
    if lh * tp > inp.o.shape[1]:
        raise OutputError(f"wo_a of layer {layer} implies {lh * tp} heads, more than the plan's {inp.o.shape[1]}")
    ref = attn_output_reference(inp.o[:, :lw.num_heads], *lw.src_attn)
    got = sum(attn_rank_partials(inp.o, lw))
    results.append(_result(layer, ATTN, ref, got))

    if lh * tp > lw.num_heads:  # virtual heads: only they are non-zero, every rank's result must be 0
        o_virtual = inp.o.clone()
        o_virtual[:, :lw.num_heads] = 0
        parts = attn_rank_partials(o_virtual, lw)
        worst = max(float(p.abs().max()) for p in parts)
        finite = all(bool(torch.isfinite(p).all()) for p in parts)
        hpg = lw.heads_per_group
        results.append(Result(layer, VIRTUAL, worst, float(o_virtual.float().abs().max()), worst, 0.0,
                              finite and worst == 0.0,
                              f"{span('heads', lw.num_heads, lh * tp - 1)}, "
                              f"{span('groups', lw.num_heads // hpg, lh * tp // hpg - 1)}"))
    for r in results:
        logger.debug("layer %d %s: relative error %s (tolerance %s), max |diff| %s of max |ref| %s %s", layer,
                     r.component, r.rel_fro, r.tol, r.max_abs, r.max_ref, r.detail)
    logger.info("layer %d: %d of %d component(s) within tolerance", layer, sum(r.ok for r in results), len(results))
    return results


def span(what: str, first: int, last: int) -> str:
    """'groups 8' for one index, 'groups 8..9' for a range."""
    return f"{what} {first}" if first == last else f"{what} {first}..{last}"


def attn_rank_partials(o: torch.Tensor, lw: LayerWeights) -> list[torch.Tensor]:
    """Each rank's output-projection partial for its slice [r*local, (r+1)*local) of the padded heads."""
    lh = lw.local_heads
    return [attn_output_reference(o[:, r * lh:(r + 1) * lh], *w) for r, w in enumerate(lw.rank_attn)]


def check_layer(ckpt: Checkpoint, output: Output, layer: int, inp: Inputs, model: str | Path = "MODEL") -> list[Result]:
    try:
        return evaluate(load_layer(ckpt, output, layer), inp)
    except NotFiniteReference as e:
        experts = sorted(set(inp.topk_ids.flatten().tolist()))
        raise refuse_not_finite(ckpt, model, layer, e.component, _prefixes(ckpt.config, layer)[1], experts) from None


def default_layers(cfg) -> list[int]:
    """The first hash-routed layer and the first score-routed (bias) layer: both router kinds,
    two different attention kinds on V4-Flash; every V4 layer has routed experts."""
    layers = [0]
    if 0 < cfg.num_hash_layers < cfg.num_layers:
        layers.append(cfg.num_hash_layers)
    elif cfg.num_layers > 1:
        layers.append(1)
    return layers


def parse_layers(text: str | None, cfg) -> list[int]:
    """The layers `--layers` names; refused: a malformed or empty list, a range that runs backwards
    (3-1 would check nothing and pass), an index that does not exist."""
    if text is None:
        return default_layers(cfg)
    if text.strip() == "all":
        return cfg.layer_ids("target") + cfg.layer_ids("draft")
    usage = f"--layers {text[:40]!r}: expected layer indices like 3,4 or 0-2 or all"
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            bounds = [int(x) for x in part.split("-")] if part else []
        except ValueError:
            raise LuciferError(usage) from None
        if len(bounds) not in (1, 2) or any(b < 0 for b in bounds):
            raise LuciferError(usage)
        for i in bounds:
            _prefixes(cfg, i)  # exists (before a range is built from it)
        if len(bounds) == 2 and bounds[0] > bounds[1]:
            raise LuciferError(f"--layers {part!r}: the range runs backwards and names no layer; write low-high, "
                               f"e.g. {bounds[1]}-{bounds[0]}")
        out.extend(range(bounds[0], bounds[-1] + 1))
    if not out:
        raise LuciferError(f"{usage} (it names no layer)")
    return sorted(set(out))


def check_numerics(out: Path, model: str | None = None, layers: str | list[int] | None = None, tokens: int = 16,
                   seed: int = 0, progress: bool = True) -> NumericsReport:
    """Run the check (MODEL default: the source the manifest records); never raises for a numerical
    failure (inspect `NumericsReport.ok`)."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise LuciferError(f"--tokens {tokens}: choose 1..{MAX_TOKENS} (the activations of every token are held "
                           f"in memory; a few dozen already exercise every rank's slices)")
    if not 0 <= seed <= MAX_SEED:
        raise LuciferError(f"--seed {seed}: choose 0..{MAX_SEED}")
    output = Output(Path(out))
    model, revision, _ = source_model(out, output.manifest, model)
    ckpt = open_source(model, revision)
    want = output.manifest.source.fingerprint
    if want and want != ckpt.fingerprint:
        raise OutputError(f"{out} was converted from a different checkpoint than {model} "
                          f"(source fingerprint {want[:12]} vs {ckpt.fingerprint[:12]})")
    ckpt.ranged = ckpt.hub is not None  # on the Hub, not in the cache: the tensors checked, by ranged requests
    cfg = ckpt.config
    ids = layers if isinstance(layers, list) else parse_layers(layers, cfg)
    heads = output.manifest.plan.axes["heads"].padded
    report = NumericsReport(str(out), str(model), output.tp, tokens, seed, ids)
    from tqdm import tqdm

    try:
        for layer in tqdm(ids, desc="check-numerics", unit="layer", disable=not progress):
            stops.check()
            inp = make_inputs(cfg.hidden_size, cfg.n_experts, cfg.top_k, heads, cfg.head_dim, tokens,
                              seed * 1_000_003 + layer)
            report.results.extend(check_layer(ckpt, output, layer, inp, model))
    finally:
        ckpt.close()
        output.close()
    return report
