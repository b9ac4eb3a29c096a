"""The conversion engine: stream every source tensor once into per-rank safetensors files.

Order of work: for each role and part (a part has the same tensors on every rank), open one
writer per rank, then for each tensor and chunk assemble all ranks' bytes from one read of the
source, lay out routed experts, and append. A part is journaled once every rank's file is
published; `--resume` skips journaled parts whose files still hash to their recorded digests.
The manifest and COMPLETE are written last. All of it runs under OUT's writer lock (`outlock`),
after the space still needed, known exactly from the plan, was checked against the filesystem's
free space (`diskspace`); a write that runs out of room all the same says how much is left to do.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import __version__
from ..errors import OutputError, SourceError
from ..spec import footprint
from ..spec.content import ALGORITHM, BLOCK, ContentDigests, checkpoint_digest, shard_digests
from ..spec.layouts import EXPERT_TENSORS, LAYOUT_VERSION, Layout, expert_layout
from ..spec.manifest import (COMPLETE_NAME, FLASHINFER_VERSIONS, MANIFEST_NAME, RUNTIME, STATE_DIR, FORMAT,
                             FORMAT_VERSION, Options, conversion_id, file_metadata, manifest_text, part_path, rank_dir)
from ..spec.outlock import LOCK_NAME, OutLock, describe
from ..spec.plan import MOE_VARIANT, Plan, make_plan
from ..spec.rules import TensorSpec, build_specs
from ..spec.source import Checkpoint, open_checkpoint, resolve_model, side_files
from ..units import byte_bar, duration, rate, size
from .assemble import chunks
from .diskspace import WRITE_LIMITS, check_room, filesystem, free_bytes, tree_bytes, write_failed
from .fsutil import atomic_copy, atomic_write_text
from .stwriter import StreamWriter, TensorHeader, WrittenFile, encode_header, hash_file

JOURNAL = "journal.jsonl"
RECORD = "conversion.json"
logger = logging.getLogger(__name__)


@dataclass
class Summary:
    out: Path
    conversion_id: str
    bytes_read: int = 0
    bytes_written: int = 0
    files_written: int = 0
    files_resumed: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**asdict(self), "out": str(self.out)}

    def lines(self) -> list[str]:
        moved = (self.bytes_read + self.bytes_written) / self.seconds if self.seconds else 0.0
        return [
            f"output     {self.out}",
            f"files      {self.files_written} written, {self.files_resumed} kept from an earlier run",
            f"read       {size(self.bytes_read)}",
            f"written    {size(self.bytes_written)}",
            f"time       {duration(self.seconds)} ({rate(moved)} read + written)",
            *(f"note       {n}" for n in self.notes),
        ]


@dataclass
class Part:
    role: str
    index: int
    names: list[str]
    bytes_per_rank: int


def tensor_layouts(options: Options) -> dict[str, Layout]:
    """The layout of each routed-expert tensor for these options."""
    return {t: expert_layout(options.arch, options.expert_layout, options.flashinfer_layout, t)
            for t in EXPERT_TENSORS}


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
    64-hex-digit conversion id and the alignment; any id gives the same length)."""
    files = {}
    for role, ranks in specs.items():
        for rank, rank_specs in enumerate(ranks):
            by_name = {s.name: s for s in rank_specs}
            for part in (p for p in parts if p.role == role):
                headers = part_headers(by_name, part, layouts)
                meta = file_metadata(cid, role, rank, part.index, tp)
                files[part_path(role, rank, part.index)] = (len(encode_header(headers, meta, align))
                                                            + sum(h.nbytes for h in headers))
    tensors = sum(len(r) for ranks in specs.values() for r in ranks)
    return footprint.Footprint(footprint.read_bytes(specs, sizes), files, tensors, side)


