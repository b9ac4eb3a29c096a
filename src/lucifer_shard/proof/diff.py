"""`diff OUT MODEL`: proof, byte for byte, that the rank files are the source checkpoint.

This goes the other way from the engine and shares none of its code path (`assemble`): every rank
file is opened through its own header, each chunk of a rank tensor is read raw, the inverse of its
declared layout is applied, every pad byte is checked against its pad value, and each logical slice
(un-fused: one piece per source key) is compared with the matching region of the source tensor,
read raw from its shard. The rule table, not the manifest, says what every tensor must hold (the
manifest only says where it is, and is itself checked against the rule table), and independently
of that: every source tensor is consumed exactly once (or dropped for a stated reason), the
sharded pieces of every source tensor tile its sharded dim exactly across the ranks, and
replicated pieces are whole on every rank.

Work goes in groups (the four routed-expert tensors of a layer together, since their source tensors lie
together expert by expert; every other tensor alone) and chunks of dim 0 (a few experts, or a row block) of
about 32 MiB per rank, at most two chunks in flight: memory stays bounded like `convert`. A chunk's source
rows are read once, in few large requests (regions of a shard that lie together are coalesced), and shared by
the ranks' tasks, which run on a thread pool. Source and rank bytes are read with positional O_DIRECT reads
(page cache only where the filesystem refuses direct I/O) into reused page-aligned buffers: no page-cache
copy, none of its page faults, so the run is bound by the disk rather than the kernel's CPU time. A
`swap_halves` expert chunk is compared through views of its halves, without an inverse copy. Comparisons run
on whole chunks with numpy; positions are only computed for the first mismatches, which are reported with the
source tensor and its logical index, the rank tensor and its index, and the absolute byte offset(s) in the
rank file (through the forward layout for kernel-layout experts).

Source identity, first and cheapest first: the source fingerprint (config.json, every shard's header and size)
must equal the manifest's, else diff stops with one line naming what differs (unless `keep_going`); then, as
the comparison reads every source byte, each tensor's content digest (content.py) is computed, and once all of
a shard's converted tensors are read the shard's digest is compared with the one convert recorded: a
checkpoint of the same shapes but other bytes stops the diff there with one line (or, with `keep_going`, is a
finding and the comparison goes on).

The source side (its reads, the content check, a repo streamed from the Hub) is `diff_source`; what diff shares
with verify is beside it (`report`, `rankfile`, `pads`, `structure`).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import MismatchError, OutputError
from ..formats.dtypes import DTYPE_SIZE
from ..guarded_io import JSON_LIMIT, Refused, read_regular
from ..model.plan import serving_arch
from ..model.tensorspecs import TensorSpec
from ..output.manifest_types import source_model, Manifest, TensorRecord
from ..source.checkpoint import Checkpoint, open_source
from ..source.hub import LinkFault
from ..units import byte_bar, duration, rate, size
from .diff_source import ChunkSources, ContentCheck, NarrowingError, ProofSourceReader, SourceStream, what_differs
from .pads import (check_pads, check_scales, chunk_slices, element_index, file_offsets, first_positions, is_scale,
                   slice_starts, to_model)
from .rankfile import CHUNK_BYTES, HeaderTensor, RankFile, byte_shape, read_rows_direct, row_chunks, scratch
from .report import Problem, Report, fmt_index, hexbytes
from .structure import check_file_digests, check_strays, open_files, read_manifest, usable

logger = logging.getLogger("lucifer_shard.diff")  # -v: the source and a line per rank file, -vv: per tensor


def _read(path: Path, follow: bool) -> bytes | None:
    """A side file's bytes (an output's copy: never through a link), None when it cannot be read."""
    try:
        return read_regular(path, JSON_LIMIT, follow=follow)
    except (OSError, Refused):
        return None


def diff(out: Path, model: str | None = None, max_mismatches: int = 10, progress: bool = True,
         chunk_bytes: int = CHUNK_BYTES, workers: int | None = None, keep_going: bool = False,
         download_dir: Path | None = None, download_source: bool = False) -> Report:
    """Compare OUT with the source checkpoint MODEL (default: the one the manifest records); see the
    module docstring. A repo id not in the Hugging Face cache streams through `download_dir` only
    with `download_source`: the whole source again (`diff_source.SourceStream.of`)."""
    t0 = time.perf_counter()
    out = Path(out)
    if not out.is_dir():
        raise OutputError(f"{out}: no such output directory")
    report = Report("diff", max_mismatches)
    checked = read_manifest(report, out)
    manifest, held = checked.manifest, checked.held
    check_strays(report, out, manifest, held)
    model, revision, recorded_model = source_model(out, manifest, model)
    ckpt = open_source(model, revision, tuple(manifest.roles))
    root = ckpt.root if ckpt.hub is None else f"{model}@{ckpt.hub.commit}"
    src = manifest.source
    report.info.update({"out": str(out), "model": str(root), "model_from_manifest": recorded_model,
                        "conversion_id": manifest.conversion_id, "fingerprint": ckpt.fingerprint,
                        "fingerprint_ok": src.fingerprint == ckpt.fingerprint, "tp_size": manifest.tp_size,
                        "arch": manifest.arch, "moe_backend": manifest.options.moe_backend,
                        "expert_layout": manifest.expert_layout})
    logger.info("source %s (%s): fingerprint %s", root, "recorded in the manifest" if recorded_model else "given",
                "as recorded" if report.info["fingerprint_ok"] else "differs from the manifest's")
    stop = "" if keep_going else (f"MODEL is not the checkpoint {out} was converted from ({src.path}); pass "
                                  f"that one, or --keep-going to compare byte for byte anyway")
    if not report.info["fingerprint_ok"]:
        what = what_differs(src, ckpt, out)
        if stop:
            raise MismatchError(f"diff: {root}: {what}; {stop}")
        report.add_first(Problem("source", f"{what}: source fingerprint {ckpt.fingerprint[:16]}... vs the manifest's "
                           f"{src.fingerprint[:16]}..."))
    elif src.files != ckpt.files:  # issue 52 V: the fingerprint holds, so the manifest's shard list was edited
        report.add(Problem("manifest", f"source.files: {what_differs(src, ckpt, out)}; the manifest was edited"))
    stream = SourceStream.of(ckpt, download_dir, download_source, out)  # a source on the Hub streams from here on
    for name in src.side_files:
        a = _read(out / name, False)
        if a is None or a != _read(stream.side(name), True):
            report.add(Problem("file", f"{name}: not a byte-identical copy of the source's {name}", file=name))
    rules = checked.expected
    stats = {"rank_tensors": 0, "source_tensors": 0, "rank_bytes": 0, "source_bytes": 0, "source_bytes_read": 0,
             "pad_bytes": 0}
    if rules is None:
        _finish(report, stats, t0)
        return report
    specs: dict[str, list[list[TensorSpec]]] = rules.specs
    entries = rules.entries
    _check_accounting(report, ckpt, specs, manifest.dropped)
    _check_coverage(report, ckpt, specs)
    files = open_files(report, out, manifest, held)
    keys = list(dict.fromkeys(k for role in specs for s in specs[role][0] for k in s.sources() if k in ckpt.tensors))
    content = ContentCheck(report, ckpt, keys, src.content.files, stop)
    reader = ProofSourceReader(ckpt, content.digests)
    total = sum(t.end - t.start for rf in files.values() for t in rf.tensors.values()) + sum(
        ckpt.tensors[k].offsets[1] - ckpt.tensors[k].offsets[0] for k in keys)
    bar = byte_bar(total, "diff", progress)
    work = stream.order(_plan_groups(manifest, specs, entries, files), reader)
    if workers is None:
        # threads mostly wait on direct reads (little CPU each), so the disk's queue depth, not the
        # CPU count, bounds them: two per rank
        workers = min(max(os.cpu_count() or 1, 2 * len(next(iter(specs.values())))), 16)
    try:
        _diff_data(report, reader, work, stats, bar, chunk_bytes, workers, content.settle, stream)
        content.settle()
        check_file_digests(report, manifest, files, held, chunk_bytes)
        report.info["content"] = {**content.info(), "share": held is not None}
    finally:
        bar.close()
        reader.close()
        stream.close(keep=isinstance(sys.exc_info()[1], LinkFault))  # the link failed: its bytes for the same diff
        for rf in files.values():
            rf.close()
    stats["source_tensors"] = len(reader.keys_read)
    stats["source_bytes"] = reader.bytes_needed
    stats["source_bytes_read"] = reader.bytes_read
    stats["dropped"] = len(manifest.dropped)
    stats["source_total"] = len(ckpt.tensors)
    if not stats["rank_tensors"]:  # OK means compared: an output (or share) with no rank file proves nothing
        report.add(Problem("structure", f"no rank tensor was compared: {out} holds no rank file the manifest "
                           f"lists; {report.repair}"))
    _finish(report, stats, t0)
    return report


def _finish(report: Report, stats: dict, t0: float) -> None:
    seconds = time.perf_counter() - t0
    moved = stats["rank_bytes"] + stats["source_bytes"]
    report.stats.update(stats)
    report.stats.update({"seconds": round(seconds, 3),
                         "bytes_per_s": round(moved / seconds) if seconds else 0})


# ---------------------------------------------------------------- structure


def _check_accounting(report: Report, ckpt: Checkpoint, specs: dict, dropped: dict) -> None:
    """Every source tensor is consumed by exactly one rank tensor, or dropped with a stated reason; an alias
    tensor (the rules' second parameter of the same bytes) reads only what another one consumes."""
    consumed: dict[str, list[str]] = {}
    aliased: dict[str, str] = {}
    for role, rank_specs in specs.items():
        for spec in rank_specs[0]:
            for k in dict.fromkeys(spec.sources()):
                if spec.alias:
                    aliased[k] = f"{role} {spec.name}"
                else:
                    consumed.setdefault(k, []).append(f"{role} {spec.name}")
    for key, alias in sorted(aliased.items()):
        if key not in consumed:
            report.add(Problem("coverage", f"source tensor {key!r} is read by {alias}, an alias of a tensor that "
                               f"no rank tensor holds", file=key))
    for key in sorted(set(ckpt.tensors) | set(consumed) | set(dropped)):
        uses = consumed.get(key, [])
        if key not in ckpt.tensors:
            report.add(Problem("coverage", f"source tensor {key!r} is read by {uses[0] if uses else 'the manifest'} "
                               f"but the checkpoint does not hold it", file=key))
        elif key in dropped:
            if uses:
                report.add(Problem("coverage", f"source tensor {key!r} is listed as dropped but {uses[0]} holds it",
                                   file=key))
            elif not str(dropped[key]).strip():
                report.add(Problem("coverage", f"source tensor {key!r} was dropped without a reason", file=key))
        elif not uses:
            report.add(Problem("coverage", f"source tensor {key!r} is in no rank file and not listed as dropped "
                               f"(the output lost it; re-run convert)", file=key))
        elif len(uses) > 1:
            report.add(Problem("coverage", f"source tensor {key!r} feeds {len(uses)} tensors: {', '.join(uses)}",
                               file=key))


def _check_coverage(report: Report, ckpt: Checkpoint, specs: dict) -> None:
    """Sharded pieces tile the source dim exactly across ranks; replicated pieces are whole on every rank."""
    for role, rank_specs in specs.items():
        tp = len(rank_specs)
        for i, spec0 in enumerate(rank_specs[0]):
            for j, p0 in enumerate(spec0.pieces):
                key = p0.source.format(e=0) if spec0.experts else p0.source
                entry = ckpt.tensors.get(key)
                if entry is None:
                    continue  # reported by the accounting
                ps = [rank_specs[r][i].pieces[j] for r in range(tp)]
                size = entry.shape[p0.dim]
                mshape = spec0.matrix_shape
                other = [d for d in range(len(mshape)) if d != p0.dim]
                if len(mshape) != len(entry.shape) or any(mshape[d] != entry.shape[d] for d in other):
                    report.add(Problem("coverage", f"source {key} is {list(entry.shape)}, which does not fit the rank "
                                       f"tensor's {list(mshape)} outside dim {p0.dim}", role, None, spec0.name))
                    continue
                if all(p.src_start == 0 and p.length == size for p in ps):
                    continue  # replicated: whole on every rank
                spans = sorted((p.src_start, p.src_start + p.length) for p in ps if p.length)
                at = 0
                for lo, hi in spans:
                    if lo != at:
                        what = "overlap" if lo < at else "gap"
                        report.add(Problem("coverage", f"source {key} dim {p0.dim}: ranks' slices leave a {what} at "
                                           f"{min(lo, at)}:{max(lo, at)} (slices {spans})", role, None, spec0.name))
                        break
                    at = hi
                else:
                    if at != size:
                        report.add(Problem("coverage", f"source {key} dim {p0.dim}: ranks' slices cover 0:{at} of "
                                           f"{size}", role, None, spec0.name))


# ---------------------------------------------------------------- data


Member = tuple  # (TensorSpec, TensorRecord, RankFile, HeaderTensor): one tensor of one rank


def _plan_groups(manifest: Manifest, specs: dict, entries: dict, files: dict) -> list[tuple[str, list[list[Member]]]]:
    """Work groups: the four routed-expert tensors of a layer go together (their source tensors lie
    together, expert by expert), every other tensor alone. Per group and rank, the usable members."""
    work = []
    recorded = {(role, e.rank): e for role, ranks in manifest.roles.items() for e in ranks}
    for role, rank_specs in specs.items():
        groups: list[list[int]] = []
        for i, spec in enumerate(rank_specs[0]):
            prev = rank_specs[0][groups[-1][0]] if groups else None
            if (spec.experts and prev is not None and prev.experts == spec.experts
                    and prev.name.rsplit(".", 1)[0] == spec.name.rsplit(".", 1)[0]):
                groups[-1].append(i)
            else:
                groups.append([i])
        for idx in groups:
            per_rank = []
            for r, specs_r in enumerate(rank_specs):
                members = []
                for i in idx:
                    spec = specs_r[i]
                    entry = recorded.get((role, r))
                    rec = entry.tensors.get(spec.name) if entry is not None else None
                    if rec is None:
                        continue  # reported by the output check
                    info = replace(entries[role][r][spec.name], file=rec.file)
                    rf = files.get(rec.file)
                    if usable(rf, spec.name, info):  # else reported by the file checks
                        members.append((spec, info, rf, rf.tensors[spec.name]))
                per_rank.append(members)
            if any(per_rank):
                work.append((role, per_rank))
    return work


def _group_chunks(reader: ProofSourceReader, per_rank: list[list[Member]], chunk_bytes: int) -> list[tuple[int, int]]:
    """Ranges of dim 0 (experts, or rows) whose rank bytes (per rank) and source bytes stay near chunk_bytes."""
    spec0 = next(m for ms in per_rank for m in ms)[0]
    ckpt = reader.ckpt
    n0 = spec0.experts or spec0.shape[0]
    rank_row = max(sum((ht.end - ht.start) // max(1, ht.shape[0]) for _, _, _, ht in ms) for ms in per_rank)
    keys = {}
    for ms in per_rank:
        for spec, _, _, _ in ms:
            for p in spec.pieces:
                key = p.source.format(e=0) if spec.experts else p.source
                if key in ckpt.tensors:
                    e = ckpt.tensors[key]
                    keys[key] = (e.offsets[1] - e.offsets[0]) // (1 if spec.experts else max(1, e.shape[0]))
    src_row = sum(keys.values())
    return row_chunks(n0, max(rank_row, src_row), chunk_bytes)


def _regions(reader: ProofSourceReader, per_rank: list[list[Member]], a: int, b: int) -> dict[tuple[str, int, int], bool]:
    """Every source region (key, first row, end row) the chunk [a, b) of the group compares against, and
    whether its bytes feed the content digest (not where only an alias spec reads it: its owner's does)."""
    out: dict[tuple[str, int, int], bool] = {}
    for ms in per_rank:
        for spec, _, _, _ in ms:
            for region in _spec_regions(reader.ckpt.tensors, spec, a, b):
                out[region] = out.get(region, False) or not spec.alias
    return out


def _spec_regions(tensors: dict, spec: TensorSpec, a: int, b: int) -> list[tuple[str, int, int]]:
    """The source regions one spec's chunk [a, b) reads."""
    out = []
    for p in spec.pieces:
        if spec.experts:
            for e in range(a, b):
                key = p.source.format(e=e)
                if key in tensors:
                    out.append((key, 0, tensors[key].shape[0]))
        elif p.source not in tensors:
            continue
        elif p.dim == 0:
            lo, hi = max(a, p.dst_start), min(b, p.dst_start + p.length)
            if lo < hi:
                s0 = p.src_start + lo - p.dst_start
                out.append((p.source, s0, s0 + hi - lo))
        else:
            out.append((p.source, a, b))
    return out


class SwappedHalves:
    """The model layout of a stored `swap_halves` array (halves of axis `axis` exchanged) without a copy:
    a slice inside one half of that axis is a view of the other half of the stored array; anything else
    (only needed to report a mismatch) is the copied inverse."""

    def __init__(self, stored: np.ndarray, axis: int):
        self.stored, self.axis = stored, axis
        self.shape, self.ndim = stored.shape, stored.ndim

    def _full(self) -> np.ndarray:
        i = self.shape[self.axis] // 2
        lo = (slice(None),) * self.axis
        return np.concatenate([self.stored[(*lo, slice(i, None))], self.stored[(*lo, slice(0, i))]], axis=self.axis)

    def __array__(self, dtype=None, copy=None):
        full = self._full()
        return full if dtype is None else full.astype(dtype)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)) and self.axis > 0:
            return SwappedHalves(self.stored[key], self.axis - 1)
        if isinstance(key, tuple) and len(key) > self.axis and all(isinstance(k, slice) for k in key):
            s = key[self.axis]
            n = self.shape[self.axis]
            lo, hi, step = s.indices(n)
            i = n // 2
            if step == 1 and hi <= i:
                return self.stored[(*key[:self.axis], slice(lo + i, hi + i), *key[self.axis + 1:])]
            if step == 1 and lo >= i:
                return self.stored[(*key[:self.axis], slice(lo - i, hi - i), *key[self.axis + 1:])]
        return self._full()[key]


def _same(got: np.ndarray, want: np.ndarray, block: int = 4 << 20) -> bool:
    """Byte equality of two equally shaped views, on 8-byte words where the layout allows it, in blocks
    of rows so the comparison buffer stays small and hot."""
    if got.ndim and got.shape[-1] % 8 == 0 and got.strides[-1] == 1 and want.strides[-1] == 1:
        try:
            got, want = got.view(np.uint64), want.view(np.uint64)
        except ValueError:
            pass
    if got.ndim == 0 or got.size == 0:
        return bool(np.array_equal(got, want))
    row = max(1, got.size // got.shape[0])
    step = max(1, block // (row * got.itemsize))
    for i in range(0, got.shape[0], step):
        g, w = got[i:i + step], want[i:i + step]
        out = scratch("cmp", g.size).view(bool).reshape(g.shape)
        np.equal(g, w, out=out)
        if not out.all():
            return False
    return True


def _diff_data(report: Report, reader: ProofSourceReader, work: list[tuple[str, list[list[Member]]]], stats: dict,
               bar: tqdm, chunk_bytes: int, workers: int, settle, stream: SourceStream) -> None:
    """Every (group, chunk): the chunk's source blocks, then one task per rank, on a thread pool (numpy
    and preadv release the GIL); at most two chunks in flight; findings merged in (group, chunk, rank)
    order, so reports are stable. A task details at most the findings the report still had room for
    when it was submitted. Block reads are queued before the rank tasks that wait for them, so a
    waiting task never waits for a read that has not started. `settle` runs after each merged chunk
    (the content check: it may stop the diff)."""
    inflight: deque[tuple[ChunkSources, list[Future], int | None]] = deque()
    seen = 0
    # A rank file's descriptors are closed once the last group reading it is merged: groups visit the
    # files in order, so a few are open at a time however many OUT has (no EMFILE at 1024 files).
    last: dict[str, int] = {}
    for g, (_, per_rank) in enumerate(work):
        for ms in per_rank:
            for _, _, rf, _ in ms:
                last[rf.rel] = g
    done_with: dict[int, list[RankFile]] = {}
    for g, (_, per_rank) in enumerate(work):
        for ms in per_rank:
            for _, _, rf, _ in ms:
                if last[rf.rel] == g and rf not in done_with.setdefault(g, []):
                    done_with[g].append(rf)

    def merge(item: tuple[ChunkSources, list[Future], int | None]) -> None:
        nonlocal seen
        sources, futs, group = item  # group: set on its last chunk
        finished = done_with.get(group, []) if group is not None else []
        for fut in futs:
            sub, rank_bytes, pad_bytes = fut.result()
            report.merge(sub)
            stats["rank_bytes"] += rank_bytes
            stats["pad_bytes"] += pad_bytes
            bar.update(rank_bytes)
        sources.release()
        for rf in finished:
            rf.close()
            logger.info("%s: compared with the source", rf.rel)
        now = reader.bytes_needed
        bar.update(now - seen)
        seen = now
        settle()
        if group is not None:
            stream.after(group)

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="diff") as pool:
        try:
            for g, (role, per_rank) in enumerate(work):
                stream.before(g)
                stats["rank_tensors"] += sum(len(ms) for ms in per_rank)
                chunks = _group_chunks(reader, per_rank, chunk_bytes)
                logger.debug("%s %s: %d rank tensor(s), %d chunk(s)", role,
                             ", ".join(dict.fromkeys(m[0].name for ms in per_rank for m in ms)),
                             sum(len(ms) for ms in per_rank), len(chunks))
                for c, (a, b) in enumerate(chunks):
                    sources = ChunkSources(reader, _regions(reader, per_rank, a, b))
                    for i in range(len(sources.blocks)):
                        pool.submit(sources.read, i)  # its outcome reaches the rank tasks through the block
                    inflight.append((sources, [pool.submit(_diff_rank_chunk, report.room, sources, role, ms, a, b)
                                               for ms in per_rank if ms],
                                     g if c == len(chunks) - 1 else None))
                    while len(inflight) > 1:
                        merge(inflight.popleft())
            while inflight:
                merge(inflight.popleft())
        finally:
            for _, futs, _ in inflight:
                for fut in futs:
                    fut.cancel()


def _diff_rank_chunk(limit: int, sources: ChunkSources, role: str, members: list[Member], a: int,
                     b: int) -> tuple[Report, int, int]:
    """One rank's rows (or experts) [a, b) of a group's tensors: pads, scales, every piece against its source."""
    sub = Report("diff", limit)
    read = pads = 0
    for spec, info, rf, ht in members:
        item = DTYPE_SIZE[spec.dtype]
        stored = read_rows_direct(rf.direct(), ht.start, ht.shape, ht.item, a, b, "rank")
        read += stored.nbytes
        if spec.experts:
            mshape = (b - a, *byte_shape(info.model_shape[1:], item))
            if info.layout == "swap_halves" and stored.shape == mshape:
                model = SwappedHalves(stored, 1)  # the inverse as views: no copy of the chunk
            else:
                model = to_model(stored, info.layout).reshape(mshape)
        else:
            model = stored
        pads += check_pads(sub, model, info, ht, rf, role, spec.rank, spec.name, a, b)
        if is_scale(info):
            check_scales(sub, model, info, ht, rf, role, spec.rank, spec.name, a)
        for p in spec.pieces:
            if p.source.format(e=a) not in sources.reader.ckpt.tensors:
                continue  # reported by the accounting
            if spec.experts:
                for e in range(a, b):
                    key = p.source.format(e=e)
                    src = sources.get(key, 0, sources.reader.ckpt.tensors[key].shape[0], spec.dtype)
                    nd = src.ndim
                    dst_sl = chunk_slices(p.dim, p.dst_start, p.dst_start + p.length, nd, item)
                    src_sl = chunk_slices(p.dim, p.src_start, p.src_start + p.length, nd, item)
                    _compare(sub, model[e - a], dst_sl, (e,), src, src_sl, 0, key, spec, info, rf, ht, role)
                continue
            nd = model.ndim
            if p.dim == 0:
                lo, hi = max(a, p.dst_start), min(b, p.dst_start + p.length)
                if lo >= hi:
                    continue
                s0 = p.src_start + lo - p.dst_start
                s1, dst_sl, src_sl, origin = s0 + hi - lo, chunk_slices(0, lo - a, hi - a, nd, item), \
                    chunk_slices(0, 0, hi - lo, nd, item), s0
            else:
                s0, s1, origin = a, b, a
                dst_sl = chunk_slices(p.dim, p.dst_start, p.dst_start + p.length, nd, item)
                src_sl = chunk_slices(p.dim, p.src_start, p.src_start + p.length, nd, item)
            try:
                src = sources.get(p.source, s0, s1, spec.dtype)
            except NarrowingError as e:
                sub.add(Problem("data", str(e), role, spec.rank, spec.name, rf.rel, {"source": p.source}))
                continue
            _compare(sub, model, dst_sl, a, src, src_sl, origin, p.source, spec, info, rf, ht, role)
    return sub, read, pads


def _compare(report: Report, model: np.ndarray, dst_sl: tuple[slice, ...], dst_origin, src: np.ndarray,
             src_sl: tuple[slice, ...], src_row0: int, key: str, spec: TensorSpec, info: TensorRecord, rf: RankFile,
             ht: HeaderTensor, role: str) -> None:
    """Compare one piece of a chunk with its source region; record the first mismatches in full.

    `dst_origin`: the chunk's first row (int) or, for one expert's matrix, the expert index as a 1-tuple
    (B-coords of the full rank tensor are then (e, *matrix coords)). `src_row0`: source row of the
    source array's row 0."""
    got, want = model[dst_sl], src[src_sl]
    if got.shape != want.shape:
        report.add(Problem("structure", f"slice of {list(got.shape)} bytes cannot hold source {key} region of "
                           f"{list(want.shape)} bytes", role, spec.rank, spec.name, rf.rel))
        return
    if _same(got, want):
        return
    item = DTYPE_SIZE[spec.dtype]
    bad = got != want
    total = int(np.count_nonzero(bad))
    dst_local = slice_starts(dst_sl)
    src_local = slice_starts(src_sl)
    if isinstance(dst_origin, tuple):
        dst_prefix = dst_origin
        dst_base = dst_local
    else:
        dst_prefix = ()
        dst_base = dst_local.copy()
        dst_base[0] += dst_origin * (item if model.ndim == 1 else 1)
    src_base = src_local.copy()
    src_base[0] += src_row0 * (item if src.ndim == 1 else 1)
    found: list[Problem] = []
    seen: set[tuple[int, ...]] = set()
    for pos in first_positions(bad, report.room * item):
        if len(found) >= report.room:
            break
        sidx = tuple(element_index(tuple(int(x) for x in src_base + pos), item))
        if sidx in seen:
            continue  # another byte of an element already reported
        seen.add(sidx)
        dst_bc = (*dst_prefix, *(int(x) for x in dst_base + pos))
        tidx = element_index(dst_bc, item)
        lo = int(pos[-1]) - int(pos[-1]) % item  # views start on an element boundary
        cell = tuple(int(x) for x in pos[:-1])
        exp = want[(*cell, slice(lo, lo + item))]
        fnd = got[(*cell, slice(lo, lo + item))]
        found.append(Problem(
            "data", f"differs from source {key}{fmt_index(sidx)}: expected {hexbytes(exp)} found {hexbytes(fnd)} "
            f"({total} differing byte(s) in this slice)", role, spec.rank, spec.name, rf.rel,
            {"source": key, "source_index": list(sidx), "tensor_index": tidx,
             "file_offset": file_offsets(ht, info, dst_bc), "expected": hexbytes(exp), "found": hexbytes(fnd)}))
    report.add_many(found, total, Problem("data", "", role, spec.rank, spec.name, rf.rel))


def _content_line(c: dict | None) -> str:
    if not c:
        return "not compared (the comparison did not run)"
    if not c["recorded"]:
        return "not recorded in the manifest (an older lucifer-shard converted OUT): not compared"
    what = f"{c['shards_checked']} of {c['shards']} shard(s) checked"
    if c["differs"]:
        return f"DIFFERS in {len(c['differs'])} shard(s) (first {c['differs'][0]}); {what}"
    if c["digest"]:
        return f"{str(c['digest'])[:23]}... equal to the converted checkpoint's"
    why = ("a node's share reads only its ranks' slices, and a shard's digest needs all of its bytes; those slices "
           "are compared byte for byte below") if c.get("share") else "the rest of their rank files could not be read"
    return f"equal where checked; {what} ({why})"


def diff_lines(report: Report) -> list[str]:
    s, i = report.stats, report.info
    fp = "equal to the manifest's" if i.get("fingerprint_ok") else "DIFFERS from the manifest's"
    where = " (the source the manifest records)" if i.get("model_from_manifest") else ""
    lines = [
        f"diff {i.get('out')} against {i.get('model')}{where}",
        f"  source fingerprint  {str(i.get('fingerprint'))[:16]}... {fp} (config.json, shard headers and sizes)",
        f"  source content      {_content_line(i.get('content'))} (BLAKE3 of every converted tensor's bytes)",
        f"  conversion          {str(i.get('conversion_id'))[:16]}...  tp {i.get('tp_size')}  "
        f"{serving_arch(i.get('arch'), i.get('moe_backend'))}  "
        f"experts {i.get('expert_layout')} layout",
        "",
        f"  rank tensors checked   {s.get('rank_tensors', 0)}",
        f"  source tensors         {s.get('source_tensors', 0)} compared of {s.get('source_total', 0)} "
        f"({s.get('dropped', 0)} dropped)",
        f"  source bytes compared  {size(s.get('source_bytes', 0))}",
        f"  rank bytes read        {size(s.get('rank_bytes', 0))} (pad bytes checked {size(s.get('pad_bytes', 0))})",
        f"  time                   {duration(s.get('seconds', 0))} "
        f"({rate(s.get('bytes_per_s', 0))} source + rank bytes)",
        "",
    ]
    return lines + report.outcome_lines("every rank tensor is its source slices, byte for byte; every pad byte is pad",
                                        "difference(s)")
