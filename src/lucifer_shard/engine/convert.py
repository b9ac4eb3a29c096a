"""The conversion engine: stream every source tensor once into per-rank safetensors files.

Order of work: for each role and part (a part has the same tensors on every rank), open one
writer per rank, then for each tensor and chunk assemble all ranks' bytes from one read of the
source, lay out routed experts, and append. A part is journaled once every rank's file is
published; `--resume` skips journaled parts whose files still hash to their recorded digests.
The manifest and COMPLETE are written last. All of it runs under OUT's writer lock (`outlock`),
after the space still needed, known exactly from the plan, was checked against the filesystem's
free space (`diskspace`); a write that runs out of room all the same says how much is left to do.

A node's convert (`--ranks`, `--nnodes/--node-rank`) writes only its ranks' files and hashes the
others for the manifest: OUT is then the share `stage` would make (`nodeshare`).

What is decided before the first byte is `job`; OUT's state between runs (refusals, journal,
resume, room still needed) is `outstate`; the write loop, which a repair (`repair`) shares, is
`writeloop`; the manifest is `manifest_writer`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..errors import CONVERT_RESUME, SAME_COMMAND, OutputError, Remedy, SourceError, fault
from ..guarded_io import Tree
from ..model.config import ModelConfig
from ..model.options import Options
from ..model.plan import padding_only
from ..output.manifest import COMPLETE_NAME, complete_problem, part_path, rank_dir
from ..output.manifest_types import Manifest
from ..output.outlock import OutLock, describe
from ..output.share import NodeShare
from ..source.hub import LinkFault
from ..units import size
from .card import write_card
from .diskspace import WRITE_LIMITS, check_room, filesystem, free_bytes, write_failed
from .feed import DOWNLOAD_REL, SourceFeed
from .job import Job, part_keys, planned_paths, prepare
from .journal import JournalEntry, journal_line, truncate_journal
from .manifest_writer import build_manifest, write_manifest
from .nodeshare import SHARE_NAME, share_problem, write_share
from .outstate import (check_out, conversion_record, part_valid, partial_bytes, planned_files, record_text,
                       refuse_download_dir, refuse_target, remove_partials, sizes_to_write, source_changed)
from .owned import RECORD_REL, clear, plan_clearing, read_json
from .repair import check_content, reference, restore_copy, survey
from .resumed import resumed_sources, stamped_sources
from .writeloop import Summary, WriteLoop, logger, source_digests

def convert(model: str, out: Path, options: Options, resume: bool = False, force: bool = False,
            workers: int = 1, progress: bool = True, revision: str | None = None,
            warn: Callable[[str], None] = logger.warning, download_dir: Path | None = None,
            keep_source: bool = False, node: NodeShare | None = None) -> Summary:
    """Convert MODEL (at `revision`, for a repo id) into OUT; see the module docstring for the order
    and crash safety. `warn` gets the plan's remarks (a rank that holds only padding). A repo id
    whose files are not all in the Hugging Face cache is streamed through `download_dir` (default
    OUT/.lucifer/download), or downloaded whole into the cache first with `keep_source` (`feed`).
    `node`: write only its ranks' files, as `stage` of the whole output would (`nodeshare`).

    Before OUT's writer lock is taken the source is read and OUT only looked at (`refuse_target`,
    plan's refusals too); everything in OUT happens after. From a repo id, OUT's refusals come right
    after config.json, before a shard header is asked for; nothing is downloaded before the lock."""
    t0 = time.perf_counter()
    out = Path(out)
    refuse_download_dir(out, download_dir)  # before the source is asked for anything

    def refuse_out(cfg: ModelConfig) -> None:
        refuse_target(out, None, resume, force, None, options, planned_paths(cfg, options), node=node)
    job = replace(prepare(model, options, revision, download_dir or out / DOWNLOAD_REL, refuse_out), node=node)
    repair = resume and out.is_dir() and reference(Tree(out), job) is not None  # a finished output of this job
    refuse_target(out, job.ckpt.root if job.on_disk else None, resume, force, job, repair=repair)
    for remark in padding_only(job.plan):
        warn(remark.message)
    with OutLock(out) as lock:
        summary = _convert_locked(job, out, resume, force, workers, progress, download_dir, keep_source)
    if lock.previous:
        summary.notes.append(f"took over {out} from a writer that ended without releasing it "
                             f"({describe(lock.previous)})")
    summary.seconds = time.perf_counter() - t0
    return summary


def _kept_parts(job: Job, out: Path, journaled: dict[str, JournalEntry], by_name: dict) -> dict[str, JournalEntry]:
    """The journal entries --resume keeps: every rank file of the part still hashes to its journaled
    file and tensor digests, and the part's source tensors, read again, to its journaled source
    digests (the manifest copies all three; a journal edited or torn elsewhere redoes the part).
    A source on the Hub is not read again (its shards may be gone): its commit and the SHA-256 of
    every shard pin its bytes (`check_out` refused a change), and the journaled source digests must
    give the content stamp the part's files carry (`stamped_sources`)."""
    kept: dict[str, JournalEntry] = {}
    candidates = []
    for part in job.parts:
        paths = [part_path(part.role, r, part.index) for r in range(job.plan.tp)]
        # the first rank's entry carries the part's source digests (a journal without them is redone); a
        # node's convert journals the other ranks' digests, with no file to check (`nodeshare`)
        first = journaled.get(paths[0])
        if first is not None and first.sources is not None and all(p in journaled and (not job.writes(p) or
                                                                                 part_valid(out, journaled[p]))
                                                             for p in paths):
            candidates.append((part, paths))
    keys = [k for part, _ in candidates for k in part_keys(by_name[part.role], part)]
    sources = resumed_sources(job.ckpt, keys) if job.on_disk else stamped_sources(out, journaled, candidates)
    for part, paths in candidates:
        want = {k: sources.get(k) for k in part_keys(by_name[part.role], part)}
        if journaled[paths[0]].sources == want:
            kept.update({p: journaled[p] for p in paths})
        else:
            logger.info("%s part %d: journaled source digests differ from the source; redoing it", part.role,
                        part.index)
    return kept


