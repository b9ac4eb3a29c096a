"""The write loop convert and repair share, and the summary of a run.

`WriteLoop` holds what a run needs while it writes parts: one writer pool per rank (with
--workers > 1), the progress bar and the journal, shut down in order however the run ends (an
error, Ctrl-C, SIGTERM). Its `write` streams one part onto the given ranks (and hashes it for the
ranks a node's convert does not write), publishes the files and journals them
(`journal.open_journal`); the caller says which parts, on which ranks, and what a part's content
stamp must be before its files are published (a repair's `check`).

Writing a part, step by step: one writer per rank (`_open_writer`), every tensor's chunks planned
(`_work`, `_placement`), read once and fanned out to the ranks' writers (`_pump`), the part's
source digests (`_sources`) stamped into its files, which are then published; on any error the
part's temporary files are removed (`_abort`), so nothing half-written stays in OUT.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import stops
from ..errors import CONVERT_RESUME, Remedy, fault
from ..guarded_io import Tree, naming, partial_name, write_all
from ..model.layouts import Layout
from ..model.tensorspecs import TensorSpec
from ..output.manifest import CONTENT_PLACEHOLDER, file_metadata, part_content, part_path
from ..source.content import ContentDigests
from ..source.hub import LinkFault
from ..units import byte_bar, duration, rate, size
from .assemble import Assembler, EngineBufferPool, chunks, swap_folded
from .diskspace import WRITE_LIMITS, check_room, write_failed
from .feed import SourceFeed
from .job import Job, Part, part_headers, part_keys
from .journal import JournalEntry, journal_line, open_journal
from .owned import JOURNAL_REL
from .stwriter import StreamHasher, StreamWriter, WrittenFile

# convert's (a repair is convert --resume), named for the command: -v prints "lucifer_shard.convert: ..."
logger = logging.getLogger("lucifer_shard.convert")

Check = Callable[[str, dict[str, str]], None]  # (content stamp, source digests) of a part: raises to refuse it


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


def source_digests(job: Job, parts: list[Part]) -> ContentDigests:
    """The digests of the source tensors `parts` read, to be fed as they are read."""
    sizes = job.source_sizes
    by_name = {role: {s.name: s for s in ranks[0]} for role, ranks in job.specs.items()}
    return ContentDigests({k: sizes[k] for part in parts for k in part_keys(by_name[part.role], part)})


class WriteLoop:
    """The pools, progress bar and journal of one run over `todo` (each part with the ranks it is
    written on), open for a `with` block and shut down when it ends, however it ends: the journal
    closed, the bar closed, every pool's writes waited for. `verb` names the bar."""

    def __init__(self, job: Job, out: Path, todo: list[tuple[Part, list[int]]], verb: str, workers: int,
                 progress: bool, summary: Summary):
        self.job, self.out, self.summary = job, out, summary
        self.todo, self.verb, self.workers, self.progress = todo, verb, workers, progress
        self.earlier = 0  # the journal's length before this run: what an earlier run recorded

    def __enter__(self) -> WriteLoop:
        tp = self.job.plan.tp
        self.sizes = self.job.source_sizes
        self.pools = [ThreadPoolExecutor(1) if self.workers > 1 else None for _ in range(tp)]
        self.bar = byte_bar(sum(p.bytes_per_rank * len(ranks) for p, ranks in self.todo), f"{self.verb} tp{tp}",
                            self.progress)
        try:
            self.journal, self.earlier = open_journal(Tree(self.out))
        except BaseException:
            self._shut_down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            os.close(self.journal)
        finally:  # a stop landing in the close still waits for the pools
            self._shut_down()

    def _shut_down(self) -> None:
        self.bar.close()
        for pool in self.pools:
            if pool is not None:
                pool.shutdown(wait=True)

    def write(self, part: Part, ranks: list[int], digests: ContentDigests,
              check: Check | None = None, hashed: list[int] = ()) -> dict[str, JournalEntry]:
        """Write `part` on `ranks` and hash it on `hashed` (`_write_part`), publish its files and journal
        them all; their journal entries by path."""
        stops.check()
        files, sources = _write_part(self.job, self.out, part, self.bar, self.pools, digests, ranks, check, hashed)
        self.summary.bytes_read += sum(self.sizes[k] for k in sources)
        return _journal_part(self.journal, self.out, part, files, sources, self.summary)


