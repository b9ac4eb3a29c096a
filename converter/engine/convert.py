"""The conversion engine: stream every source tensor once into per-rank safetensors files.

Order of work: for each role and part (a part has the same tensors on every rank), open one
writer per rank, then for each tensor and chunk assemble all ranks' bytes from one read of the
source, lay out routed experts, and append. A part is journaled once every rank's file is
published; `--resume` skips journaled parts whose files still hash to their recorded digests.
The manifest and COMPLETE are written last. All of it runs under OUT's writer lock (`outlock`),
after the space still needed, known exactly from the plan, was checked against the filesystem's
free space (`diskspace`); a write that runs out of room all the same says how much is left to do.

What is decided before the first byte is `job`; OUT's state between runs (refusals, journal,
resume, room still needed) is `outstate`; the manifest is `manifest_writer`.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from ..errors import OutputError, SourceError, fault
from ..guarded_io import Tree, naming, partial_name, write_all
from ..spec.content import ContentDigests
from ..spec.layouts import Layout
from ..spec.manifest import (COMPLETE_NAME, CONTENT_PLACEHOLDER, Options, complete_problem, file_metadata,
                             part_content, part_path, rank_dir)
from ..spec.manifest_types import Manifest
from ..spec.outlock import OutLock, describe
from ..spec.plan import padding_only
from ..spec.source import side_files
from ..units import byte_bar, duration, rate, size
from .assemble import chunks
from .diskspace import WRITE_LIMITS, check_room, filesystem, free_bytes, write_failed
from .job import Job, Part, part_headers, part_keys, prepare
from .manifest_writer import build_manifest, write_manifest
from .outstate import (check_out, conversion_record, journal_line, open_journal, part_valid, partial_bytes,
                       planned_files, record_text, refuse_target, remove_partials, sizes_to_write, source_changed,
                       truncate_journal)
from .owned import JOURNAL_REL, RECORD_REL, clear, plan_clearing, read_json
from .repair import check_content, reference, survey
from .resumed import resumed_sources
from .stwriter import StreamWriter, WrittenFile

logger = logging.getLogger("lucifer_shard.convert")  # named for the command: -v prints "lucifer_shard.convert: ..."


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
                digests: ContentDigests, ranks: list[int] | None = None,
                check: Callable[[str, dict[str, str]], None] | None = None) -> tuple[list[WrittenFile], dict[str, str]]:
    """Write one part's file on every rank (or on `ranks`: a repair); its files and its source tensors'
    digests. The files are stamped with those digests (`part_content`), which `check(content,
    sources)` may refuse, before they are published."""
    from .assemble import Assembler, EngineBufferPool, swap_folded

    tree = Tree(out)
    specs_by_name = [{s.name: s for s in rank_specs} for rank_specs in job.specs[part.role]]
    shared = ThreadPoolExecutor(1, thread_name_prefix="lucifer-write") if all(p is None for p in pools) else None
    buffers = EngineBufferPool()
    asm = Assembler(job.ckpt, buffers, digests=digests)
    sinks: dict[int, _RankSink] = {}
    stream = None
    ranks = list(range(job.plan.tp)) if ranks is None else ranks
    try:
        for rank in ranks:
            headers = part_headers(specs_by_name[rank], part, job.layouts)
            rel = part_path(part.role, rank, part.index)
            meta = file_metadata(job.cid, part.role, rank, part.index, job.plan.tp, CONTENT_PLACEHOLDER)
            writer = StreamWriter(tree, rel, headers, meta, align=job.options.align)
            sinks[rank] = _RankSink(writer, pools[rank] or shared, buffers)
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
            logger.debug("%s part %d: %s %s%s per rank, layout %s", part.role, part.index, name, specs[0].dtype,
                         list(specs[0].shape), job.layouts[specs[0].expert_tensor].name if layout else "model")
            work.extend(((name, layout), specs, a, b) for a, b in chunks(specs[0]))
        # The reader threads run ahead of assembly; the writers run behind it.
        stream = asm.stream(work)
        for (name, layout), bufs in stream:
            for rank, buf in enumerate(bufs):
                if rank in sinks:
                    sinks[rank].put(name, buf, layout)
                else:  # a repair: this rank's file is sound
                    buffers.give(buf)
            bar.update(sum(bufs[r].nbytes for r in sinks))
        for sink in sinks.values():
            sink.drain()
        keys = part_keys(specs_by_name[0], part)
        sources = digests.finished(keys)
        if len(sources) != len(keys):
            raise RuntimeError(f"{part.role} part {part.index}: {len(keys) - len(sources)} source tensor(s) "
                               f"not read completely")
        content = part_content(sources)
        if check is not None:
            check(content, sources)
        return [sink.writer.close(content) for sink in sinks.values()], sources
    except BaseException:
        for sink in sinks.values():
            try:
                sink.drain()
            except BaseException:
                pass
            sink.writer.abort()
        # A stop (Ctrl-C, SIGTERM) that lands while a writer is being made leaves its temporary file
        # outside `sinks`: remove this part's by name (the lock makes them ours).
        for rank in ranks:
            tree.remove(partial_name(part_path(part.role, rank, part.index)))
        raise
    finally:
        if stream is not None:
            stream.close()  # an early exit: let its queued reads finish before the reader stops
        asm.close()
        if shared is not None:
            shared.shutdown(wait=True)


def convert(model: str, out: Path, options: Options, resume: bool = False, force: bool = False,
            workers: int = 1, progress: bool = True, revision: str | None = None,
            warn: Callable[[str], None] = logger.warning) -> Summary:
    """Convert MODEL (at `revision`, for a repo id) into OUT; see the module docstring for the order
    and crash safety. `warn` gets the plan's remarks (a rank that holds only padding).

    Before OUT's writer lock is taken the source is read and OUT only looked at (`refuse_target`,
    plan's refusals too); everything in OUT happens after."""
    t0 = time.perf_counter()
    job = prepare(model, options, revision)
    out = Path(out)
    repair = resume and out.is_dir() and reference(Tree(out), job) is not None  # a finished output of this job
    refuse_target(out, job.ckpt.root, resume, force, job, repair=repair)
    for remark in padding_only(job.plan):
        warn(remark.message)
    with OutLock(out) as lock:
        summary = _convert_locked(job, out, resume, force, workers, progress)
    if lock.previous:
        summary.notes.append(f"took over {out} from a writer that ended without releasing it "
                             f"({describe(lock.previous)})")
    summary.seconds = time.perf_counter() - t0
    return summary


