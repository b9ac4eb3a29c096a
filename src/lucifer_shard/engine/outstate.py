"""OUT between runs: the refusals that keep convert from overwriting what it should not, the
conversion record and journal that `--resume` trusts only as far as the files still hash to their
digests, and the exact bytes still to write (the room convert checks before it changes anything)."""
from __future__ import annotations

import json
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from .. import __version__
from ..errors import CONVERT_AGAIN, SAME_COMMAND, Locked, OutputError, UsageRefused
from ..guarded_io import Refused, Tree, kind, partial_name
from ..model.options import Options
from ..outnames import MANIFEST_NAME, STATE_DIR, strays
from ..output.manifest import CARD_NAME, COMPLETE_NAME, part_path
from ..output.outlock import writer_of
from ..output.share import SHARE_NAME, SHARE_REPAIR, NodeShare, ShareRecord, describe, share_text
from .card import planned_sizes
from .feed import DOWNLOAD_REL
from .job import Job, part_keys
from .journal import JournalEntry, journal_line, read_journal
from .owned import OUTPUT_FILES, RECORD_REL, is_output, plan_clearing, read_json, scan
from .stwriter import hash_file


def check_paths(out: Path, root: Path) -> None:
    """OUT and MODEL must not contain each other (path arithmetic only: nothing in OUT is read)."""
    out_r, root_r = out.resolve(), root.resolve()
    if out_r == root_r or root_r in out_r.parents:
        raise OutputError(f"OUT {out} is inside MODEL {root}; choose a directory outside the checkpoint")
    if out_r in root_r.parents:
        raise OutputError(f"OUT {out} contains MODEL {root}; choose a directory outside the checkpoint")


def refuse_download_dir(out: Path, download_dir: Path | None) -> None:
    """--download-dir must lie outside OUT (by path, links resolved): downloads in OUT or its role and rank
    folders are files convert did not write there, which verify counts as strays and --resume refuses."""
    if download_dir is None:
        return
    out_r, dl_r = Path(out).resolve(), Path(download_dir).resolve()
    if dl_r == out_r or out_r in dl_r.parents:
        raise UsageRefused(f"--download-dir {download_dir}: inside OUT {out}; choose a folder outside OUT, or drop "
                           f"--download-dir (the default, OUT/{DOWNLOAD_REL}, is the conversion's own)")


def refuse_target(out: Path, root: Path | None, resume: bool, force: bool, job: Job | None = None,
                  options: Options | None = None, planned: Iterable[str] | None = (), repair: bool = False,
                  node: NodeShare | None = None) -> None:
    """Every refusal of OUT (and of OUT against MODEL's directory `root`) that convert makes before it
    takes OUT's lock, in convert's words: `plan` runs it as convert's dry run, without a `job` (it
    reads config.json only, so `planned` names the rank files, `options` the settings and `node` the
    ranks). Reads OUT, writes nothing: no lock, no state folder (convert checks again under its lock)."""
    out = Path(out)
    if root is not None:
        check_paths(out, root)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory; choose a directory for OUT")
    holder = writer_of(out)
    if holder is not None:
        raise Locked(f"{out} is locked by another writer ({holder})",
                     remedy=SAME_COMMAND.after("wait for it to finish or stop it"))
    check_out(out, job, resume, force, options, planned, repair, node)
    if force:
        plan_clearing(Tree(out)).refuse_foreign(out)


