"""OUT's journal (`.lucifer/journal.jsonl`): one line per rank file published or only hashed, which
`--resume` trusts only as far as the file still hashes to it. `JournalEntry` is the line's one
declaration (formats/records.py) and `read_journal` its one reader."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..formats.records import fld, from_doc, schema_of, to_doc
from ..formats.schema import Int, MapOf, Str, check
from ..guarded_io import Tree, naming
from .owned import JOURNAL_REL, RANK_FILE

_HEX64 = Str(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class JournalEntry:
    """A rank file as written: its size, file digest and tensor digests (hex BLAKE3, what the manifest
    copies); rank 0's file of a part carries the part's source tensor digests too."""

    path: str = fld(Str(RANK_FILE.pattern))  # only a rank file's name: a journal cannot send a reader elsewhere
    bytes: int = fld(Int())
    digest: str = fld(_HEX64)
    tensors: dict[str, str] = fld(MapOf(_HEX64))
    sources: dict[str, str] | None = fld(MapOf(_HEX64), optional=True)


def journal_line(entry: JournalEntry) -> str:
    return json.dumps(to_doc(entry), sort_keys=True) + "\n"


def read_journal(tree: Tree) -> dict[str, JournalEntry]:
    """Journal entries by path; a line torn by a crash (or not an entry) is skipped: that part is redone."""
    entries = {}
    try:
        text = tree.read(JOURNAL_REL).decode(errors="replace")
    except FileNotFoundError:
        return entries
    for line in text.splitlines():
        try:
            doc = json.loads(line)
            check(schema_of(JournalEntry), doc)
        except (ValueError, RecursionError):  # SchemaError is a ValueError
            continue
        entry = from_doc(JournalEntry, doc)
        entries[entry.path] = entry
    return entries


def open_journal(tree: Tree) -> tuple[int, int]:
    """The journal opened for appending, and its length: a line torn by a crash or a full disk at its
    end is cut off first (its part is redone), so that what is appended starts a line of its own."""
    fd = tree.open_own(JOURNAL_REL, os.O_WRONLY | os.O_APPEND)
    try:
        text = tree.read(JOURNAL_REL)
        whole = text.rfind(b"\n") + 1
        if whole < len(text):
            with naming(tree.path(JOURNAL_REL)):
                os.ftruncate(fd, whole)
        return fd, whole
    except BaseException:
        os.close(fd)
        raise


def truncate_journal(tree: Tree, length: int) -> None:
    """Cut the journal back to `length` bytes (what it held before this run appended)."""
    fd = tree.open_own(JOURNAL_REL, os.O_WRONLY)
    try:
        with naming(tree.path(JOURNAL_REL)):
            os.ftruncate(fd, length)
            os.fsync(fd)
    finally:
        os.close(fd)