def _kept_parts(job: Job, out: Path, journaled: dict[str, dict], by_name: dict) -> dict[str, dict]:
    """The journal entries --resume keeps: every rank file of the part still hashes to its journaled
    file and tensor digests, and the part's source tensors, read again, to its journaled source
    digests (the manifest copies all three; a journal edited or torn elsewhere redoes the part)."""
    kept: dict[str, dict] = {}
    candidates = []
    for part in job.parts:
        paths = [part_path(part.role, r, part.index) for r in range(job.plan.tp)]
        # the first rank's entry carries the part's source digests (a journal without them is redone)
        if "sources" in journaled.get(paths[0], {}) and all(p in journaled and part_valid(out, journaled[p])
                                                             for p in paths):
            candidates.append((part, paths))
    keys = [k for part, _ in candidates for k in part_keys(by_name[part.role], part)]
    sources = resumed_sources(job.ckpt, keys)
    for part, paths in candidates:
        want = {k: sources[k] for k in part_keys(by_name[part.role], part)}
        if journaled[paths[0]]["sources"] == want:
            kept.update({p: journaled[p] for p in paths})
        else:
            logger.info("%s part %d: journaled source digests differ from the source; redoing it", part.role,
                        part.index)
    return kept


def _journal_part(journal: int, out: Path, part: Part, files: list[WrittenFile], sources: dict[str, str],
                  summary: Summary) -> dict[str, dict]:
    """Append the journal entries of a part's files just published (rank 0's carries the part's
    source digests) and fsync; the entries by path."""
    entries = {}
    for f in files:
        rel = str(f.path.relative_to(out))
        entries[rel] = {"path": rel, "bytes": f.bytes, "digest": f.digest, "tensors": f.tensor_digests}
        if rel == part_path(part.role, 0, part.index):
            entries[rel]["sources"] = sources
        summary.bytes_written += f.bytes
        summary.files_written += 1
    with naming(out / JOURNAL_REL):
        write_all(journal, "".join(journal_line(e) for e in entries.values()).encode())
        os.fsync(journal)
    return entries


