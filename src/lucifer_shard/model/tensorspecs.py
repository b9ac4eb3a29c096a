"""The expansion of the rules table (`rules.RULES`) into the schema's expected checkpoint tensors and
the per-rank tensor specs: which rule instances a role has (scopes, draft places, layer predicates,
all read from `rules`), their source regions in stored units, and the check of a checkpoint's keys.
Nothing else slices tensors; a new tensor or draft kind changes `rules`, not this module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import PlanError, SourceError
from ..formats.dtypes import DTYPE_SIZE
from .config import ModelConfig
from .plan import Plan
from .rules import DRAFT_PLACES, EVERY, EXPERT, FIRST, GLOBAL, LAST, LAYER, ROLES, RULES, WHEN, Rule


def _applies(rule: Rule, cfg: ModelConfig, layer: int | None) -> bool:
    return WHEN[rule.when](cfg, layer)


@dataclass(frozen=True)
class ExpectedTensor:
    """One checkpoint tensor as the schema expects it."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    rule: Rule
    layer: int | None
    expert: int | None = None


def draft_prefixes(cfg: ModelConfig, layer: int) -> tuple[str, str]:
    """(checkpoint prefix, vLLM parameter prefix) of draft layer `layer`'s decoder block."""
    j = cfg.layer_ids("draft").index(layer)
    return f"mtp.{j}.", DRAFT_PLACES[cfg.draft_kind][LAYER].prefix.format(i=layer, j=j)


_STAGES = {EVERY: lambda j, n: True, FIRST: lambda j, n: j == 0, LAST: lambda j, n: j == n - 1}


def _scopes(cfg: ModelConfig, role: str):
    """(rule, source key prefix, target prefix, layer) for every rule instance of a role, in stage order."""
    if role == "target":
        for rule in RULES:
            if rule.scope == GLOBAL:
                yield rule, "", "", None
        for i in cfg.layer_ids("target"):
            for rule in RULES:
                if rule.scope in (LAYER, EXPERT):
                    yield rule, f"layers.{i}.", f"model.layers.{i}.", i
    else:
        places = DRAFT_PLACES[cfg.draft_kind]
        for j, i in enumerate(cfg.layer_ids("draft")):
            for rule in RULES:
                place = places.get(rule.scope)
                if place is not None and _STAGES[place.stages](j, cfg.num_mtp):
                    yield rule, f"mtp.{j}.", place.prefix.format(i=i, j=j), i if place.layered else None


def expected_sources(cfg: ModelConfig, roles: tuple[str, ...] = ROLES) -> dict[str, ExpectedTensor]:
    """Every checkpoint key the config implies, with its shape and dtype (the schema)."""
    out: dict[str, ExpectedTensor] = {}
    for role in roles:
        for rule, sprefix, _tprefix, layer in _scopes(cfg, role):
            if rule.alias or not _applies(rule, cfg, layer):
                continue
            ratio = cfg.compress_ratio(layer) if layer is not None else 0
            shape = tuple(rule.shape(cfg, ratio))
            experts = range(cfg.n_experts) if rule.scope == EXPERT else [None]
            for e in experts:
                key = sprefix + (rule.key.format(e=e) if e is not None else rule.key)
                if key in out:
                    raise AssertionError(f"two rules produce checkpoint key {key}")
                out[key] = ExpectedTensor(key, shape, rule.dtype, rule, layer, e)
    return out


# ---------------------------------------------------------------- per-rank tensor specs


@dataclass(frozen=True)
class Piece:
    """A source region copied into a target tensor, in stored units along `dim`.

    For stacked experts `source` holds `{e}` and the piece applies to every expert's matrix.
    The destination segment is [dst_start, dst_start + seg_len); its part past `length` is pad.
    """

    source: str
    dim: int
    src_start: int
    dst_start: int
    length: int
    seg_len: int

    @property
    def tail(self) -> tuple[int, int]:
        return (self.dst_start + self.length, self.dst_start + self.seg_len)


@dataclass(frozen=True)
class TensorSpec:
    """One vLLM parameter of one rank in model layout (before any expert kernel layout)."""

    name: str
    role: str
    rank: int
    shape: tuple[int, ...]  # model-layout shape; stacked experts lead with E
    dtype: str  # output safetensors dtype
    src_dtype: str
    pieces: tuple[Piece, ...]
    pad: bytes
    experts: int | None = None  # stacked expert count
    expert_tensor: str | None = None
    layer: int | None = None
    alias: bool = False  # every source is another spec's too (read again, digested once, by that spec)

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """Shape of one expert's matrix (or of the whole tensor when not stacked)."""
        return self.shape[1:] if self.experts else self.shape

    def sources(self) -> list[str]:
        """Every checkpoint key this spec reads, experts expanded."""
        keys = []
        for p in self.pieces:
            if self.experts:
                keys.extend(p.source.format(e=e) for e in range(self.experts))
            else:
                keys.append(p.source)
        return keys


