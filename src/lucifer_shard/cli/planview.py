"""The `plan` report: the audit's axis table, per-family source ranges per rank, and the disk
footprint (bytes to read and write, files per rank, room on OUT's filesystem, a time estimate)."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine import diskspace
from ..engine.job import layout_name, parts_of, plan_footprint, stored_shape, tensor_layouts
from ..engine.owned import plan_clearing
from ..errors import UsageRefused
from ..formats.dtypes import DTYPE_SIZE
from ..guarded_io import Tree
from ..model import footprint as fpm, boxfit, v41
from ..model.arches import MOE_VARIANT
from ..model.config import DSPARK, ModelConfig, v41_refusal
from ..model.drafts import DRAFT_KINDS
from ..model.options import Options
from ..model.plan import MOE_ROUTES, Plan, make_plan, padding_only
from ..model.tensorspecs import TensorSpec, build_specs, expected_sources
from ..output.share import NodeShare
from ..units import RATE_SYNTAX, duration, parse_rate, rate, size

_LAYER = re.compile(r"^model\.layers\.\d+\.")


def family(name: str) -> str:
    return _LAYER.sub("model.layers.*.", name)


def plan_specs(cfg: ModelConfig, plan: Plan, mtp: bool) -> dict[str, list[list[TensorSpec]]]:
    roles = ["target"] + (["draft"] if mtp and cfg.num_mtp else [])
    return {role: build_specs(cfg, plan, role) for role in roles}


@dataclass(frozen=True)
class Room:
    """OUT's filesystem against what the conversion writes."""

    out: Path
    filesystem: str
    free: int
    needed: int
    given_back: int = 0  # what --force deletes first (convert counts it the same way)
    download: int = 0  # of `needed`: a repo's shards on disk at once (streamed) or whole (--keep-source)

    @property
    def short(self) -> int:
        return diskspace.shortfall(self.needed, self.free, self.given_back)

    def to_dict(self) -> dict:
        return {"out": str(self.out), "filesystem": self.filesystem, "free_bytes": self.free,
                "needed_bytes": self.needed, "given_back_bytes": self.given_back, "download_bytes": self.download,
                "enough": not self.short}


def plan_footprint_of(cfg: ModelConfig, specs: dict[str, list[list[TensorSpec]]], plan: Plan,
                      options: Options, shard_of: dict[str, str]) -> fpm.Footprint:
    """The footprint from config.json and the source's shards (`SourceLayout.shard_of`, which groups the parts:
    `plan_parts`; source sizes from the schema; copies of side files unknown)."""
    parts = parts_of(specs, options, shard_of)
    sizes = {k: DTYPE_SIZE[s.dtype] * math.prod(s.shape) for k, s in expected_sources(cfg).items()}
    return plan_footprint(specs, parts, tensor_layouts(options), plan.tp, options.align, sizes)


def node_footprint(fp: fpm.Footprint, node: NodeShare | None) -> fpm.Footprint:
    """The footprint of a node's convert (its rank files only: what its room check counts), else `fp`."""
    return fp.only(list(node.ranks)) if node is not None else fp


def room_of(fp: fpm.Footprint, out: Path | None, force: bool = False) -> Room | None:
    if out is None:
        return None
    given_back = plan_clearing(Tree(out)).freed if force and Path(out).is_dir() else 0
    return Room(Path(out), diskspace.filesystem(out), diskspace.free_bytes(out), fp.needed, given_back)


def footprint_json(fp: fpm.Footprint, room: Room | None) -> dict:
    return {"read_bytes": fp.read, "write_bytes": fp.write, "metadata_bytes": fp.metadata,
            "ranks": [{"role": role, "rank": rank, "files": files, "bytes": n}
                      for (role, rank), (files, n) in fp.per_rank().items()],
            "files": len(fp.files), "room": room.to_dict() if room else None,
            "estimate": {"seconds": round(fpm.seconds(fp), 1), "bytes_per_s": round(fpm.MEASURED_BYTES_PER_S),
                         "measured": fpm.MEASURED_WHERE}}


def download_lines(room: Room | None) -> list[str]:
    """The download's room where it lands on a filesystem of its own (else OUT's room line counts it)."""
    if room is None:
        return []
    verdict = "enough" if not room.short else f"NOT enough: free {size(room.short)} more or choose another place"
    return [f"  download {size(room.download):>9}   at most, in {room.out}: {size(room.free)} free on "
            f"{room.filesystem}: {verdict}"]