def _repair_locked(job: Job, out: Path, manifest: Manifest, journaled: dict[str, dict], workers: int,
                   progress: bool) -> Summary:
    """--resume on an output whose manifest is this job's: re-check every file against it and write
    again, from the source, only what fails (`repair`). COMPLETE goes first and comes back last, so
    a repair stopped part-way is an unfinished output that the next --resume finishes."""
    tree = Tree(out)
    summary = Summary(out, job.cid)
    planned = planned_files(job)
    left: list[int] = [e["bytes"] for e in planned.values()]  # until the survey says what is damaged
    try:
        rep = survey(out, manifest, job.ckpt.root)
        summary.files_resumed = len(rep.entries) - len(rep.damaged)
        record = read_json(tree, RECORD_REL)
        record_ok = isinstance(record, dict) and record.get("conversion_id") == job.cid
        if rep.nothing and record_ok and complete_problem(out, job.cid) is None:
            removed = remove_partials(out, job)  # the tool's own, left by a stopped run: verify names them
            summary.notes.append(f"nothing to repair: all {len(rep.entries)} rank files and the copies match the "
                                 f"manifest" + (f"; removed {len(removed)} temporary file(s) of a stopped run "
                                                f"({', '.join(removed[:3])}{' ...' if len(removed) > 3 else ''})"
                                                if removed else ""))
            return summary
        todo = rep.parts(job)
        left = [planned[rel]["bytes"] for rel in rep.damaged] + [sum(len(journal_line(planned[rel]))
                                                                   for rel in rep.damaged)]
        left += [manifest.copies[name].bytes for name in rep.copies] + [len(job.cid) + 1]
        if not record_ok:
            left.append(len(record_text(conversion_record(job)).encode()))
        check_room(out, left, partial_bytes(out, job), "run the same command with --resume")
        remove_partials(out, job)  # the tool's own temporaries of a stopped run, not the output
        changed = False

        def begin() -> None:
            """The output's first change, once the source passed the first part's content check: a
            refused MODEL (another checkpoint of the same schema) leaves OUT as it was, COMPLETE kept."""
            nonlocal changed
            if not changed:
                changed = True
                tree.remove(COMPLETE_NAME)
                if not record_ok:  # what --force may delete, listed again
                    tree.write_bytes(RECORD_REL, record_text(conversion_record(job)).encode())
        by_name = {role: {s.name: s for s in ranks[0]} for role, ranks in job.specs.items()}
        sizes = job.source_sizes
        pools = [ThreadPoolExecutor(1) if workers > 1 else None for _ in range(job.plan.tp)]
        bar = byte_bar(sum(p.bytes_per_rank * len(r) for p, r in todo), f"repair tp{job.plan.tp}", progress)
        journal, _ = open_journal(tree)
        try:
            for part, ranks in todo:
                for rank in ranks:
                    tree.make_dirs(rank_dir(part.role, rank))
                rel = part_path(part.role, ranks[0], part.index)
                first = journaled.get(part_path(part.role, 0, part.index), {}).get("sources")

                def check(content: str, sources: dict[str, str], rel: str = rel, first: dict | None = first) -> None:
                    check_content(rel, rep.content[rel], content, sources, first, job.ckpt.root)
                    begin()

                keys = part_keys(by_name[part.role], part)
                digests = ContentDigests({k: sizes[k] for k in keys})
                files, sources = _write_part(job, out, part, bar, pools, digests, ranks, check)
                summary.bytes_read += sum(sizes[k] for k in sources)
                _journal_part(journal, out, part, files, sources, summary)
                logger.info("%s part %d: rewrote rank(s) %s", part.role, part.index, ", ".join(map(str, ranks)))
        finally:
            os.close(journal)
            bar.close()
            for pool in pools:
                if pool is not None:
                    pool.shutdown(wait=True)
        begin()  # only copies or the record to rewrite: no part's check ran
        for name in rep.copies:
            tree.copy_in(job.ckpt.root / name, name)
        tree.write_bytes(COMPLETE_NAME, (job.cid + "\n").encode())
        rewritten = rep.damaged + rep.copies + ([] if record_ok else [RECORD_REL]) + [COMPLETE_NAME]
        summary.notes.append(f"repaired: rewrote {', '.join(rewritten[:5])}{' ...' if len(rewritten) > 5 else ''}; "
                             f"every other file matched the manifest and was kept")
        return summary
    except OSError as e:
        raise _os_fault(e, out, left, max(planned.values(), key=lambda f: f["bytes"])["bytes"]) from None
    finally:
        job.ckpt.close()


def _os_fault(e: OSError, out: Path, left: list[int], largest: int) -> BaseException:
    """A write that ran out of room or hit the file-size limit (`write_failed`: what is still to write),
    or another fault of the machine (`errors.fault`), each ending with --resume; else `e` (a bug)."""
    if e.errno in WRITE_LIMITS:
        return write_failed(e, out, left, largest)
    return fault(e, "convert", "run the same command with --resume (finished files are kept)") or e


