"""`convert --resume` on a finished output: what is damaged, measured against its own manifest.

The manifest records every rank file's size and digest (BLAKE3 over the header, which holds the
identity and content stamps, and the tensors' digests) and every copied side file's digest. A
rank file counts as sound when `outstate.part_valid` (the check `--resume` applies to journaled
files) finds it so against its manifest entry; a copy when `copy_problems` (verify's check) has
nothing to say of it. What fails is rewritten from the source, and nothing else is touched.

Conversion is deterministic, so a rewritten file must carry the content stamp its manifest entry
records: that stamp is BLAKE3 over the part's source tensor digests, so a source that is not the
converted one (other bytes under the same headers) is refused by name before the file is published.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import LuciferError, SourceError
from ..guarded_io import Tree
from ..outnames import MANIFEST_NAME
from ..output.manifest import CARD_NAME, part_path
from ..output.manifest_types import copy_problems, Manifest
from .job import Job, Part
from .journal import JournalEntry
from .manifest_writer import copies
from .outstate import part_valid


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
