"""Everything a conversion decides before the first byte: the checkpoint, plan, rank specs, expert
layouts, the split of each rank's tensors into files (parts) and the conversion id; and from them,
the exact size of every rank file (`plan` shows it, convert checks the room with it)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import stops
from ..model import footprint
from ..model.config import ModelConfig
from ..model.layouts import Layout, tensor_layouts
from ..model.options import Options
from ..model.plan import Plan, make_plan
from ..model.tensorspecs import TensorSpec, build_specs
from ..output.manifest import CONTENT_PLACEHOLDER, conversion_id, file_metadata, part_path
from ..output.share import NodeShare
from ..source.checkpoint import (Checkpoint, RemoteConfig, is_repo_id, open_checkpoint, open_remote, remote_config,
                                 resolve_model)
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


def plan_parts(role: str, specs: list[TensorSpec], max_bytes: int, align: int = 8,
               shard_of: dict[str, str] | None = None) -> list[Part]:
    """Split a rank's sorted tensors into parts of at most `max_bytes` (a larger tensor stands alone).
    With `shard_of` (source key -> shard: a conversion's, from the index), the tensors are taken in the
    order of the shards that hold their sources (the last shard, then the first; by name within), so a
    part reads as few shards as the source allows and the parts come in the order the shards arrive; this
    decides which part holds a tensor, never its bytes. Without it (config.json alone), by name: the
    grouping of outputs written before (each is verified and served from its manifest, which lists them).

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

    for group in by_shards(shared_source_groups(specs), shard_of) if shard_of else shared_source_groups(specs):
        nbytes = sum(s.nbytes for s in group)
        if names and size + nbytes > max_bytes:
            close()
            names, size = [], 0
        names.extend(s.name for s in group)
        size += nbytes
    if names:
        close()
    return parts


def by_shards(groups: list[list[TensorSpec]], shard_of: dict[str, str]) -> list[list[TensorSpec]]:
    """`groups` ordered by the shards (`shard_of`: source key -> shard, in shard-name order) their sources
    are in: the last such shard, then the first; a group keeps its place among those of the same span."""
    index = {f: i for i, f in enumerate(sorted(set(shard_of.values())))}

    def span(group: list[TensorSpec]) -> tuple[int, int]:
        held = [index[shard_of[k]] for s in group for k in s.sources() if k in shard_of]
        return (max(held), min(held)) if held else (0, 0)
    return sorted(groups, key=span)


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
    origin: dict = field(default_factory=lambda: {"repo": None, "revision": None})  # repo id and commit, for a repo id
    on_disk: bool = True  # False: a repo whose files are still to be downloaded (`engine.feed`)
    # A node's convert (--ranks, --nnodes/--node-rank): the ranks whose files it writes; the others are
    # only hashed, for the manifest that lists every rank. None: every rank is written.
    node: NodeShare | None = None

    @property
    def written_ranks(self) -> list[int]:
        return list(self.node.ranks) if self.node is not None else list(range(self.plan.tp))

    @property
    def hashed_ranks(self) -> list[int]:
        """The ranks whose files are hashed, not written."""
        return [r for r in range(self.plan.tp) if r not in self.written_ranks]

    def writes(self, rel: str) -> bool:
        """Whether rank file `rel` (`part_path`) is one this job writes."""
        return self.node is None or self.node.holds(rel)

    @property
    def roles(self) -> list[str]:
        return list(self.specs)

    @property
    def source_path(self) -> str:
        """Where the source is, as the manifest records it: its directory, or `hf://repo@commit` for a
        repo streamed through a download folder that is gone once the conversion is complete."""
        if self.on_disk:
            return str(self.ckpt.root.absolute())
        hub = self.ckpt.hub
        return f"hf://{hub.repo}@{hub.commit}"

    @property
    def source_sizes(self) -> dict[str, int]:
        return {k: e.offsets[1] - e.offsets[0] for k, e in self.ckpt.tensors.items()}

    def footprint(self) -> footprint.Footprint:
        return plan_footprint(self.specs, self.parts, self.layouts, self.plan.tp, self.options.align,
                              self.source_sizes, self.cid, sum(self.ckpt.side.values()))


@dataclass(frozen=True)
class Planned:
    """What config.json and the options decide before a shard header is read: the plan, every rank's
    specs by role and the parts (rank files; a repo id's grouped by name until its index regroups them by
    shard, `prepare`). A repo id's keeps its config.json (`remote`): the job reads the headers of the commit
    the plan was made from."""

    plan: Plan
    specs: dict[str, list[list[TensorSpec]]]
    parts: list[Part]
    remote: RemoteConfig | None = None

    @property
    def paths(self) -> list[str]:
        """Every rank file convert writes, by path (what its refusals of OUT look at)."""
        return [part_path(p.role, r, p.index) for p in self.parts for r in range(self.plan.tp)]


def layout_of(cfg: ModelConfig, options: Options, remote: RemoteConfig | None = None,
              shard_of: dict[str, str] | None = None) -> Planned:
    """The plan, every rank's specs by role and the parts (rank files) of `options` from config.json and
    `shard_of`, the shard that holds each source tensor (the index): a part's tensors are grouped by the
    shards that hold them (`plan_parts`); None: by name, as from config.json alone."""
    plan = make_plan(cfg, options.tp, options.moe_backend)
    roles = ["target"] + (["draft"] if options.mtp and cfg.num_mtp else [])
    specs = {role: build_specs(cfg, plan, role) for role in roles}
    return Planned(plan, specs, parts_of(specs, options, shard_of), remote)


def parts_of(specs: dict[str, list[list[TensorSpec]]], options: Options, shard_of: dict[str, str] | None) -> list[Part]:
    """Every role's parts (`plan_parts` on rank 0's specs, the same for every rank)."""
    return [p for role in specs for p in plan_parts(role, specs[role][0], options.max_file_bytes, options.align,
                                                     shard_of)]


def plan_remote(repo: str, options: Options, revision: str | None = None) -> Planned:
    """A repo id planned from its config.json alone (`source.checkpoint.remote_config`), before any
    other file of the repo is asked for: what OUT's refusals need."""
    opened = remote_config(repo, revision)
    return layout_of(opened.config, options, opened)


def _shard_of(ckpt: Checkpoint) -> dict[str, str]:
    """Each source tensor's shard, from the checkpoint's index."""
    return {k: e.file for k, e in ckpt.tensors.items()}


def prepare(model: str, options: Options, revision: str | None = None, download_to: Path | None = None,
            planned: Planned | None = None) -> Job:
    """The job of converting MODEL with `options`. A repo id is read from the Hub without a weight
    (`plan_remote`, or `planned` made by it, then `source.checkpoint.open_remote`: the headers by ranged
    requests) and is read in place when the Hugging Face cache already holds all of it at that
    commit; otherwise its files are to be downloaded into `download_to` (`engine.feed`)."""
    roles = ("target", "draft") if options.mtp else ("target",)
    origin = {"repo": None, "revision": None}
    on_disk = True
    if is_repo_id(model):
        planned = planned or plan_remote(model, options, revision)
        # its requests on a thread joined in slices: a slow or stalled Hub never holds a stop
        ckpt = stops.joined(lambda: open_remote(planned.remote, download_to, roles), "lucifer-hub-open")
        # the index is in: the parts grouped by the shards that hold them (the plan and specs stay)
        planned = replace(planned, parts=parts_of(planned.specs, options, _shard_of(ckpt)))
        on_disk = ckpt.hub is None  # all of it in the Hugging Face cache: read in place
        origin = {"repo": model, "revision": ckpt.hub.commit if ckpt.hub else ckpt.root.name}
    else:
        ckpt = open_checkpoint(resolve_model(model, revision), roles)
        planned = layout_of(ckpt.config, options, shard_of=_shard_of(ckpt))
    dropped = {}
    if not options.mtp:
        dropped = {k: "--no-mtp: the MTP draft model was not converted" for k in ckpt.tensors if k.startswith("mtp.")}
    return Job(ckpt, options, planned.plan, planned.specs, planned.parts, tensor_layouts(options),
               conversion_id(ckpt.fingerprint, options), dropped, origin, on_disk)
