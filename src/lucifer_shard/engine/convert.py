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
resume, room still needed) is `outstate`; the write loop and what wraps it (`Writing`: the room check and
the faults), which a repair of a finished output (`repair.repair_locked`) shares, is `writeloop`; the
manifest is `manifest_writer`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..errors import CONVERT_RESUME, SAME_COMMAND, OutputError, SourceError
from ..guarded_io import Tree
from ..model.options import Options
from ..model.plan import padding_only
from ..output.manifest import COMPLETE_NAME, part_path, rank_dir
from ..output.outlock import OutLock, describe
from ..output.share import NodeShare
from ..source.checkpoint import is_repo_id
from ..units import size
from .card import write_card
from .diskspace import filesystem, free_bytes
from .feed import DOWNLOAD_REL, SourceFeed
from .job import Job, part_keys, plan_remote, prepare
from .journal import JournalEntry, truncate_journal
from .manifest_writer import build_manifest, write_manifest
from .nodeshare import write_share
from .outstate import (check_out, conversion_record, part_valid, partial_bytes, planned_files, record_text,
                       refuse_download_dir, refuse_resumed, refuse_target, remove_partials, sizes_to_write, source_changed)
from .owned import RECORD_REL, clear, plan_clearing
from .repair import reference, repair_locked
from .resumed import resumed_sources, stamped_sources
from .writeloop import Summary, WriteLoop, Writing, logger, source_digests

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
    plan's refusals too); everything in OUT happens after. From a repo id, config.json is read and
    planned once (`plan_remote`), OUT's refusals made from it before a shard header is asked for, and
    the plan kept for the job; the headers then add only what they decide (`refuse_resumed`). Nothing
    is downloaded before the lock."""
    t0 = time.perf_counter()
    out = Path(out)
    refuse_download_dir(out, download_dir)  # before the source is asked for anything
    planned = plan_remote(model, options, revision) if is_repo_id(model) else None  # config.json alone
    if planned is not None:  # a repo id: OUT's refusals before a shard header is asked for; its rank files
        # wait for the index, which groups them by shard (`job.prepare`): checked under OUT's lock
        refuse_target(out, None, resume, force, None, options, None, node=node)
    job = replace(prepare(model, options, revision, download_dir or out / DOWNLOAD_REL, planned), node=node)
    repair = resume and out.is_dir() and reference(Tree(out), job) is not None  # a finished output of this job
    if planned is None:
        refuse_target(out, job.ckpt.root if job.on_disk else None, resume, force, job, repair=repair)
    else:  # what the headers add to the refusals made above
        refuse_resumed(out, job, resume, force, repair)
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


def _convert_locked(job: Job, out: Path, resume: bool, force: bool, workers: int, progress: bool,
                    download_dir: Path | None, keep_source: bool) -> Summary:
    tree = Tree(out)
    manifest = reference(tree, job) if resume else None  # a finished output of this job: repair it
    journaled = check_out(out, job, resume, force, repair=manifest is not None)
    if manifest is not None:
        return repair_locked(job, out, manifest, journaled, workers, progress, download_dir, keep_source)
    clearing = plan_clearing(tree) if force else None
    if clearing is not None:
        clearing.refuse_foreign(out)
    summary = Summary(out, job.cid)
    planned = planned_files(job)
    record = conversion_record(job)
    results: dict[str, JournalEntry] = {}  # journal entries of the files kept or written
    unwritten: dict | None = record  # the record, until it is written
    with Writing(job, out, planned, lambda: sizes_to_write(job, planned, set(results), unwritten)) as writing:
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