def plan_parts(role: str, specs: list[TensorSpec], max_bytes: int, align: int = 8) -> list[Part]:
    """Split a rank's sorted tensors into parts of at most `max_bytes` (a larger tensor stands alone).

    Safetensors forbids gaps between tensors, so alignment is had by order: within a part, the
    tensors whose size is a multiple of `align` come first (by name) and therefore all start
    aligned once the header pads the data section to `align`.
    """
    parts: list[Part] = []
    names: list[str] = []
    size = 0
    sizes = {s.name: s.nbytes for s in specs}

    def close() -> None:
        if align > 8:  # the default keeps plain name order
            names.sort(key=lambda n: (sizes[n] % align != 0, n))
        parts.append(Part(role, len(parts), list(names), size))

    for spec in specs:
        if names and size + spec.nbytes > max_bytes:
            close()
            names, size = [], 0
        names.append(spec.name)
        size += spec.nbytes
    if names:
        close()
    return parts


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


def prepare(model: str, options: Options) -> Job:
    root = resolve_model(model)
    roles = ("target", "draft") if options.mtp else ("target",)
    ckpt = open_checkpoint(root, roles)
    plan = make_plan(ckpt.config, options.tp)
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
    return Job(ckpt, options, plan, specs, parts, layouts, conversion_id(ckpt.fingerprint, options), dropped)


# ---------------------------------------------------------------- output directory state


def _check_paths(out: Path, root: Path) -> None:
    """OUT and MODEL must not contain each other (path arithmetic only: nothing in OUT is read)."""
    out_r, root_r = out.resolve(), root.resolve()
    if out_r == root_r or root_r in out_r.parents:
        raise OutputError(f"OUT {out} is inside MODEL {root}; choose a directory outside the checkpoint")
    if out_r in root_r.parents:
        raise OutputError(f"OUT {out} contains MODEL {root}; choose a directory outside the checkpoint")


def _check_out(out: Path, job: Job, resume: bool, force: bool) -> dict[str, dict]:
    """Refuse unsafe targets; returns journal entries usable by --resume (path -> entry). Runs under
    OUT's lock, so the lock file is not counted as content."""
    state = out / STATE_DIR
    kept = [p for p in state.iterdir() if p.name != LOCK_NAME] if state.is_dir() else []
    others = [p for p in out.iterdir() if p.name != STATE_DIR]
    ours = bool(kept) or (out / MANIFEST_NAME).exists()
    if force:
        if ours or not others:
            return {}  # convert clears it once the room is checked
        raise OutputError(f"{out} is not empty and not a lucifer-shard output; --force only replaces outputs of this tool")
    if (out / COMPLETE_NAME).exists():
        raise OutputError(f"{out} already holds a complete conversion; pass --force to replace it")
    if not ours:
        if others:
            raise OutputError(f"{out} is not empty and not a lucifer-shard output; choose an empty or new directory")
        return {}
    if not resume:
        raise OutputError(f"{out} holds an unfinished conversion; pass --resume to finish it or --force to restart")
    try:
        record = json.loads((state / RECORD).read_text()) if (state / RECORD).exists() else {}
    except (OSError, ValueError) as e:
        raise OutputError(f"--resume: {state / RECORD} is unreadable ({e}); pass --force to restart") from None
    if not isinstance(record, dict):
        raise OutputError(f"--resume: {state / RECORD} is not a conversion record; pass --force to restart")
    now = _record(job)
    changed = [n for n, st in now["source_files"].items() if record.get("source_files", {}).get(n) != st]
    if record.get("conversion_id") == job.cid and changed:
        # Same headers and sizes, other bytes (a re-download or fine-tune): finished parts are stale.
        raise OutputError(f"--resume: source checkpoint changed since {out} was started ({changed[0]} was "
                          f"modified); pass --force to restart")
    if record.get("conversion_id") != job.cid:
        differs = [label for k, label in (("source_fingerprint", "source"), ("options", "options"),
                                          ("tool_version", "tool version")) if record.get(k) != now.get(k)]
        raise OutputError(f"--resume: {out} was started with other {' and '.join(differs) or 'settings'} "
                          f"({_describe_diff(record, now)}); "
                          f"pass --force to restart")
    return _journal(state / JOURNAL)