def check_out(out: Path, job: Job | None, resume: bool, force: bool, options: Options | None = None,
              planned: Iterable[str] | None = (), repair: bool = False, node: NodeShare | None = None
              ) -> dict[str, JournalEntry]:
    """Refuse unsafe targets; returns journal entries usable by --resume (path -> entry). Runs under
    OUT's lock, so the lock file is not counted as content. A link anywhere in OUT, or an entry of
    the wrong type where the conversion writes, is refused by name before anything is read. Without
    a job (plan) a --resume record is held against `options` and the tool version; its source is
    convert's to check. `repair`: OUT's manifest is this job's (`repair.reference`), so it, not the
    conversion record, is the reference: the files rewritten from the source must carry their
    recorded content stamps. `node`: the ranks a node's convert writes (the job's, given a job)."""
    tree = Tree(out)
    if job is not None:
        node, options = job.node, job.options
    _refuse_other_ranks(tree, node, options.tp)
    others = [n for n in tree.entries() if n != STATE_DIR]
    ours = is_output(tree)
    if ours and not force and (job is not None or planned is not None):  # --force names them among what it keeps
        refuse_entries(tree, planned_files(job) if job is not None else dict.fromkeys(planned))
    if force:
        if ours or not others:
            return {}  # convert clears it once the room is checked (`owned.plan_clearing`)
        raise OutputError(f"{out} is not empty and not a lucifer-shard output; --force only replaces outputs of this tool")
    if tree.lstat(COMPLETE_NAME) is not None and not resume:
        raise OutputError(f"{out} already holds a complete conversion; pass --resume to re-check it and rewrite "
                          f"only damaged files, or --force to replace it")
    if not ours:
        if others:
            raise OutputError(f"{out} is not empty and not a lucifer-shard output; choose an empty or new directory")
        return {}
    if not resume:
        raise OutputError(f"{out} holds an unfinished conversion; pass --resume to finish it or --force to restart")
    if repair:
        return _stray_free(tree, job, options, planned, node)
    _check_record(tree, job, options)
    journal = _stray_free(tree, job, options, planned, node)
    return journal if job is not None else {}  # plan: convert's refusal, its journal is convert's to read


def refuse_resumed(out: Path, job: Job, resume: bool, force: bool, repair: bool = False) -> None:
    """A repo id's refusals of OUT that need its headers, after `refuse_target` made every other from
    config.json alone (convert): OUT against a source read in place (the Hugging Face cache), and
    --resume's conversion record against the job's source."""
    out = Path(out)
    if job.on_disk:
        check_paths(out, job.ckpt.root)
    if resume and not force and not repair and out.is_dir() and is_output(Tree(out)):
        _check_record(Tree(out), job, job.options)


def _check_record(tree: Tree, job: Job | None, options: Options) -> None:
    """--resume's conversion record against this run: without a job (plan, or a repo id before its
    headers) its options and the tool version, with one (convert) the job's source and settings."""
    out = tree.root
    record = read_json(tree, RECORD_REL)
    if not isinstance(record, dict) or not isinstance(record.get("source_files"), dict):
        raise OutputError(f"--resume: {tree.path(RECORD_REL)} is missing or not a conversion record; pass --force "
                          f"to restart")
    if job is None:
        now = {"source_fingerprint": record.get("source_fingerprint"), "options": options.to_dict(),
               "tool_version": __version__}
        if any(record.get(k) != v for k, v in now.items()):
            _refuse_other_settings(out, record, now)
        return
    now = conversion_record(job)
    changed = [n for n, st in now["source_files"].items() if record["source_files"].get(n) != st]
    if record.get("conversion_id") == job.cid and changed:
        # Same headers and sizes, other bytes (a re-download or fine-tune): finished parts are stale.
        raise OutputError(f"--resume: source checkpoint changed since {out} was started ({changed[0]} was "
                          f"modified); pass --force to restart")
    if record.get("conversion_id") != job.cid:
        _refuse_other_settings(out, record, now)


def _stray_free(tree: Tree, job: Job | None, options: Options | None, planned: Iterable[str] | None,
                node: NodeShare | None) -> dict[str, JournalEntry]:
    """The journal of an output --resume may finish: nothing in its rank folders but what it writes (a
    node's convert: its ranks' files only, as verify checks a share)."""
    paths = planned_files(job) if job is not None else planned
    if paths is not None:  # None: parts grouped by shards, known once the index is read (the job's refusal)
        written = [rel for rel in paths if node is None or node.holds(rel)]
        refuse_strays(tree, written, job.plan.tp if job else options.tp)
    return read_journal(tree)


