"""OUT between runs: the refusals that keep convert from overwriting what it should not, the
conversion record and journal that `--resume` trusts only as far as the files still hash to their
digests, and the exact bytes still to write (the room convert checks before it changes anything)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import __version__
from ..errors import OutputError
from ..spec.manifest import COMPLETE_NAME, MANIFEST_NAME, STATE_DIR, manifest_text, part_path
from ..spec.outlock import LOCK_NAME
from ..spec.source import side_files
from .job import Job, part_keys
from .manifest_writer import build_manifest
from .stwriter import hash_file

JOURNAL = "journal.jsonl"
RECORD = "conversion.json"


def check_paths(out: Path, root: Path) -> None:
    """OUT and MODEL must not contain each other (path arithmetic only: nothing in OUT is read)."""
    out_r, root_r = out.resolve(), root.resolve()
    if out_r == root_r or root_r in out_r.parents:
        raise OutputError(f"OUT {out} is inside MODEL {root}; choose a directory outside the checkpoint")
    if out_r in root_r.parents:
        raise OutputError(f"OUT {out} contains MODEL {root}; choose a directory outside the checkpoint")


def check_out(out: Path, job: Job, resume: bool, force: bool) -> dict[str, dict]:
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
    now = conversion_record(job)
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


def journal_line(entry: dict) -> str:
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
    sizes = [e["bytes"] for e in left] + [sum(len(journal_line(e)) for e in left)]
    sizes += [(job.ckpt.root / n).stat().st_size for n in side_files(job.ckpt.root)]
    sizes += [len(manifest_text(build_manifest(job, planned)).encode()), len(job.cid) + 1]
    return sizes


def clear_out(out: Path) -> None:
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


def conversion_record(job: Job) -> dict:
    stats = {n: [(job.ckpt.root / n).stat().st_size, (job.ckpt.root / n).stat().st_mtime_ns] for n in job.ckpt.files}
    return {"conversion_id": job.cid, "source_fingerprint": job.ckpt.fingerprint,
            "options": job.options.to_dict(), "tool_version": __version__, "source_files": stats}


def part_valid(out: Path, entry: dict) -> bool:
    """A journaled file counts only if it still exists and hashes to its recorded digest."""
    path = out / entry["path"]
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        return False
    try:
        return hash_file(path)[0] == entry["digest"]
    except (OSError, ValueError):
        return False


def remove_partials(out: Path) -> None:
    for p in out.glob("*/rank-*/.*.partial"):
        p.unlink()
    for p in out.glob(".*.partial"):
        p.unlink()