def _journal(path: Path) -> dict[str, dict]:
    """Journal entries by path; a line torn by a crash (or not an entry) is skipped: that part is redone."""
    entries = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if (isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("digest"), str)
                    and type(entry.get("bytes")) is int and isinstance(entry.get("tensors"), dict)):
                entries[entry["path"]] = entry
    return entries


def _journal_line(entry: dict) -> str:
    return json.dumps(entry, sort_keys=True) + "\n"


def _describe_diff(old: dict, new: dict) -> str:
    if old.get("source_fingerprint") != new.get("source_fingerprint"):
        return "source checkpoint changed"
    a, b = old.get("options", {}), new.get("options", {})
    diffs = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(diffs) or f"tool version {old.get('tool_version')} -> {new.get('tool_version')}"


def planned_files(job: Job) -> dict[str, dict]:
    """Every rank file's journal entry as it will be, with all-zero digests. Digests have a fixed
    length, so the sizes of the files, their journal lines and the manifest are exact before a
    byte is written."""
    zero = "0" * 64
    sizes = job.footprint().files
    by_name = {role: {s.name: s for s in ranks[0]} for role, ranks in job.specs.items()}
    files = {}
    for part in job.parts:
        for rank in range(job.plan.tp):
            rel = part_path(part.role, rank, part.index)
            files[rel] = {"path": rel, "bytes": sizes[rel], "digest": zero, "tensors": {n: zero for n in part.names}}
            if rank == 0:  # the first rank's entry carries the part's source digests
                files[rel]["sources"] = {k: zero for k in part_keys(by_name[part.role], part)}
    return files


def sizes_to_write(job: Job, planned: dict[str, dict], done: set[str]) -> list[int]:
    """Sizes of every file still to be written (or appended, for the journal) after the files in `done`."""
    left = [e for rel, e in planned.items() if rel not in done]
    sizes = [e["bytes"] for e in left] + [sum(len(_journal_line(e)) for e in left)]
    sizes += [(job.ckpt.root / n).stat().st_size for n in side_files(job.ckpt.root)]
    sizes += [len(manifest_text(build_manifest(job, planned)).encode()), len(job.cid) + 1]
    return sizes


def _clear(out: Path) -> None:
    """Empty OUT, all but the lock file this process holds."""
    for child in out.iterdir():
        if child.name == STATE_DIR and child.is_dir():
            for p in child.iterdir():
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.name != LOCK_NAME:
                    p.unlink()
        elif child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _record(job: Job) -> dict:
    stats = {n: [(job.ckpt.root / n).stat().st_size, (job.ckpt.root / n).stat().st_mtime_ns] for n in job.ckpt.files}
    return {"conversion_id": job.cid, "source_fingerprint": job.ckpt.fingerprint,
            "options": job.options.to_dict(), "tool_version": __version__, "source_files": stats}


def _part_valid(out: Path, entry: dict) -> bool:
    """A journaled file counts only if it still exists and hashes to its recorded digest."""
    path = out / entry["path"]
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        return False
    try:
        return hash_file(path)[0] == entry["digest"]
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------- streaming


class _RankSink:
    """One rank's writer. Layout + hash + write run on a worker thread in submission order (the
    rank's own thread with --workers > 1, otherwise one thread shared by all ranks), so reading and
    assembling the next chunk overlaps writing this one; at most two chunks per rank are in
    flight. Written chunk buffers go back to `buffers`."""

    def __init__(self, writer: StreamWriter, pool: ThreadPoolExecutor | None, buffers=None):
        self.writer = writer
        self.pool = pool
        self.buffers = buffers
        self.pending: list[Future] = []

    def put(self, name: str, buf: np.ndarray, layout: Layout | None) -> None:
        def work():
            data = layout.forward(buf) if layout is not None else buf
            self.writer.write(name, np.ascontiguousarray(data))
            if self.buffers is not None:
                self.buffers.give(buf)
        if self.pool is None:
            work()
            return
        while len(self.pending) >= 2:  # bound memory: at most two chunks in flight per rank
            self.pending.pop(0).result()
        self.pending.append(self.pool.submit(work))

    def drain(self) -> None:
        for f in self.pending:
            f.result()
        self.pending.clear()