def judged_rooms(model: str, layout: SourceLayout, specs: dict, options: Options, out: Path | None,
                 download_dir: Path | None, keep_source: bool, room: Room | None, node: NodeShare | None
                 ) -> tuple[Room | None, Room | None, Room | None, str]:
    """(OUT's room, the download's room on a filesystem of its own, the streamed route's room, the route OUT's
    room is judged for, in words). A repo id is judged as convert runs it (its download counted); a config
    alone as a checkpoint on disk, and with a node's share also for that node streaming its own from the repo
    (`convert REPO DEST --nnodes N --node-rank R`: its share plus the shards held at once)."""
    from ..source.checkpoint import is_repo_id

    if room is None:
        return None, None, None, ""
    if is_repo_id(model):
        download = download_room(layout, specs, options, out, download_dir, keep_source, room)
        how = "downloaded whole (--keep-source)" if keep_source else "streamed"
        route = f"convert from the repo, its shards {how}"
        if download is not None and download.out == room.out:  # on OUT's filesystem: OUT's room counts it
            return download, None, None, route
        return room, download, None, route
    if Path(model).is_dir():
        return room, None, None, "convert from the checkpoint on disk"
    streamed = download_room(layout, specs, options, out, download_dir, False, room) if node is not None else None
    return room, None, streamed, "a checkpoint already on disk, MODEL being a config: nothing downloaded"


def streamed_lines(room: Room | None) -> list[str]:
    """The streamed route's room, judged beside OUT's when MODEL is a config and a node's share is planned."""
    if room is None:
        return []
    verdict = ("enough" if not room.short else f"NOT enough: free {size(room.short)} more, pass --download-dir on "
               f"another filesystem, or convert once on a larger box and stage each node's share")
    return [f"  streamed {size(room.needed):>9}   needed in {room.out} for the route where this node streams its own "
            f"share from the repo (convert REPO DEST --nnodes N --node-rank R, holding up to {size(room.download)} of "
            f"shards at once): {size(room.free)} free on {room.filesystem}: {verdict}"]


def footprint_lines(fp: fpm.Footprint, room: Room | None, node: NodeShare | None = None, route: str = "") -> list[str]:
    ranks = (f" of rank(s) {', '.join(map(str, node.ranks))} (this node's share; the other ranks are hashed for the "
             f"manifest, not written)") if node is not None else ""
    lines = ["", "disk footprint",
             f"  read   {size(fp.read):>11}   every converted source tensor, once",
             f"  write  {size(fp.write):>11}   {len(fp.files)} rank files{ranks}, then about {size(fp.metadata)} of "
             f"manifest and journal and the config/tokenizer copies"]
    if room is None:
        lines.append("  room   not checked   name OUT (plan ... MODEL OUT) to check its filesystem's free space")
    else:
        verdict = "enough" if not room.short else f"NOT enough: free {size(room.short)} more or choose another OUT"
        back = f" (+{size(room.given_back)} --force removes)" if room.given_back else ""
        shards = f", with {size(room.download)} of the repo's shards downloaded there" if room.download else ""
        judged = f" (for {route})" if route else ""
        lines.append(f"  room   {size(room.free):>11}   free{back} on {room.filesystem}, the filesystem of {room.out}"
                     f"{shards}{judged}: {verdict}")
    lines += [f"  time   {duration(fpm.seconds(fp)):>11}   at {rate(fpm.MEASURED_BYTES_PER_S)} read + written,",
              f"                       {fpm.MEASURED_WHERE}; it scales with your disk"]
    return lines