class _Writing:
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

    def __enter__(self) -> _Writing:
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


def _repair_locked(job: Job, out: Path, manifest: Manifest, journaled: dict[str, JournalEntry], workers: int,
                   progress: bool, download_dir: Path | None, keep_source: bool) -> Summary:
    """--resume on an output whose manifest is this job's: re-check every file against it and write
    again, from the source, only what fails (`repair`). COMPLETE goes first and comes back last, so
    a repair stopped part-way is an unfinished output that the next --resume finishes."""
    tree = Tree(out)
    summary = Summary(out, job.cid)
    planned = planned_files(job)
    left: list[int] = [e.bytes for e in planned.values()]  # until the survey says what is damaged
    with _Writing(job, out, planned, lambda: left) as writing:
        rep = survey(out, manifest, job.ckpt.root if job.on_disk else None, job.written_ranks)
        summary.files_resumed = len(rep.entries) - len(rep.damaged)
        record = read_json(tree, RECORD_REL)
        record_ok = isinstance(record, dict) and record.get("conversion_id") == job.cid
        share_ok = share_problem(tree, job) is None
        if rep.nothing and record_ok and share_ok and complete_problem(out, job.cid) is None:
            removed = remove_partials(out, job)  # the tool's own, left by a stopped run: verify names them
            summary.notes.append(f"nothing to repair: all {len(rep.entries)} rank files and the copies match the "
                                 f"manifest" + (f"; removed {len(removed)} temporary file(s) of a stopped run "
                                                f"({', '.join(removed[:3])}{' ...' if len(removed) > 3 else ''})"
                                                if removed else ""))
            return summary
        ranks_of = {id(part): ranks for part, ranks in rep.parts(job)}
        writing.feed = feed = SourceFeed(job, out, [part for part, _ in rep.parts(job)], download_dir, keep_source)
        todo = [(part, ranks_of[id(part)]) for part in feed.order]  # a streamed source's order, as a conversion's
        left = [planned[rel].bytes for rel in rep.damaged] + [sum(len(journal_line(planned[rel]))
                                                                   for rel in rep.damaged)]
        left += [manifest.copies[name].bytes for name in rep.copies] + [len(job.cid) + 1]
        if not record_ok:
            left.append(len(record_text(conversion_record(job)).encode()))
        writing.check_room(left, partial_bytes(out, job), CONVERT_RESUME)
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
        with WriteLoop(job, out, todo, "repair", workers, progress, summary) as loop:
            feed.start(loop.bar)
            for i, (part, ranks) in enumerate(todo):
                feed.before(i)
                for rank in ranks:
                    tree.make_dirs(rank_dir(part.role, rank))
                rel = part_path(part.role, ranks[0], part.index)
                entry = journaled.get(part_path(part.role, 0, part.index))
                first = entry.sources if entry is not None else None

                def check(content: str, sources: dict[str, str], rel: str = rel, first: dict | None = first) -> None:
                    check_content(rel, rep.content[rel], content, sources, first, job.ckpt.root)
                    begin()

                loop.write(part, ranks, source_digests(job, [part]), check)
                feed.after(i)
                logger.info("%s part %d: rewrote rank(s) %s", part.role, part.index, ", ".join(map(str, ranks)))
        begin()  # only copies or the record to rewrite: no part's check ran
        for name in rep.copies:
            restore_copy(tree, job, manifest, name)
        write_share(tree, job)
        tree.write_bytes(COMPLETE_NAME, (job.cid + "\n").encode())
        rewritten = (rep.damaged + rep.copies + ([] if record_ok else [RECORD_REL]) + ([] if share_ok else [SHARE_NAME])
                     + [COMPLETE_NAME])
        summary.notes.append(f"repaired: rewrote {', '.join(rewritten[:5])}{' ...' if len(rewritten) > 5 else ''}; "
                             f"every other file matched the manifest and was kept")
        feed.finish()
        return summary