def _write_part(job: Job, out: Path, part: Part, bar: tqdm, pools: list[ThreadPoolExecutor | None],
                digests: ContentDigests) -> list[WrittenFile]:
    from .assemble import Assembler, EngineBufferPool, swap_folded
    from .stwriter import partial_path

    specs_by_name = [{s.name: s for s in rank_specs} for rank_specs in job.specs[part.role]]
    shared = ThreadPoolExecutor(1, thread_name_prefix="lucifer-write") if all(p is None for p in pools) else None
    buffers = EngineBufferPool()
    asm = Assembler(job.ckpt, buffers, digests=digests)
    sinks: list[_RankSink] = []
    stream = None
    try:
        for rank in range(job.plan.tp):
            headers = part_headers(specs_by_name[rank], part, job.layouts)
            path = out / part_path(part.role, rank, part.index)
            meta = file_metadata(job.cid, part.role, rank, part.index, job.plan.tp)
            sinks.append(_RankSink(StreamWriter(path, headers, meta, align=job.options.align), pools[rank] or shared, buffers))
        work = []
        for name in part.names:
            specs = [specs_by_name[r][name] for r in range(job.plan.tp)]
            layout = job.layouts[specs[0].expert_tensor] if specs[0].expert_tensor else None
            if layout is not None and layout.steps[:1] == ("swap_halves",):
                swapped = [swap_folded(s) for s in specs]
                if all(swapped):  # place the halves swapped while assembling: one copy less
                    specs = swapped
                    layout = Layout(layout.name, layout.steps[1:], layout.version)
            if layout is not None and not layout.steps:
                layout = None
            work.extend(((name, layout), specs, a, b) for a, b in chunks(specs[0]))
        # The reader threads run ahead of assembly; the writers run behind it.
        stream = asm.stream(work)
        for (name, layout), bufs in stream:
            for sink, buf in zip(sinks, bufs):
                sink.put(name, buf, layout)
            bar.update(sum(buf.nbytes for buf in bufs))
        for sink in sinks:
            sink.drain()
        return [sink.writer.close() for sink in sinks]
    except BaseException:
        for sink in sinks:
            try:
                sink.drain()
            except BaseException:
                pass
            sink.writer.abort()
        for rank in range(job.plan.tp):  # also a writer interrupted while it was being opened
            partial_path(out / part_path(part.role, rank, part.index)).unlink(missing_ok=True)
        raise
    finally:
        if stream is not None:
            stream.close()  # an early exit: let its queued reads finish before the reader stops
        asm.close()
        if shared is not None:
            shared.shutdown(wait=True)


def _remove_partials(out: Path) -> None:
    for p in out.glob("*/rank-*/.*.partial"):
        p.unlink()
    for p in out.glob(".*.partial"):
        p.unlink()


def convert(model: str, out: Path, options: Options, resume: bool = False, force: bool = False,
            workers: int = 1, progress: bool = True) -> Summary:
    """Convert MODEL into OUT; see the module docstring for the order and crash safety.

    Only the source is read before OUT's writer lock is taken; everything in OUT after."""
    t0 = time.perf_counter()
    job = prepare(model, options)
    out = Path(out)
    _check_paths(out, job.ckpt.root)
    with OutLock(out) as lock:
        summary = _convert_locked(job, out, resume, force, workers, progress)
    if lock.previous:
        summary.notes.append(f"took over {out} from a writer that ended without releasing it "
                             f"({describe(lock.previous)})")
    summary.seconds = time.perf_counter() - t0
    return summary