def plan_json(specs: dict[str, list[list[TensorSpec]]], plan: Plan, options: Options) -> dict:
    """Per role, rank and output tensor: name, shape, dtype, layout and source slices."""
    layouts = tensor_layouts(options)
    roles = {}
    for role, ranks in specs.items():
        roles[role] = [
            {"rank": r, "tensors": [{
                "name": s.name, "shape": list(stored_shape(s, layouts)), "model_shape": list(s.shape),
                "dtype": s.dtype, "layout": layout_name(s, layouts), "experts": s.experts,
                "sources": [{"key": p.source, "dim": p.dim, "start": p.src_start, "length": p.length,
                             "dst_offset": p.dst_start, "segment": p.seg_len} for p in s.pieces],
            } for s in specs]}
            for r, specs in enumerate(ranks)
        ]
    return {"plan": plan.to_dict(), "arch": options.arch, "moe_backend": options.moe_backend,
            "moe_variant": None if options.moe_backend else MOE_VARIANT.get(options.arch),
            "expert_layout": options.expert_layout,
            "padding_only": [{"rank": p.rank, "axes": list(p.axes), "message": p.message} for p in padding_only(plan)],
            "roles": roles}


def draft_line(cfg: ModelConfig, specs: dict[str, list[list[TensorSpec]]]) -> str:
    """What the draft role holds and how vLLM serves it (model/drafts.DRAFT_KINDS)."""
    if "draft" not in specs:
        return "draft: none (--no-mtp, or the checkpoint has none)"
    kind = DRAFT_KINDS[cfg.draft_kind]
    return (f"draft: {kind.label}, {cfg.num_mtp} {'stages' if cfg.draft_kind == DSPARK else 'layer(s)'} "
            f"(vLLM's {kind.vllm_class}, --speculative-config method {kind.method!r}; serve --draft)")


def plan_lines(specs: dict[str, list[list[TensorSpec]]], plan: Plan, options: Options,
               fp: fpm.Footprint, cfg: ModelConfig) -> list[str]:
    if options.moe_backend is not None:
        arch = (f"vLLM's {options.moe_backend} MoE ({'/'.join(MOE_ROUTES[options.moe_backend].arches)}; it lays the "
                f"experts out at load)")
    elif options.arch is None:
        arch = "any arch (model layout: vLLM lays the experts out at load for the GPU it runs on)"
    else:
        arch = f"arch {options.arch}: {MOE_VARIANT[options.arch]}"
    lines = [f"virtual-TP plan for TP={plan.tp} ({'padded' if plan.pads else 'plain split, nothing pads'}); "
             f"{arch}, experts in {options.expert_layout} layout", ""]
    lines.append(f"{'axis':<8} {'original':>9} {'padded':>9} {'per rank':>9} {'kernel-local':>13}   real per rank")
    for a in plan.axes.values():
        reals = "/".join(str(a.real(r)) for r in range(plan.tp))
        lines.append(f"{a.name:<8} {a.original:>9} {a.padded:>9} {a.local:>9} {a.kernel_local:>13}   {reals}")
    lines += [f"  note: {p.message}" for p in padding_only(plan)]
    lines += ["", draft_line(cfg, specs)]
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
    lines.append("  (every other tensor is replicated whole on each rank; the draft's decoder-block families match the "
                 "target's)")
    lines += ["", "per rank (files of at most --max-file-size; padding = virtual-TP and kernel zero tails)",
              f"  {'role':<7} {'rank':>4} {'tensors':>7} {'files':>5} {'bytes':>16} {'size':>12} {'padding':>12}"]
    per_rank = fp.per_rank()
    for role, ranks in specs.items():
        for r, rank_specs in enumerate(ranks):
            files, n = per_rank[(role, r)]
            pad = sum(_pad_bytes(s) for s in rank_specs)
            lines.append(f"  {role:<7} {r:>4} {len(rank_specs):>7} {files:>5} {n:>16,} {size(n):>12} {size(pad):>12}")
    return lines


def route_saving(cfg: ModelConfig, plan: Plan, options: Options, fp: fpm.Footprint,
                 shard_of: dict[str, str]) -> dict | None:
    """What a MoE route other than the default saves against it (b12x: no kernel rounding of the routed width):
    each rank's bytes on both routes (every role), from config.json alone; None on the default route."""
    if options.moe_backend is None:
        return None
    default = replace(options, moe_backend=None)
    base = make_plan(cfg, plan.tp)
    base_fp = plan_footprint_of(cfg, plan_specs(cfg, base, options.mtp), base, default, shard_of)

    def per_rank(f: fpm.Footprint) -> list[int]:
        return [sum(n for (_, r), (_, n) in f.per_rank().items() if r == rank) for rank in range(plan.tp)]

    return {"route": options.moe_backend, "routed_width": plan.routed.kernel_local,
            "default_routed_width": base.routed.kernel_local, "rank_bytes": per_rank(fp),
            "default_rank_bytes": per_rank(base_fp)}