def _refuse_other_ranks(tree: Tree, node: NodeShare | None, tp: int) -> None:
    """A share is converted into only by the same node's convert: a share `stage` made (no conversion
    record) never (--force would delete it, --resume fill it with every rank); a conversion's OUT only
    with the ranks its record names (a whole output: every rank), so a node's OUT never gets another
    node's files, nor a whole output a share's, whatever --resume or --force say."""
    record = read_json(tree, RECORD_REL)
    if not isinstance(record, dict):
        if tree.lstat(SHARE_NAME) is not None:
            raise OutputError(f"{tree.root} is a node's share ({SHARE_NAME}, written by stage), not an output "
                              f"convert writes; {SHARE_REPAIR}; convert into a new directory otherwise")
        return
    try:
        made = ShareRecord.parse(record["share"], tp) if record.get("share") is not None else None
    except ValueError as problem:
        raise OutputError(f"{tree.path(RECORD_REL)}: its share ({problem}) is not one convert writes",
                          remedy=CONVERT_AGAIN.after(f"remove {tree.root}")) from None
    want = node.doc(record.get("conversion_id"), tp) if node is not None else None
    if _node_of(made) != _node_of(want):
        raise OutputError(f"{tree.root} holds a conversion of {_ranks_of(made)}, this command converts "
                          f"{_ranks_of(want)}; convert into another OUT, or give the same --ranks or --nnodes/"
                          f"--node-rank as its first run (remove {tree.root} first to replace it)")


def _node_of(doc: ShareRecord | None) -> tuple | None:
    """What tells two shares' command lines apart: ranks, nnodes, node_rank (None: a whole output)."""
    return (doc.ranks, doc.nnodes, doc.node_rank) if doc is not None else None


def _ranks_of(doc: ShareRecord | None) -> str:
    return describe(doc) if doc is not None else "every rank"


def _refuse_other_settings(out: Path, record: dict, now: dict) -> None:
    differs = [label for k, label in (("source_fingerprint", "source"), ("options", "options"),
                                      ("tool_version", "tool version")) if record.get(k) != now.get(k)]
    raise OutputError(f"--resume: {out} was started with other {' and '.join(differs) or 'settings'} "
                      f"({_describe_diff(record, now)}); "
                      f"pass --force to restart")


def refuse_entries(tree: Tree, planned: Iterable[str]) -> None:
    """One line for the first link in OUT, or the first entry of the wrong type where a rank file
    or its folder goes (a resumed run writes there)."""
    entries = scan(tree)
    for rel, st in entries.items():
        if stat.S_ISLNK(st.st_mode):
            raise OutputError(f"{tree.path(rel)}: is a symlink inside OUT; lucifer-shard writes only real files "
                              f"and folders it made, so it does not follow it: remove it, or pass --force")
    for rel in planned:
        for folder in PurePosixPath(rel).parents:
            st = entries.get(str(folder))
            if str(folder) != "." and st is not None and not stat.S_ISDIR(st.st_mode):
                raise OutputError(f"{tree.path(str(folder))}: is {kind(st.st_mode)} where the conversion keeps a "
                                  f"folder of rank files; move it away, or pass --force")
        st = entries.get(rel)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{tree.path(rel)}: is {kind(st.st_mode)} where the conversion writes a rank file; "
                              f"move it away, or pass --force")


def refuse_strays(tree: Tree, planned: Iterable[str], tp: int) -> None:
    """--resume finishes (or repairs) an output only where `verify` will then pass: an entry of a role
    or rank folder that the conversion does not write, other than its own temporary files (which it
    removes), is refused by name with what verify says of it (`outnames`, verify's own rule)."""
    planned = list(planned)
    found = [s for s in strays(tree, planned, {rel.split("/")[0] for rel in planned}, tp) if not s.ours]
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise Refused(f"--resume: {tree.root} holds what this conversion does not write, and verify would fail on "
                      f"the finished output: {', '.join(repr(s.line) for s in found[:3])}{more}",
                      remedy=SAME_COMMAND.after("move it out of OUT (lucifer-shard deletes only what it wrote)"))


def _describe_diff(old: dict, new: dict) -> str:
    if old.get("source_fingerprint") != new.get("source_fingerprint"):
        return "source checkpoint changed"
    a, b = old.get("options"), new["options"]
    a = a if isinstance(a, dict) else {}
    diffs = [f"{_as_flag(k, a.get(k))} -> {_as_flag(k, b.get(k))}" for k in sorted(set(a) | set(b))
             if a.get(k) != b.get(k)]
    return "; ".join(diffs) or f"tool version {old.get('tool_version')} -> {new.get('tool_version')}"