def _convert_locked(job: Job, out: Path, resume: bool, force: bool, workers: int, progress: bool) -> Summary:
    journaled = _check_out(out, job, resume, force)
    summary = Summary(out, job.cid)
    results: dict[str, dict] = {}
    todo = []
    for part in job.parts:
        paths = [part_path(part.role, r, part.index) for r in range(job.plan.tp)]
        # the first rank's entry carries the part's source digests (a journal without them is redone)
        if "sources" in journaled.get(paths[0], {}) and all(p in journaled and _part_valid(out, journaled[p])
                                                             for p in paths):
            for p in paths:
                results[p] = journaled[p]
            summary.files_resumed += len(paths)
        else:
            todo.append(part)
    # Nothing in OUT has changed yet: check the room first, counting what this run removes.
    planned = planned_files(job)
    given_back = tree_bytes(out) if force else tree_bytes(out, ".*.partial")
    logger.info("room: %s to write, %s free on %s, %s given back by this run",
                size(sum(sizes_to_write(job, planned, set(results)))), size(free_bytes(out)), filesystem(out),
                size(given_back))
    check_room(out, sizes_to_write(job, planned, set(results)), given_back,
               "run the same command" + (" with --resume" if results else ""))
    if force:
        _clear(out)
    _remove_partials(out)
    logger.info("%d part(s) of %d files to write, %d file(s) kept from an earlier run", len(todo), job.plan.tp,
                summary.files_resumed)
    by_name = {role: {s.name: s for s in ranks[0]} for role, ranks in job.specs.items()}
    sizes = job.source_sizes
    digests = ContentDigests({k: sizes[k] for part in todo for k in part_keys(by_name[part.role], part)})
    state = out / STATE_DIR
    total = sum(p.bytes_per_rank for p in todo) * job.plan.tp
    pools = [ThreadPoolExecutor(1) if workers > 1 else None for _ in range(job.plan.tp)]
    bar = byte_bar(total, f"convert tp{job.plan.tp}", progress)
    try:
        atomic_write_text(state / RECORD, json.dumps(_record(job), indent=1, sort_keys=True) + "\n")
        for role in job.roles:
            for rank in range(job.plan.tp):
                (out / rank_dir(role, rank)).mkdir(parents=True, exist_ok=True)
        with open(state / JOURNAL, "a") as journal:
            for part in todo:
                t_part = time.perf_counter()
                files = _write_part(job, out, part, bar, pools, digests)
                keys = part_keys(by_name[part.role], part)
                sources = digests.finished(keys)
                if len(sources) != len(keys):
                    raise RuntimeError(f"{part.role} part {part.index}: {len(keys) - len(sources)} source tensor(s) "
                                       f"not read completely")
                summary.bytes_read += sum(sizes[k] for k in keys)
                entries = {}
                for i, f in enumerate(files):
                    rel = str(f.path.relative_to(out))
                    entries[rel] = {"path": rel, "bytes": f.bytes, "digest": f.digest, "tensors": f.tensor_digests}
                    if i == 0:
                        entries[rel]["sources"] = sources
                    journal.write(_journal_line(entries[rel]))
                    summary.bytes_written += f.bytes
                    summary.files_written += 1
                journal.flush()
                os.fsync(journal.fileno())
                results.update(entries)  # only now would --resume keep them
                logger.info("%s part %d: %d file(s), %s, %.1f s", part.role, part.index, len(files),
                            size(sum(f.bytes for f in files)), time.perf_counter() - t_part)
        for name in side_files(job.ckpt.root):
            atomic_copy(job.ckpt.root / name, out / name)
        atomic_write_text(out / MANIFEST_NAME, manifest_text(build_manifest(job, results)))
        atomic_write_text(out / COMPLETE_NAME, job.cid + "\n")
    except SourceError:
        # The source itself is bad: no rerun can finish this output, so leave nothing behind.
        _clear(out)
        raise
    except OSError as e:
        if e.errno not in WRITE_LIMITS:
            raise
        largest = max(entry["bytes"] for entry in planned.values())
        raise write_failed(e, out, sizes_to_write(job, planned, set(results)), largest) from None
    finally:
        bar.close()
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        job.ckpt.close()
    return summary