def route_lines(saving: dict | None) -> list[str]:
    if saving is None:
        return []
    now, before = saving["rank_bytes"], saving["default_rank_bytes"]
    return ["", f"{saving['route']} route: routed experts {saving['routed_width']} wide per rank ("
                f"{saving['default_routed_width']} on the default route); each rank's files:",
            *(f"  rank {r}: {size(a)} against {size(b)}: {size(b - a)} less ({(b - a) / b:.1%})"
              for r, (a, b) in enumerate(zip(now, before)))]


def per_node(fp: fpm.Footprint, tp: int) -> list[dict]:
    """The rank files one node holds when each node runs one rank (`stage --nnodes TP --node-rank R`, or
    `convert --nnodes TP --node-rank R` on that node: `node_footprint`)."""
    per_rank = fp.per_rank()
    return [{"node": r, "ranks": [r], "bytes": sum(n for (role, rank), (_, n) in per_rank.items() if rank == r)}
            for r in range(tp)]


def node_lines(nodes: list[dict], total: int) -> list[str]:
    if len(nodes) < 2:
        return []
    return ["", f"per node, one rank each (lucifer-shard stage OUT DEST --nnodes {len(nodes)} --node-rank R, or on "
                f"each node convert ... --nnodes {len(nodes)} --node-rank R): its rank files, of {size(total)} in all",
            *(f"  node {n['node']}: rank {n['ranks'][0]}, {size(n['bytes'])} ({n['bytes']:,} bytes)" for n in nodes)]


def _pad_bytes(spec: TensorSpec) -> int:
    """Bytes of pad in one rank's tensor: pad-region extent times the other dims."""
    item = DTYPE_SIZE[spec.dtype]
    shape = spec.matrix_shape
    n = 0
    for p in spec.pieces:
        lo, hi = p.tail
        other = 1
        for d, extent in enumerate(shape):
            if d != p.dim:
                other *= extent
        n += (hi - lo) * other * item
    return n * (spec.experts or 1)


def v41_report(raw: dict, tp: int, where: str, utilization: float | None = None) -> tuple[list[str], dict]:
    """`plan` on a DeepSeek-V4.1 config: per TP size each rank's GPU and host bytes (an estimate, model/v41.py),
    at `tp` per family and against the common boxes, and why convert refuses it."""
    sizes = {t: v41.rank_bytes(raw, t, where) for t in sorted({*v41.TP_SIZES, tp})}
    at = sizes[tp]
    lines = [f"DeepSeek-V4.1-Flash ({where}): not convertible yet (docs/deepseek-v4.1.md); each rank's bytes under a "
             f"V4-style virtual plan, an estimate (routed experts exact, compressors and indexer not counted)", "",
             f"  {'tp':>3} {'GPU per rank':>14} {'host per rank (Engram)':>24}"]
    lines += [f"  {t:>3} {size(r.gpu_total):>14} {size(r.host):>24}" for t, r in sizes.items()]
    lines += ["", f"per family at --tp {tp}, on each rank's GPU:"]
    lines += [f"  {name:<24} {size(n):>12}" for name, n in at.gpu.items()]
    lines += [f"  {'Engram tables (host)':<24} {size(at.host):>12}"]
    fits = boxfit.fits(at.gpu_total, None, at.host, utilization or boxfit.UTILIZATION)
    lines += box_lines(fits, None, tp, "GPU weights (with the Engram tables on unified memory); its KV cache is "
                                       "not modelled (vLLM's DeepseekV41 spec is another)")
    lines += ["", f"convert refuses it: {v41_refusal(where)}"]
    doc = {"model": "DeepSeek-V4.1-Flash", "convertible": False, "estimate": True,
           "per_tp": {t: {"gpu_bytes": r.gpu_total, "host_bytes": r.host} for t, r in sizes.items()},
           "families": at.gpu, "fit": boxes_json(fits, None)}
    return lines, doc