def _to_storage(value: int, unit: int, what: str) -> int:
    if value % unit:
        raise PlanError(f"{what}: logical offset {value} is not a multiple of its storage unit {unit}; "
                        f"this TP size would need requantization")
    return value // unit


def build_specs(cfg: ModelConfig, plan: Plan, role: str) -> list[list[TensorSpec]]:
    """Per rank, the sorted list of tensor specs of `role` (identical names and shapes on every rank)."""
    groups: dict[str, list[tuple[Rule, str, int | None]]] = {}
    for rule, sprefix, tprefix, layer in _scopes(cfg, role):
        if not _applies(rule, cfg, layer):
            continue
        groups.setdefault(tprefix + rule.target, []).append((rule, sprefix, layer))
    ranks: list[list[TensorSpec]] = []
    for rank in range(plan.tp):
        specs = [_spec(cfg, plan, role, rank, name, members) for name, members in sorted(groups.items())]
        ranks.append(specs)
    return ranks


def _spec(cfg: ModelConfig, plan: Plan, role: str, rank: int, name: str,
          members: list[tuple[Rule, str, int | None]]) -> TensorSpec:
    members = sorted(members, key=lambda m: m[0].segment)  # stable: a stack keeps stage order
    first, _, layer = members[0]
    ratio = cfg.compress_ratio(layer) if layer is not None else 0
    pieces = []
    offset = 0
    dim = first.dim
    src_shape = tuple(first.shape(cfg, ratio))
    for rule, sprefix, _ in members:
        shape = tuple(rule.shape(cfg, ratio))
        key = sprefix + rule.key
        if rule.axis is None:
            length = shape[dim]
            seg_len = rule.padded(cfg) if rule.padded else length
            pieces.append(Piece(key, dim, 0, offset, length, seg_len))
            offset += seg_len
            continue
        axis = plan.axes[rule.axis]
        per = rule.per_index(cfg)
        what = f"{name} (rank {rank}, from {key})"
        start = _to_storage(axis.start(rank) * per, rule.unit, what)
        length = _to_storage(axis.real(rank) * per, rule.unit, what)
        seg_len = _to_storage(axis.kernel_local * per, rule.unit, what)
        pieces.append(Piece(key, dim, start, offset, length, seg_len))
        offset += seg_len
    out_shape = list(src_shape)
    out_shape[dim] = offset
    experts = cfg.n_experts if first.scope == EXPERT else None
    if experts:
        out_shape = [experts, *out_shape]
    out_dtype = first.out_dtype or first.dtype
    return TensorSpec(
        name=name, role=role, rank=rank, shape=tuple(out_shape), dtype=out_dtype, src_dtype=first.dtype,
        pieces=tuple(pieces), pad=first.pad, experts=experts, expert_tensor=first.expert_tensor, layer=layer,
        alias=first.alias,
    )


def check_source_keys(cfg: ModelConfig, present: dict[str, tuple[tuple[int, ...], str]],
                      roles: tuple[str, ...]) -> None:
    """Every present key must be expected with its shape and dtype, and every expected key present."""
    expected = expected_sources(cfg, ROLES)
    unknown = sorted(set(present) - set(expected))
    if unknown:
        raise SourceError(f"unknown tensor {unknown[0]!r}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                          + ": not in the V4-Flash schema for this config (another schema variant?)", key=unknown[0])
    wanted = {k: s for k, s in expected.items() if role_of(k) in roles}
    missing = sorted(set(wanted) - set(present))
    if missing:
        raise SourceError(f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + " required by config.json (is the config from another checkpoint?)")
    for key, (shape, dtype) in sorted(present.items()):
        want = expected[key]
        if tuple(shape) != want.shape or dtype != want.dtype:
            raise SourceError(f"tensor {key!r} is {dtype}{list(shape)}, the config implies {want.dtype}{list(want.shape)}",
                              key=key)


_MTP_KEY = re.compile(r"^mtp\.\d+\.")


def role_of(key: str) -> str:
    """The role a checkpoint key feeds: MTP keys feed the draft model."""
    return "draft" if _MTP_KEY.match(key) else "target"