def _journal_part(journal: int, out: Path, part: Part, files: list[WrittenFile], sources: dict[str, str],
                  summary: Summary) -> dict[str, JournalEntry]:
    """Append the journal entries of a part's files just published or only hashed (a node's convert: the
    manifest lists every rank's digests; rank 0's entry carries the part's source digests) and fsync;
    the entries by path."""
    entries = {}
    for f in files:
        rel = str(f.path.relative_to(out))
        first = rel == part_path(part.role, 0, part.index)
        entries[rel] = JournalEntry(rel, f.bytes, f.digest, f.tensor_digests, sources if first else None)
        summary.bytes_written += f.bytes if f.published else 0
        summary.files_written += f.published
    with naming(out / JOURNAL_REL):
        write_all(journal, "".join(journal_line(e) for e in entries.values()).encode())
        os.fsync(journal)
    return entries


# ---------------------------------------------------------------- one part


class _RankSink:
    """One rank's writer (or hasher, `StreamHasher`: a rank this run does not write). Layout + hash +
    write run on a worker thread in submission order (the rank's own thread with --workers > 1,
    otherwise one thread shared by all ranks), so reading and assembling the next chunk overlaps
    writing this one; at most two chunks per rank are in flight. Written chunk buffers go back to
    `buffers`."""

    def __init__(self, writer: StreamHasher, pool: ThreadPoolExecutor | None, buffers=None):
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


def _write_part(job: Job, out: Path, part: Part, bar, pools: list[ThreadPoolExecutor | None],
                digests: ContentDigests, ranks: list[int], check: Check | None = None,
                hashed: list[int] = ()) -> tuple[list[WrittenFile], dict[str, str]]:
    """Write one part's file on each of `ranks` and hash (not write) it on each of `hashed`; its files
    and its source tensors' digests. The files are stamped with those digests (`part_content`), which
    `check(content, sources)` may refuse, before they are published."""
    tree = Tree(out)
    specs_by_name = [{s.name: s for s in rank_specs} for rank_specs in job.specs[part.role]]
    shared = ThreadPoolExecutor(1, thread_name_prefix="lucifer-write") if all(p is None for p in pools) else None
    buffers = EngineBufferPool()
    asm = Assembler(job.ckpt, buffers, digests=digests)
    sinks: dict[int, _RankSink] = {}
    stream = None
    try:
        for rank in sorted([*ranks, *hashed]):
            sinks[rank] = _RankSink(_open_writer(job, tree, part, rank, specs_by_name[rank], rank in ranks),
                                    pools[rank] or shared, buffers)
        # The reader threads run ahead of assembly; the writers run behind it.
        stream = asm.stream(_work(job, part, specs_by_name))
        _pump(stream, sinks, buffers, bar)
        sources = _sources(part, digests, specs_by_name[0])
        content = part_content(sources)
        if check is not None:
            check(content, sources)
        return [sink.writer.close(content) for sink in sinks.values()], sources
    except BaseException:
        _abort(tree, part, ranks, sinks)
        raise
    finally:
        if stream is not None:
            stream.close()  # an early exit: let its queued reads finish before the reader stops
        asm.close()
        if shared is not None:
            shared.shutdown(wait=True)


def _open_writer(job: Job, tree: Tree, part: Part, rank: int, specs_by_name: dict[str, TensorSpec],
                 write: bool = True) -> StreamHasher:
    """The writer (`write`, else the hasher) of rank `rank`'s file of `part`, its header stamped with a
    content placeholder."""
    headers = part_headers(specs_by_name, part, job.layouts)
    meta = file_metadata(job.cid, part.role, rank, part.index, job.plan.tp, CONTENT_PLACEHOLDER)
    rel = part_path(part.role, rank, part.index)
    if not write:
        return StreamHasher(tree.path(rel), headers, meta, align=job.options.align)
    return StreamWriter(tree, rel, headers, meta, align=job.options.align)