def box_fits(cfg: ModelConfig, specs: dict[str, list[list[TensorSpec]]], fp: fpm.Footprint,
             utilization: float | None = None) -> tuple[list[boxfit.Fit], boxfit.KVPool | None]:
    """Each common box against the largest rank's files (target and draft) and the KV cache of the layers
    vLLM serves (the draft's too when the plan has one), at `utilization` (None: vLLM's default, and the
    unified-memory boxes shown again at the host guide's value)."""
    served = cfg.num_layers + (cfg.num_mtp if "draft" in specs else 0)
    pool = boxfit.kv_pool(cfg.raw, list(cfg.compress_ratios[:served]))
    weights = max(n["bytes"] for n in per_node(fp, len(next(iter(specs.values())))))
    return boxfit.fits(weights, pool, utilization=utilization or boxfit.UTILIZATION), pool


def boxes_json(fits: list[boxfit.Fit], pool: boxfit.KVPool | None) -> dict:
    kv = None if pool is None else {"block_bytes": pool.block_bytes, "bytes_per_token": boxfit.per_token_bytes(pool),
                                    "groups": [vars(g) for g in pool.groups], "max_position_embeddings": pool.max_len}
    return {"boxes": [boxfit.fit_json(f) for f in fits], "kv_cache": kv,
            "unified_at_guide": [boxfit.fit_json(f) for f in boxfit.at_guide(fits, pool)],
            "assumed": {"gpu_memory_utilization": fits[0].utilization, "besides": dict(boxfit.BESIDES),
                        "activation_bytes_per_batched_token": boxfit.ACTIVATION_BYTES_PER_BATCHED_TOKEN,
                        "in_flight_batches": boxfit.IN_FLIGHT_BATCHES}}


def _fit_tail(f: boxfit.Fit) -> str:
    """A box's row after its KV room: the longest --max-model-len and the tokens (requests) it holds, or why not."""
    if f.room <= 0 or f.longest == 0:
        return f"does not fit: {size(-f.room)} short" if f.room <= 0 else "does not fit: no room for one block"
    if f.longest is None:
        return "fits (tokens not modelled)"
    short = f" at {f.longest:,}" if f.longest < boxfit.SERVED_LEN else ""
    return f"{f.longest:>15,}  {f.served[0]:,} ({f.served[1]:.1f}){short}"


def box_lines(fits: list[boxfit.Fit], pool: boxfit.KVPool | None, tp: int, weights: str) -> list[str]:
    """The per-box table: one rank on each of `tp` boxes (model/boxfit.py says where each figure comes from)."""
    at = f"at {boxfit.SERVED_LEN:,}: tokens (requests)"
    u = fits[0].utilization
    said = "vLLM's default --gpu-memory-utilization" if u == boxfit.UTILIZATION else "--gpu-memory-utilization"
    lines = ["", f"what fits, per rank, one rank a box ({tp}x each box); memory x {u} ({said}) less weights and "
                 f"what vLLM keeps besides is the KV cache's room:",
             f"  {'box':<17} {'memory':>11} {'weights':>10} {'besides':>9} {'KV room':>10}  {'--max-model-len':>15}  {at}"]
    for f in fits:
        lines.append(f"  {f.box.name:<17} {size(f.box.memory):>11} {size(f.weights):>10} {size(f.besides):>9} "
                     f"{size(f.room) if f.room > 0 else '-':>10}  {_fit_tail(f)}")
    for g in boxfit.at_guide(fits, pool):
        lines.append(f"  {g.box.name} at --gpu-memory-utilization {g.utilization} (the host guide's value there; "
                     f"vLLM's docs ask for one on unified memory): KV room {size(g.room) if g.room > 0 else '-'}, "
                     f"--max-model-len and tokens {' '.join(_fit_tail(g).split())}")
    lines.append(f"  weights: {weights}; besides (assumed, not measured on this model: a real run's \"Available KV "
                 f"cache memory\" line is the measure): " + ", ".join(f"{what} {size(n)}" for what, n in boxfit.BESIDES)
                 + f", activations {size(boxfit.ACTIVATION_BYTES_PER_BATCHED_TOKEN)} a batched token "
                   f"at vLLM's default --max-num-batched-tokens (" + ", ".join(
                       f"{f.box.batched_tokens:,} on {f.box.name}" for f in fits) + ")")
    if pool is not None:
        flights = sorted({boxfit.IN_FLIGHT_BATCHES * f.box.batched_tokens for f in fits})
        windows = ", ".join(f"{size(boxfit.window_bytes(pool, n))} at {n:,} tokens in flight" for n in flights)
        lines.append(f"  KV cache (vLLM's fp8_ds_mla spec for DeepSeek-V4, on every rank whole): "
                     f"{boxfit.per_token_bytes(pool):,.0f} bytes a token of context, and per request its windows "
                     f"(sliding window, compressor states): {windows}; --max-model-len: one request's longest, at most "
                     f"{pool.max_len:,}")
    lines.append("  vLLM 0.34.0 on CUDA sizes the cache from all the memory warm-up leaves unless --gpu-memory-utilization "
                 "is given (a little more room on a discrete GPU); a DGX Spark's host shares that memory: give it there")
    return lines


