"""Everything a conversion decides before the first byte: the checkpoint, plan, rank specs, expert
layouts, the split of each rank's tensors into files (parts) and the conversion id; and from them,
the exact size of every rank file (`plan` shows it, convert checks the room with it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..spec import footprint
from ..spec.layouts import Layout, tensor_layouts
from ..spec.manifest import CONTENT_PLACEHOLDER, Options, conversion_id, file_metadata, part_path
from ..spec.plan import Plan, make_plan
from ..spec.rules import TensorSpec, build_specs
from ..spec.source import Checkpoint, hub_origin, open_checkpoint, resolve_model, side_files
from .stwriter import TensorHeader, encode_header


@dataclass
class Part:
    role: str
    index: int
    names: list[str]
    bytes_per_rank: int


def stored_shape(spec: TensorSpec, layouts: dict[str, Layout]) -> tuple[int, ...]:
    if spec.expert_tensor:
        return (spec.experts, *layouts[spec.expert_tensor].kernel_shape(spec.matrix_shape))
    return spec.shape


def layout_name(spec: TensorSpec, layouts: dict[str, Layout]) -> str:
    return layouts[spec.expert_tensor].name if spec.expert_tensor else "model"


def part_headers(specs_by_name: dict[str, TensorSpec], part: Part, layouts: dict[str, Layout]) -> list[TensorHeader]:
    """The headers of one rank's file of `part`, in file order."""
    return [TensorHeader(n, specs_by_name[n].dtype, stored_shape(specs_by_name[n], layouts)) for n in part.names]


def part_keys(specs_by_name: dict[str, TensorSpec], part: Part) -> list[str]:
    """The source tensors a part reads (whole: every rank's slices of them are in this part)."""
    return list(dict.fromkeys(k for n in part.names for k in specs_by_name[n].sources()))


def plan_footprint(specs: dict[str, list[list[TensorSpec]]], parts: list[Part], layouts: dict[str, Layout], tp: int,
                   align: int, sizes: dict[str, int], cid: str = "0" * 64, side: int = 0) -> footprint.Footprint:
    """Bytes to read, and the exact size of every rank file (its header depends on names, shapes, the
    64-hex-digit conversion id, the fixed-width content stamp and the alignment; any id gives the same
    length)."""
    files = {}
    for role, ranks in specs.items():
        for rank, rank_specs in enumerate(ranks):
            by_name = {s.name: s for s in rank_specs}
            for part in (p for p in parts if p.role == role):
                headers = part_headers(by_name, part, layouts)
                meta = file_metadata(cid, role, rank, part.index, tp, CONTENT_PLACEHOLDER)
                files[part_path(role, rank, part.index)] = (len(encode_header(headers, meta, align))
                                                            + sum(h.nbytes for h in headers))
    tensors = sum(len(r) for ranks in specs.values() for r in ranks)
    return footprint.Footprint(footprint.read_bytes(specs, sizes), files, tensors, side)


def plan_parts(role: str, specs: list[TensorSpec], max_bytes: int, align: int = 8) -> list[Part]:
    """Split a rank's sorted tensors into parts of at most `max_bytes` (a larger tensor stands alone).

    Tensors that read a common source tensor share a part (`shared_source_groups`): a part's files are
    stamped with the digests of the source tensors it reads, each read whole within the part
    (`part_keys`). Safetensors forbids gaps between tensors, so alignment is had by order: within a
    part, the tensors whose size is a multiple of `align` come first (by name) and therefore all start
    aligned once the header pads the data section to `align`.
    """
    parts: list[Part] = []
    names: list[str] = []
    size = 0
    sizes = {s.name: s.nbytes for s in specs}

    def close() -> None:
        names.sort(key=lambda n: (align > 8 and sizes[n] % align != 0, n))  # align 8: plain name order
        parts.append(Part(role, len(parts), list(names), size))

    for group in shared_source_groups(specs):
        nbytes = sum(s.nbytes for s in group)
        if names and size + nbytes > max_bytes:
            close()
            names, size = [], 0
        names.extend(s.name for s in group)
        size += nbytes
    if names:
        close()
    return parts


def shared_source_groups(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    """SPECS grouped by the source tensors they read (two tensors reading one source are in one group,
    transitively), each group where its first member is. All but a few are alone: the DSpark drafter's
    context projection reads the draft attention's wkv, which its fused_wqa_wkv reads too."""
    root = list(range(len(specs)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    reader: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for key in spec.sources():
            a, b = find(i), find(reader.setdefault(key, i))
            root[max(a, b)] = min(a, b)  # a group's root is its first member
    groups: dict[int, list[TensorSpec]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(find(i), []).append(spec)
    return list(groups.values())


@dataclass
class Job:
    """Everything decided before the first byte: checkpoint, plan, specs, parts, identity."""

    ckpt: Checkpoint
    options: Options
    plan: Plan
    specs: dict[str, list[list[TensorSpec]]]
    parts: list[Part]
    layouts: dict[str, Layout]
    cid: str
    dropped: dict[str, str] = field(default_factory=dict)
    origin: dict = field(default_factory=lambda: {"repo": None, "revision": None})  # repo id and commit (`spec.source.hub_origin`)

    @property
    def roles(self) -> list[str]:
        return list(self.specs)

    @property
    def source_sizes(self) -> dict[str, int]:
        return {k: e.offsets[1] - e.offsets[0] for k, e in self.ckpt.tensors.items()}

    def footprint(self) -> footprint.Footprint:
        side = sum((self.ckpt.root / n).stat().st_size for n in side_files(self.ckpt.root))
        return plan_footprint(self.specs, self.parts, self.layouts, self.plan.tp, self.options.align,
                              self.source_sizes, self.cid, side)


def prepare(model: str, options: Options, revision: str | None = None) -> Job:
    root = resolve_model(model, revision)
    roles = ("target", "draft") if options.mtp else ("target",)
    ckpt = open_checkpoint(root, roles)
    plan = make_plan(ckpt.config, options.tp, options.moe_backend)
    layouts = tensor_layouts(options)
    specs = {}
    for role in roles:
        if role == "draft" and not ckpt.config.num_mtp:
            continue
        specs[role] = build_specs(ckpt.config, plan, role)
    parts = [p for role in specs for p in plan_parts(role, specs[role][0], options.max_file_bytes, options.align)]
    dropped = {}
    if not options.mtp:
        dropped = {k: "--no-mtp: the MTP draft model was not converted" for k in ckpt.tensors if k.startswith("mtp.")}
    return Job(ckpt, options, plan, specs, parts, layouts, conversion_id(ckpt.fingerprint, options), dropped,
               hub_origin(model, root))