def _as_flag(key: str, value) -> str:
    """An option of the conversion record as the command line spells it (`--max-file-size 16M`)."""
    from ..units import size_flag

    if key == "mtp":
        return "without --no-mtp" if value else "--no-mtp"
    if value is None:
        return f"no --{key.replace('_', '-')}"
    if key == "max_file_bytes":
        return f"--max-file-size {size_flag(int(value))}"
    return f"--{'tp' if key == 'tp' else key.replace('_', '-')} {value}"


def planned_files(job: Job) -> dict[str, JournalEntry]:
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
            # the first rank's entry carries the part's source digests
            sources = {k: zero for k in part_keys(by_name[part.role], part)} if rank == 0 else None
            files[rel] = JournalEntry(rel, sizes[rel], zero, {n: zero for n in part.names}, sources)
    return files


def sizes_to_write(job: Job, planned: dict[str, JournalEntry], done: set[str], record: dict | None) -> list[int]:
    """Sizes of every file still to be written (or appended, for the journal) after the files in
    `done`, and of the conversion record unless it is written (None). A node's convert writes its
    ranks' files only, and journals every rank's (the manifest lists them) and its share record."""
    left = [e for rel, e in planned.items() if rel not in done]
    sizes = [e.bytes for e in left if job.writes(e.path)] + [sum(len(journal_line(e)) for e in left)]
    sizes += list(job.ckpt.side.values())
    sizes += [*planned_sizes(job, planned), len(job.cid) + 1]  # the model card and the manifest, COMPLETE
    if job.node is not None:
        sizes.append(len(share_text(job.node.doc(job.cid, job.plan.tp)).encode()))
    return sizes + ([len(record_text(record).encode())] if record is not None else [])


def record_text(record: dict) -> str:
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def conversion_record(job: Job) -> dict:
    """What --resume and --force trust of an earlier run: its identity, the source files' sizes and
    times, and every file it writes (what --force may delete)."""
    share = {"share": job.node.doc(job.cid, job.plan.tp).to_dict()} if job.node is not None else {}  # whole: as before
    files = [*(rel for rel in planned_files(job) if job.writes(rel)), *job.ckpt.side, CARD_NAME, MANIFEST_NAME,
             *([SHARE_NAME] if share else []), COMPLETE_NAME]
    return {"conversion_id": job.cid, "source_fingerprint": job.ckpt.fingerprint,
            "options": job.options.to_dict(), "tool_version": __version__,
            "source_files": job.ckpt.stats(list(job.ckpt.files)),
            "side_files": job.ckpt.stats(list(job.ckpt.side)), "files": files, **share}


def source_changed(job: Job, record: dict) -> str | None:
    """The first source file (shard, config or tokenizer file) whose size or time differs from the
    record taken before it was read, or None."""
    now = job.ckpt.stats([*job.ckpt.files, *job.ckpt.side])
    then = {**record["source_files"], **record["side_files"]}
    return next((n for n in sorted(set(now) | set(then)) if now.get(n) != then.get(n)), None)


def part_valid(out: Path, entry: JournalEntry) -> bool:
    """A journaled file counts only if it is still a regular file of its size that hashes to its
    recorded file and tensor digests (the manifest copies both)."""
    tree = Tree(out)
    st = tree.lstat(entry.path)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry.bytes:
        return False
    try:
        return hash_file(tree, entry.path) == (entry.digest, entry.tensors)
    except (OSError, ValueError, Refused):
        return False


def _partials(job: Job) -> list[str]:
    """The temporary names of every file the conversion writes."""
    return [partial_name(rel) for rel in [*planned_files(job), *OUTPUT_FILES, RECORD_REL]]


def partial_bytes(out: Path, job: Job) -> int:
    """Bytes the temporary files a stopped run left give back when `remove_partials` deletes them (the
    room check counts them: on a tight disk they are the room the resume needs)."""
    tree = Tree(out)
    sts = [tree.lstat(rel) for rel in _partials(job)]
    return sum(st.st_blocks * 512 for st in sts if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1)


def remove_partials(out: Path, job: Job) -> list[str]:
    """Remove the temporary files a stopped run may have left, by the names the conversion writes;
    the ones that were there."""
    tree = Tree(out)
    return [rel for rel in _partials(job) if tree.remove(rel)]