# DeepSeek-V4-Flash-0731 on the Hub: 166,878,536,440 bytes in 48 shards, laid out by layer (docs/checkpoints.md);
# a plan from config.json alone models the shards so, to size what a streamed conversion holds at once.
HUB_SHARD_BYTES = 166_878_536_440 // 48


@dataclass(frozen=True)
class SourceLayout:
    """Which shard holds each source tensor and how large each is: what a streamed conversion downloads."""

    shard_of: dict[str, str]  # source key -> shard
    sizes: dict[str, int]  # shard -> bytes
    side: int  # config and tokenizer files' bytes
    where: str  # where these figures come from, in words
    cached: bool = False  # a repo whose files are all in the Hugging Face cache: nothing to download

    @property
    def total(self) -> int:
        return sum(self.sizes.values()) + self.side

    def stream_peak(self, specs: dict, options: Options) -> int:
        """The most source bytes a streamed conversion holds at once (`source.streaming`, over its order)."""
        from ..engine.feed import shards_read
        from ..source.streaming import peak_bytes, stream_order

        parts = parts_of(specs, options, self.shard_of)
        files = {id(p): shards_read(specs, p, self.shard_of) for p in parts}
        return peak_bytes(stream_order(parts, files, self.sizes), files, self.sizes) + self.side


def source_layout(model: str, config: Path, cfg: ModelConfig) -> SourceLayout:
    """MODEL's shards: the Hub's file list and index for a repo id, the index and sizes on disk for a
    checkpoint directory, else modelled from config.json as DeepSeek lays them out (by layer,
    HUB_SHARD_BYTES each)."""
    from ..engine.presets import nbytes, ordered_sources, shards
    from ..outnames import SIDE_FILES
    from ..source.checkpoint import INDEX_NAME, _weight_map, is_repo_id
    from ..source.hub import cached_snapshot, repo_at, small_file

    root = config.parent
    if is_repo_id(model) and (hub := repo_at(model, root.name)) is not None and INDEX_NAME in hub.files:
        weight_map = _weight_map(small_file(model, INDEX_NAME, hub.commit))
        sizes = {n: hub.files[n].size for n in set(weight_map.values())}
        side = [n for n in SIDE_FILES if n in hub.files]
        return SourceLayout(weight_map, sizes, sum(hub.files[n].size for n in side),
                            f"the Hub's index of {model} at {hub.commit[:12]}",
                            cached_snapshot(hub, [*sizes, *side]) is not None)
    if not Path(model).is_file() and (root / INDEX_NAME).is_file():
        weight_map = _weight_map(root / INDEX_NAME)
        sizes = {n: (root / n).stat().st_size for n in set(weight_map.values()) if (root / n).is_file()}
        if len(sizes) == len(set(weight_map.values())):
            side = sum((root / n).stat().st_size for n in SIDE_FILES if (root / n).is_file())
            return SourceLayout(weight_map, sizes, side, f"the index and shards in {root}", True)
    groups = list(shards(ordered_sources(cfg.raw), 1, HUB_SHARD_BYTES))
    names = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    return SourceLayout({s.key: name for name, group in zip(names, groups) for s in group},
                        {name: sum(map(nbytes, g)) for name, g in zip(names, groups)}, 0,
                        f"modelled: {len(groups)} shards by layer of about {size(HUB_SHARD_BYTES)}, as DeepSeek's "
                        f"(exact with a repo id or a checkpoint)")