def _convert_locked(job: Job, out: Path, resume: bool, force: bool, workers: int, progress: bool) -> Summary:
    tree = Tree(out)
    manifest = reference(tree, job) if resume else None  # a finished output of this job: repair it
    journaled = check_out(out, job, resume, force, repair=manifest is not None)
    if manifest is not None:
        return _repair_locked(job, out, manifest, journaled, workers, progress)
    clearing = plan_clearing(tree) if force else None
    if clearing is not None:
        clearing.refuse_foreign(out)
    summary = Summary(out, job.cid)
    by_name = {role: {s.name: s for s in ranks[0]} for role, ranks in job.specs.items()}
    results = _kept_parts(job, out, journaled, by_name) if journaled else {}
    todo = [p for p in job.parts if part_path(p.role, 0, p.index) not in results]
    summary.files_resumed = len(results)
    # Nothing in OUT has changed yet: check the room first, counting what this run removes.
    planned = planned_files(job)
    record = conversion_record(job)
    given_back = clearing.freed if clearing is not None else 0
    given_back += partial_bytes(out, job)  # the temporary files of a stopped run, removed below
    left = sizes_to_write(job, planned, set(results), record)
    logger.info("room: %s to write, %s free on %s, %s given back by this run", size(sum(left)), size(free_bytes(out)),
                filesystem(out), size(given_back))
    check_room(out, left, given_back, "run the same command" + (" with --resume" if results else ""))
    if clearing is not None:
        clear(tree, clearing)
    tree.remove(COMPLETE_NAME)  # --resume of a finished output whose manifest is gone: not complete until the end
    remove_partials(out, job)
    logger.info("%d part(s) of %d files to write, %d file(s) kept from an earlier run", len(todo), job.plan.tp,
                summary.files_resumed)
    sizes = job.source_sizes
    digests = ContentDigests({k: sizes[k] for part in todo for k in part_keys(by_name[part.role], part)})
    total = sum(p.bytes_per_rank for p in todo) * job.plan.tp
    pools = [ThreadPoolExecutor(1) if workers > 1 else None for _ in range(job.plan.tp)]
    bar = byte_bar(total, f"convert tp{job.plan.tp}", progress)
    unwritten: dict | None = record  # the record, until it is written
    earlier = 0  # the journal's length before this run: what an earlier run recorded
    written: list[str] = []  # rank files this run published
    try:
        tree.write_bytes(RECORD_REL, record_text(record).encode())
        unwritten = None
        for role in job.roles:
            for rank in range(job.plan.tp):
                tree.make_dirs(rank_dir(role, rank))
        journal, earlier = open_journal(tree)
        try:
            for part in todo:
                t_part = time.perf_counter()
                files, sources = _write_part(job, out, part, bar, pools, digests)
                written += [str(f.path.relative_to(out)) for f in files]
                summary.bytes_read += sum(sizes[k] for k in sources)
                results.update(_journal_part(journal, out, part, files, sources, summary))  # only now kept
                logger.info("%s part %d: %d file(s), %s, %.1f s", part.role, part.index, len(files),
                            size(sum(f.bytes for f in files)), time.perf_counter() - t_part)
        finally:
            os.close(journal)
        for name in side_files(job.ckpt.root):
            tree.copy_in(job.ckpt.root / name, name)
        changed = source_changed(job, record)
        if changed:
            raise OutputError(f"{job.ckpt.root / changed}: changed while it was being converted (its size or time "
                              f"differs from when convert started); {out} is not finished: when the checkpoint is "
                              f"complete, run the same command with --force")
        write_manifest(out, build_manifest(job, results, out))
        tree.write_bytes(COMPLETE_NAME, (job.cid + "\n").encode())
    except SourceError:
        # The source itself is bad: no rerun can finish what this run started, so it leaves nothing of its
        # own behind; a resume removes only that, never an earlier run's files, journal or record.
        if earlier or summary.files_resumed:
            for rel in written:
                tree.remove(rel)
            truncate_journal(tree, earlier)
        else:
            clear(tree, plan_clearing(tree))
        raise
    except OSError as e:
        largest = max(entry["bytes"] for entry in planned.values())
        raise _os_fault(e, out, sizes_to_write(job, planned, set(results), unwritten), largest) from None
    finally:
        bar.close()
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        job.ckpt.close()
    return summary