def source_content(job: Job, files: dict[str, dict]) -> dict:
    """The manifest's `source.content`: digests of every converted source tensor, per shard and in all."""
    digests: dict[str, str] = {}
    for entry in files.values():
        digests.update(entry.get("sources") or {})
    shards = shard_digests(digests, {k: job.ckpt.tensors[k].file for k in digests})
    return {"algorithm": ALGORITHM, "block_bytes": BLOCK, "tensors": len(digests), "files": shards,
            "digest": checkpoint_digest(shards)}


# ---------------------------------------------------------------- manifest


def _zero_regions(spec: TensorSpec) -> list[list[int]]:
    """[dim, start, end) pad regions in model layout (dims of the per-expert matrix when stacked)."""
    regions = []
    for p in spec.pieces:
        lo, hi = p.tail
        if hi > lo:
            regions.append([p.dim, lo, hi])
    return regions


def build_manifest(job: Job, files: dict[str, dict]) -> dict:
    o = job.options
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "conversion_id": job.cid,
        "source": {"fingerprint": job.ckpt.fingerprint, "path": str(job.ckpt.root.absolute()),
                   "files": dict(sorted(job.ckpt.files.items())), "side_files": side_files(job.ckpt.root),
                   "content": source_content(job, files)},
        "tp_size": job.plan.tp,
        "plan": job.plan.to_dict(),
        "options": o.to_dict(),
        "arch": o.arch,
        "moe_variant": MOE_VARIANT[o.arch],
        "expert_layout": o.expert_layout,
        "flashinfer_layout": o.flashinfer_layout if o.arch == "sm90" and o.expert_layout == "kernel" else None,
        "layouts": {t: {"name": lay.name, "steps": list(lay.steps), "version": lay.version}
                    for t, lay in job.layouts.items()},
        "layout_version": LAYOUT_VERSION,
        "runtime": {**RUNTIME, "flashinfer": FLASHINFER_VERSIONS[o.flashinfer_layout] if o.arch == "sm90" else "any"},
        "dropped": dict(sorted(job.dropped.items())),
        "roles": {},
    }
    for role in job.roles:
        ranks = []
        for rank, specs in enumerate(job.specs[role]):
            parts = [p for p in job.parts if p.role == role]
            rank_files = []
            tensors = {}
            for part in parts:
                rel = part_path(role, rank, part.index)
                entry = files[rel]
                rank_files.append({"path": rel, "bytes": entry["bytes"], "digest": "blake3:" + entry["digest"]})
                for name in part.names:
                    tensors[name] = {"file": rel, "digest": "blake3:" + entry["tensors"][name]}
            for spec in specs:
                t = tensors[spec.name]
                t.update({
                    "dtype": spec.dtype,
                    "shape": list(stored_shape(spec, job.layouts)),
                    "model_shape": list(spec.shape),
                    "layout": layout_name(spec, job.layouts),
                    "experts": spec.experts,
                    "sources": [{"key": p.source, "dim": p.dim, "src_start": p.src_start, "dst_start": p.dst_start,
                                 "length": p.length, "seg_len": p.seg_len} for p in spec.pieces],
                    "source_dtype": spec.src_dtype,
                    "zero_regions": _zero_regions(spec),
                    "pad": "-inf" if spec.pad != b"\x00" else "zero",
                })
            ranks.append({"rank": rank, "files": rank_files, "tensors": tensors})
        doc["roles"][role] = {"ranks": ranks}
    return doc