def link_rate(link: str) -> float:
    """--link's bytes per second (`units.parse_rate`); a usage error naming the forms it takes otherwise."""
    try:
        return parse_rate(link)
    except ValueError:
        raise UsageRefused(f"--link {link[:40]!r}: expected {RATE_SYNTAX}, e.g. --link 1GiB/s or --link 10Gbit/s") \
            from None


def routes_of(specs: dict, options: Options, fp: fpm.Footprint, layout: SourceLayout,
              link: str = fpm.DEFAULT_LINK) -> dict:
    """Each route's download, disk and time per node (`footprint.node_routes`), one rank per node, at the
    link rate `link` (--link)."""
    rate_ = link_rate(link)
    peak = layout.stream_peak(specs, options)
    tp = len(next(iter(specs.values())))
    share = max(n["bytes"] for n in per_node(fp, tp))
    routes = fpm.node_routes(layout.total, share, fp.write, peak, tp, tp, fp.read)
    return {"source_bytes": layout.total, "stream_peak_bytes": peak, "shards": layout.where,
            "link": {"rate": link, "bytes_per_s": round(rate_), "default": link == fpm.DEFAULT_LINK},
            "disk": {"bytes_per_s": round(fpm.MEASURED_BYTES_PER_S), "measured": fpm.MEASURED_WHERE},
            "routes": [{**vars(r), **dict(zip(("download_seconds", "convert_seconds"),
                                              (round(t, 1) for t in r.seconds(rate_))))} for r in routes]}


def download_room(layout: SourceLayout, specs: dict, options: Options, out: Path, download_dir: Path | None,
                  keep_source: bool, out_room: Room) -> Room | None:
    """Where a repo's download lands and the room it needs there (convert's `feed.check_room`): the
    whole checkpoint in the Hugging Face cache with --keep-source, else the streamed peak in
    --download-dir (default OUT/.lucifer/download); on OUT's filesystem it adds to OUT's room instead
    (`out_room`, returned grown). None: nothing to download (a repo already in the cache)."""
    from huggingface_hub import constants

    if layout.cached:
        return None
    where = Path(constants.HF_HUB_CACHE) if keep_source else Path(download_dir or Path(out) / ".lucifer" / "download")
    need = layout.total if keep_source else layout.stream_peak(specs, options)
    if os.stat(diskspace.existing(where)).st_dev == os.stat(diskspace.existing(out)).st_dev:
        return replace(out_room, needed=out_room.needed + need, download=need)
    return Room(where, diskspace.filesystem(where), diskspace.free_bytes(where), need, download=need)


def routes_lines(doc: dict) -> list[str]:
    routes, link = doc["routes"], doc["link"]
    said = "the default; --link RATE gives yours" if link["default"] else "--link"
    lines = ["", f"routes to the serving boxes, per node (one rank each; the source is {size(doc['source_bytes'])}); "
                 f"times at a link to the Hub of {link['rate']} ({rate(link['bytes_per_s'])}, {said}) and convert "
                 f"at {rate(doc['disk']['bytes_per_s'])} read + written (`make bench`; it scales with the disk):"]
    for r in routes:
        box = f"; a conversion box with {size(r['conversion_box'])}" if r["conversion_box"] else ""
        lines.append(f"  {r['name']:<32} download {size(r['download_per_node']):>10}, disk {size(r['disk_per_node']):>10}"
                     f"{box}")
        lines.append(f"  {'':<32} time {_route_time(r)}")
        lines.append(f"  {'':<32} lucifer-shard {r['command']}")
    lines.append(f"  (streaming holds at most {size(doc['stream_peak_bytes'])} of the source at once; shards: "
                 f"{doc['shards']})")
    return lines


def _route_time(r: dict) -> str:
    """A route's time: its download at the link, then or beside it the conversion, then the copy."""
    down, conv = duration(r["download_seconds"]), duration(r["convert_seconds"])
    if not r["convert_seconds"]:
        return f"{down} to download"
    if r["conversion_box"]:
        return (f"{duration(r['download_seconds'] + r['convert_seconds'])}: {down} to download the source on the "
                f"conversion box, then {conv} to convert; then the copy over the boxes' own link")
    return (f"{down} to download, with {conv} of conversion beside it (streamed: the route takes at least the longer "
            f"of the two)")