def _convert_locked(job: Job, out: Path, resume: bool, force: bool, workers: int, progress: bool,
                    download_dir: Path | None, keep_source: bool) -> Summary:
    tree = Tree(out)
    manifest = reference(tree, job) if resume else None  # a finished output of this job: repair it
    journaled = check_out(out, job, resume, force, repair=manifest is not None)
    if manifest is not None:
        return _repair_locked(job, out, manifest, journaled, workers, progress, download_dir, keep_source)
    clearing = plan_clearing(tree) if force else None
    if clearing is not None:
        clearing.refuse_foreign(out)
    summary = Summary(out, job.cid)
    planned = planned_files(job)
    record = conversion_record(job)
    results: dict[str, JournalEntry] = {}  # journal entries of the files kept or written
    unwritten: dict | None = record  # the record, until it is written
    with _Writing(job, out, planned, lambda: sizes_to_write(job, planned, set(results), unwritten)) as writing:
        by_name = {role: {s.name: s for s in ranks[0]} for role, ranks in job.specs.items()}
        results.update(_kept_parts(job, out, journaled, by_name) if journaled else {})
        writing.feed = feed = SourceFeed(job, out, [p for p in job.parts if part_path(p.role, 0, p.index) not in results],
                                         download_dir, keep_source)
        todo = feed.order
        summary.files_resumed = sum(map(job.writes, results))  # a node's convert journals other ranks too
        # Nothing in OUT has changed yet: check the room first, counting what this run removes.
        given_back = clearing.freed if clearing is not None else 0
        given_back += partial_bytes(out, job)  # the temporary files of a stopped run, removed below
        left = sizes_to_write(job, planned, set(results), record)
        logger.info("room: %s to write, %s free on %s, %s given back by this run", size(sum(left)),
                    size(free_bytes(out)), filesystem(out), size(given_back))
        writing.check_room(left, given_back, CONVERT_RESUME if results else SAME_COMMAND)
        if clearing is not None:
            clear(tree, clearing)
        tree.remove(COMPLETE_NAME)  # --resume of a finished output whose manifest is gone: not complete until the end
        remove_partials(out, job)
        logger.info("%d part(s) of %d files to write, %d file(s) kept from an earlier run", len(todo), job.plan.tp,
                    summary.files_resumed)
        digests = source_digests(job, todo)
        ranks, hashed = job.written_ranks, job.hashed_ranks  # a node's convert hashes the other ranks' files
        earlier = 0  # the journal's length before this run: what an earlier run recorded
        written: list[str] = []  # rank files this run published
        try:
            tree.write_bytes(RECORD_REL, record_text(record).encode())
            unwritten = None
            for role in job.roles:
                for rank in ranks:
                    tree.make_dirs(rank_dir(role, rank))
            with WriteLoop(job, out, [(part, ranks + hashed) for part in todo], "convert", workers, progress,
                           summary) as loop:
                earlier = loop.earlier
                feed.start(loop.bar)
                for i, part in enumerate(todo):
                    t_part = time.perf_counter()
                    feed.before(i)
                    entries = loop.write(part, ranks, digests, hashed=hashed)
                    feed.after(i)
                    written += [rel for rel in entries if job.writes(rel)]
                    results.update(entries)  # only now kept
                    logger.info("%s part %d: %d file(s), %s, %.1f s", part.role, part.index, len(entries),
                                size(sum(e.bytes for e in entries.values())), time.perf_counter() - t_part)
            for name in job.ckpt.side:
                tree.copy_in(job.ckpt.root / name, name)
            write_card(out, job, results)
            changed = source_changed(job, record)
            if changed:
                raise OutputError(f"{job.ckpt.root / changed}: changed while it was being converted (its size or "
                                  f"time differs from when convert started); {out} is not finished: when the "
                                  f"checkpoint is complete, run the same command with --force")
            write_manifest(out, build_manifest(job, results, out))
            write_share(tree, job)
            tree.write_bytes(COMPLETE_NAME, (job.cid + "\n").encode())
            feed.finish()
            summary.notes += [n for n in [feed.summary()] if n]
        except SourceError:
            # The source itself is bad: no rerun can finish what this run started, so it leaves nothing of its
            # own behind; a resume removes only that, never an earlier run's files, journal or record.
            feed.close()  # no download writes into OUT while it is cleared
            if earlier or summary.files_resumed:
                for rel in written:
                    tree.remove(rel)
                truncate_journal(tree, earlier)
            else:
                clear(tree, plan_clearing(tree))
            raise
    return summary