def _work(job: Job, part: Part, specs_by_name: list[dict[str, TensorSpec]]) -> list[tuple]:
    """The assembler's work for `part`, in file order: ((name, layout), every rank's specs, chunk range)."""
    work = []
    for name in part.names:
        specs, layout = _placement([by_name[name] for by_name in specs_by_name], job.layouts)
        logger.debug("%s part %d: %s %s%s per rank, layout %s", part.role, part.index, name, specs[0].dtype,
                     list(specs[0].shape), job.layouts[specs[0].expert_tensor].name if layout else "model")
        work.extend(((name, layout), specs, a, b) for a, b in chunks(specs[0]))
    return work


def _placement(specs: list[TensorSpec], layouts: dict[str, Layout]) -> tuple[list[TensorSpec], Layout | None]:
    """Every rank's spec of one tensor and the layout its writer still applies (None: the bytes as
    assembled)."""
    layout = layouts[specs[0].expert_tensor] if specs[0].expert_tensor else None
    if layout is not None and layout.steps[:1] == ("swap_halves",):
        swapped = [swap_folded(s) for s in specs]
        if all(swapped):  # place the halves swapped while assembling: one copy less
            specs = swapped
            layout = Layout(layout.name, layout.steps[1:], layout.version)
    if layout is not None and not layout.steps:
        layout = None
    return specs, layout


def _pump(stream, sinks: dict[int, _RankSink], buffers: EngineBufferPool, bar) -> None:
    """Hand every assembled chunk to its rank's writer (or hasher) and wait for them all; a rank neither
    written nor hashed (a repair: its file is sound) gives its buffer back."""
    for (name, layout), bufs in stream:
        stops.check()  # a stop ends the part here, its temporary files removed (`_abort`)
        for rank, buf in enumerate(bufs):
            if rank in sinks:
                sinks[rank].put(name, buf, layout)
            else:
                buffers.give(buf)
        bar.update(sum(bufs[r].nbytes for r in sinks))
    for sink in sinks.values():
        sink.drain()


def _sources(part: Part, digests: ContentDigests, specs_by_name: dict[str, TensorSpec]) -> dict[str, str]:
    """The digests of every source tensor `part` reads, each of which must have been read whole."""
    keys = part_keys(specs_by_name, part)
    sources = digests.finished(keys)
    if len(sources) != len(keys):
        raise RuntimeError(f"{part.role} part {part.index}: {len(keys) - len(sources)} source tensor(s) "
                           f"not read completely")
    return sources


def _abort(tree: Tree, part: Part, ranks: list[int], sinks: dict[int, _RankSink]) -> None:
    """Stop the part's writers and remove its temporary files."""
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


class Writing:
    """What convert and a repair share around their writes, one path for both: the room check (OUT's
    filesystem, then the feed's download room) and the fault mapping on the way out: a write that ran
    out of room or hit the file-size limit (`write_failed`: what is still to write, `left()`, and the
    largest planned file), or another fault of the machine (`errors.fault`), each ending with
    --resume; any other exit leaves at once without waiting for the downloader. The feed and the
    source are closed whatever happens."""

    def __init__(self, job: Job, out: Path, planned: dict[str, JournalEntry], left: Callable[[], list[int]]):
        self.job, self.out, self.planned, self.left = job, out, planned, left
        self.feed: SourceFeed | None = None  # set once the parts to write are known

    def check_room(self, left: list[int], given_back: int, then: Remedy) -> None:
        check_room(self.out, left, given_back, then)
        self.feed.check_room(left, given_back, then)

    def _fault(self, err: OSError) -> BaseException:
        if err.errno in WRITE_LIMITS:
            return write_failed(err, self.out, self.left(), max(f.bytes for f in self.planned.values()))
        return fault(err, "convert", CONVERT_RESUME) or err

    def __enter__(self) -> Writing:
        return self

    def __exit__(self, kind, err, tb) -> None:
        try:
            if isinstance(err, OSError):
                raise self._fault(err) from None
            if isinstance(err, LinkFault):  # OUT holds this run's state now: the next run continues it
                raise err.then(CONVERT_RESUME) from None
            if err is not None and self.feed is not None:
                self.feed.close(wait=False)  # Ctrl-C, SIGTERM, a refused source: leave now
        finally:
            if self.feed is not None:
                self.feed.close()
            self.job.ckpt.close()
