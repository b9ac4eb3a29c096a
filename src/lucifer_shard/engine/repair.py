"""`convert --resume` on a finished output: what is damaged, measured against its own manifest.

The manifest records every rank file's size and digest (BLAKE3 over the header, which holds the
identity and content stamps, and the tensors' digests) and every copied side file's digest. A
rank file counts as sound when `outstate.part_valid` (the check `--resume` applies to journaled
files) finds it so against its manifest entry; a copy when `copy_problems` (verify's check) has
nothing to say of it. What fails is rewritten from the source, and nothing else is touched.

Conversion is deterministic, so a rewritten file must carry the content stamp its manifest entry
records: that stamp is BLAKE3 over the part's source tensor digests, so a source that is not the
converted one (other bytes under the same headers) is refused by name before the file is published.
`repair_locked` is that run, under OUT's lock, as `convert._convert_locked` is a conversion's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import CONVERT_RESUME, LuciferError, SourceError
from ..guarded_io import Tree
from ..outnames import MANIFEST_NAME
from ..output.manifest import CARD_NAME, COMPLETE_NAME, complete_problem, part_path, rank_dir
from ..output.manifest_types import copy_problems, Manifest
from .feed import SourceFeed
from .job import Job, Part
from .journal import JournalEntry, journal_line
from .manifest_writer import copies
from .nodeshare import SHARE_NAME, share_problem, write_share
from .outstate import conversion_record, part_valid, partial_bytes, planned_files, record_text, remove_partials
from .owned import RECORD_REL, read_json
from .writeloop import Summary, WriteLoop, Writing, logger, source_digests


@dataclass
class Repair:
    """The manifest of a finished output and what of it must be written again."""

    manifest: Manifest
    entries: dict[str, JournalEntry]  # rel -> the rank file's entry as the journal writes it (digests bare hex)
    content: dict[str, str]  # rel -> the content stamp its manifest entry records
    damaged: list[str]  # rank files to rewrite, in manifest order
    copies: list[str]  # side files to copy again (`restore_copy`)

    @property
    def nothing(self) -> bool:
        return not self.damaged and not self.copies

    def parts(self, job: Job) -> list[tuple[Part, list[int]]]:
        """Each part with a damaged file, and the ranks whose file of it is damaged."""
        todo = []
        for part in job.parts:
            ranks = [r for r in range(job.plan.tp) if part_path(part.role, r, part.index) in self.damaged]
            if ranks:
                todo.append((part, ranks))
        return todo


def manifest_parts(manifest: Manifest, job: Job) -> list[Part]:
    """The parts of `manifest`, each with the tensors its rank-0 file holds (every rank's file of a part holds
    the same names) in the order `plan_parts` writes them, the roles in the job's order."""
    parts = []
    for role in job.roles:  # the job's order of roles (the manifest's keys are sorted)
        by_name = {s.name: s for s in job.specs[role][0]}
        rank0 = manifest.rank(role, 0)
        for index, f in enumerate(rank0.files):
            names = sorted(rank0.held(f.path), key=lambda n: (job.options.align > 8
                                                              and by_name[n].nbytes % job.options.align != 0, n))
            parts.append(Part(role, index, names, sum(by_name[n].nbytes for n in names)))
    return parts


def reference(tree: Tree, job: Job) -> Manifest | None:
    """OUT's manifest when it can be the reference of a repair: readable, its self-digest intact and
    its conversion id this job's (same source fingerprint, options and tool version); else None
    (the journal is then the reference, as for any unfinished conversion)."""
    try:
        m = Manifest.parse(tree.read(MANIFEST_NAME), tree.path(MANIFEST_NAME))
    except (FileNotFoundError, LuciferError):
        return None
    return m if m.sealed and m.conversion_id == job.cid else None


def manifest_entries(manifest: Manifest, held: list[int] | None = None
                     ) -> tuple[dict[str, JournalEntry], dict[str, str]]:
    """rel -> its journal entry as the manifest records it (bare hex digests, as `part_valid` takes them), and rel ->
    recorded content stamp, for every rank file the manifest lists (of the `held` ranks, given them)."""
    entries, content = {}, {}
    for role, r, f in manifest.files(held):
        rank = manifest.rank(role, r)
        tensors = {n: t.digest.removeprefix("blake3:") for n, t in rank.tensors.items() if t.file == f.path}
        entries[f.path] = JournalEntry(f.path, f.bytes, f.digest.removeprefix("blake3:"), tensors)
        content[f.path] = f.content
    return entries, content


def survey(out: Path, manifest: Manifest, source_root: Path | None, held: list[int] | None = None) -> Repair:
    """Re-check every file of OUT against `manifest` (one hashing pass over each rank file; a node's
    convert: of its `held` ranks). A damaged copy is refused when the source's own file is not the one
    converted (`source_root` None: a source on the Hub at the recorded commit, whose files are those
    converted by their published identity, and not on disk yet)."""
    entries, content = manifest_entries(manifest, held)
    damaged = [rel for rel, entry in entries.items() if not part_valid(out, entry)]
    bad_copies = sorted({name for name, _ in copy_problems(out, manifest)})
    if bad_copies and source_root is not None:
        now = copies(source_root, follow=True)
        for name in (n for n in bad_copies if n != CARD_NAME):  # the card is written again, not copied
            if now.get(name) != manifest.copies.get(name):
                raise SourceError(f"--resume: {source_root / name} is not the {name} {out} was converted from "
                                  f"(its digest differs from the manifest's copy), so {out / name} cannot be "
                                  f"restored from it; give the converted checkpoint, or rebuild with --force")
    return Repair(manifest, entries, content, damaged, bad_copies)


def check_content(rel: str, want: str, got: str, sources: dict[str, str], journaled: dict[str, str] | None,
                  model: Path) -> None:
    """Refuse a rewritten file whose content stamp is not the one recorded: the source differs."""
    if got == want:
        return
    differ = sorted(k for k in sources if journaled is not None and journaled.get(k) != sources[k])
    which = f" (source tensor(s) {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''})" if differ else ""
    raise SourceError(f"--resume: {model} holds other weights than the checkpoint {rel} was converted from{which}: "
                      f"its content stamp would be {got[7:23]}..., the manifest's is {want[7:23]}...; give the "
                      f"converted checkpoint, or rebuild with --force")


def restore_copy(tree: Tree, job: Job, manifest: Manifest, name: str) -> None:
    """Write a damaged copy again: the model card from the manifest it describes, a side file from the source."""
    if name == CARD_NAME:
        from .card import card_text, job_license

        tree.write_bytes(CARD_NAME, card_text(manifest, job_license(job)).encode())
    else:
        tree.copy_in(job.ckpt.root / name, name)


def repair_locked(job: Job, out: Path, manifest: Manifest, journaled: dict[str, JournalEntry], workers: int,
                   progress: bool, download_dir: Path | None, keep_source: bool) -> Summary:
    """--resume on an output whose manifest is this job's: re-check every file against it and write
    again, from the source, only what fails (`repair`). COMPLETE goes first and comes back last, so
    a repair stopped part-way is an unfinished output that the next --resume finishes."""
    # the parts as the manifest groups them: an output written before parts were grouped by shards keeps its own
    job = replace(job, parts=manifest_parts(manifest, job))
    tree = Tree(out)
    summary = Summary(out, job.cid)
    planned = planned_files(job)
    left: list[int] = [e.bytes for e in planned.values()]  # until the survey says what is damaged
    with Writing(job, out, planned, lambda: left) as writing:
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
