"""The kernel cache a share carries (`OUT/kernel-cache/`): the files the compilers vLLM runs at start wrote
(vLLM's cache root with torch.compile's artefacts, Triton, DeepGEMM, TileLang, CuTe-DSL, FlashInfer's JIT),
recorded as the manifest records the weights: a BLAKE3 of every file, the key that says where they are valid,
the record sealed with the manifest's own self-digest (`manifest.seal`). A cache is compiled code: a reader
runs it only when `record_problem` finds the record this tool wrote and every file the one it lists.

    OUT/kernel-cache/record.json    the record (written last: a record half-written is no record)
    OUT/kernel-cache/files/...      the recorded files, never written by a server
    OUT/kernel-cache/run/...        where serve points the compilers (restored from files/, or empty)
    OUT/kernel-cache/run-key.json   the key of the start that filled run/ (`cache record` records it)

Here: the record's format, its check, and writing one (from run/, or carried from another share by stage and
fetch). What a key holds and what serve does with a record: runtime_shim/serving/kernel_cache.py.
"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from ..errors import SAME_COMMAND, MismatchError, OutputError
from ..guarded_io import Refused, Tree, kind, write_all
from .manifest import digest_ok, seal

CACHE_DIR = "kernel-cache"
RECORD_NAME = "record.json"
FILES_DIR = "files"
RUN_DIR = "run"
RUN_KEY = "run-key.json"
RECORD_FORMAT = "lucifer-shard-kernel-cache"
RECORD_VERSION = 1
CHUNK = 16 << 20
RECORD_FIX = "lucifer-shard cache record OUT records the caches a start fills"


def key_digest(key: dict) -> str:
    """The digest of a key (canonical JSON: the same key, the same digest on every host)."""
    return "blake3:" + blake3(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class CachedFile:
    bytes: int
    digest: str


@dataclass(frozen=True)
class Record:
    """A record this tool wrote: its key and every file it lists (relative to files/)."""

    key: dict
    files: dict[str, CachedFile]

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def cache_tree(out: Path | str, create: bool = False) -> Tree:
    """OUT's cache folder (made first, when `create`, through OUT's real directories)."""
    if create:
        Tree(out).make_dirs(CACHE_DIR)
    return Tree(Path(out) / CACHE_DIR)


def walk(tree: Tree, rel: str) -> Iterator[str]:
    """Every regular file below the real directory `rel` of `tree` (paths relative to `rel`), sorted; anything
    else there (a link, a FIFO) is refused by name: a cache's files are plain files, no link is followed."""
    def below(sub: str) -> Iterator[str]:
        for name, st in sorted(tree.entries(f"{rel}/{sub}" if sub else rel).items()):
            path = f"{sub}/{name}" if sub else name
            if stat.S_ISDIR(st.st_mode):
                yield from below(path)
            elif stat.S_ISREG(st.st_mode):
                yield path
            else:
                raise Refused(f"{tree.path(f'{rel}/{path}')}: is {kind(st.st_mode)} in a kernel cache; a cache "
                              f"holds plain files only, move it away")
    if tree.lstat(rel) is not None:
        yield from below("")


def hash_fd(fd: int, sink: Callable[[bytes], None] | None = None) -> CachedFile:
    """The size and BLAKE3 of what `fd` reads to its end (each chunk also given to `sink`)."""
    h, n = blake3(max_threads=blake3.AUTO), 0
    while chunk := os.read(fd, CHUNK):
        h.update(chunk)
        n += len(chunk)
        if sink is not None:
            sink(chunk)
    return CachedFile(n, "blake3:" + h.hexdigest())


def hash_file(tree: Tree, rel: str) -> CachedFile:
    fd = tree.open_read(rel)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def parse_record(data: bytes) -> Record:
    """The record in `data`; ValueError saying why it is not one this tool wrote."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError("not JSON: not a record lucifer-shard wrote") from None
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        raise ValueError("not a kernel-cache record lucifer-shard wrote")
    if doc.get("format_version") != RECORD_VERSION:
        raise ValueError(f"format_version {str(doc.get('format_version'))[:20]}, this tool writes {RECORD_VERSION}")
    if not digest_ok(doc):
        raise ValueError("its self-digest does not match its content: edited after lucifer-shard wrote it")
    files, key = doc.get("files"), doc.get("key")
    if not isinstance(key, dict) or doc.get("key_digest") != key_digest(key) or not isinstance(files, dict):
        raise ValueError("its key or file list is malformed")
    try:
        listed = {rel: CachedFile(int(f["bytes"]), str(f["digest"])) for rel, f in files.items()}
    except (TypeError, KeyError, ValueError):
        raise ValueError("its file list is malformed") from None
    return Record(key, listed)


def record_text(record: Record, tool_version: str) -> bytes:
    doc = {"format": RECORD_FORMAT, "format_version": RECORD_VERSION, "tool_version": tool_version,
           "key": record.key, "key_digest": key_digest(record.key),
           "files": {rel: {"bytes": f.bytes, "digest": f.digest} for rel, f in sorted(record.files.items())}}
    return (json.dumps(seal(doc), indent=1, sort_keys=True) + "\n").encode()


def read_record(tree: Tree) -> Record | None:
    """The record in the cache folder `tree` (None: there is none); OutputError when it is not one this tool
    wrote."""
    if tree.lstat(RECORD_NAME) is None:
        return None
    try:
        return parse_record(tree.read(RECORD_NAME))
    except ValueError as e:
        raise OutputError(f"{tree.path(RECORD_NAME)}: {e}") from None


def tree_problem(tree: Tree, rel: str, record: Record) -> str | None:
    """Why the files below `rel` are not exactly the record's (a file missing, added, or with other bytes), or
    None; every file read in full."""
    found = set(walk(tree, rel))
    if extra := sorted(found - record.files.keys()):
        return f"{tree.path(f'{rel}/{extra[0]}')}: not in the record (added after it was written)"
    if missing := sorted(record.files.keys() - found):
        return f"{tree.path(f'{rel}/{missing[0]}')}: in the record but missing"
    for path, want in sorted(record.files.items()):
        got = hash_file(tree, f"{rel}/{path}")
        if got != want:
            return (f"{tree.path(f'{rel}/{path}')}: not the bytes the record lists ({got.bytes} bytes, blake3 "
                    f"{got.digest[7:23]}...; recorded {want.bytes}, {want.digest[7:23]}...)")
    return None


def record_problem(tree: Tree) -> tuple[Record | None, str | None]:
    """(the record, None) when the cache folder `tree` holds a record this tool wrote and files/ holds exactly its
    files; else (the record or None, why not)."""
    try:
        record = read_record(tree)
    except (OutputError, Refused) as e:
        return None, str(e)
    if record is None:
        return None, f"no record in {tree.root} ({RECORD_FIX})"
    try:
        return record, tree_problem(tree, FILES_DIR, record)
    except Refused as e:
        return record, str(e)


# ---------------------------------------------------------------- writing a record


Source = Callable[[], int]  # opens the file to copy: a read-only descriptor


def publish_record(tree: Tree, key: dict, sources: dict[str, tuple[Source, CachedFile | None]],
                   tool_version: str) -> Record:
    """Write a record of `sources` (rel under files/ -> (opener, the digest it must have, or None: any)) into the
    cache folder `tree`: the old record removed first (no record while files/ changes), each file copied under a
    temporary name and renamed into place once hashed, the files of the old record that the new one lacks
    removed, `record.json` last. A file in files/ that no record of this tool lists is refused, not removed.
    MismatchError when a copied file is not the digest it must have (nothing of it is published)."""
    old = _own_files(tree)
    foreign = sorted(set(walk(tree, FILES_DIR)) - old - sources.keys())
    if foreign:
        raise Refused(f"{tree.path(f'{FILES_DIR}/{foreign[0]}')}: in the kernel cache but in no record "
                      f"lucifer-shard wrote ({len(foreign)} such file(s))", remedy=SAME_COMMAND.after("move it away"))
    tree.remove(RECORD_NAME)
    for rel in sorted(old - sources.keys()):
        tree.remove(f"{FILES_DIR}/{rel}")
    listed = {}
    for rel, (opener, want) in sorted(sources.items()):
        listed[rel] = _copy(tree, f"{FILES_DIR}/{rel}", opener, want)
    record = Record(key, listed)
    tree.write_bytes(RECORD_NAME, record_text(record, tool_version))
    return record


def _own_files(tree: Tree) -> set[str]:
    """The files the record in `tree` lists (none when there is no valid record: then nothing is ours)."""
    try:
        record = read_record(tree)
    except OutputError:
        return set()
    return set(record.files) if record is not None else set()


def _copy(tree: Tree, rel: str, opener: Source, want: CachedFile | None) -> CachedFile:
    fd_in = opener()
    try:
        got: list[CachedFile] = []

        def write(fd: int) -> None:
            got.append(hash_fd(fd_in, lambda chunk: write_all(fd, chunk)))
            if want is not None and got[0] != want:  # raised inside publish: the temporary file is removed
                raise MismatchError(f"{tree.path(rel)}: the bytes read are not the record's ({got[0].bytes} bytes, "
                                    f"blake3 {got[0].digest[7:23]}...; recorded {want.bytes}, "
                                    f"{want.digest[7:23]}...); record the cache again where it was filled")

        tree.publish(rel, write)
    finally:
        os.close(fd_in)
    return got[0]


def restore(tree: Tree, record: Record) -> None:
    """Copy the record's files into the empty run/ of the cache folder `tree`, each checked against the record as
    it is copied (MismatchError: it changed since it was verified)."""
    for rel, want in sorted(record.files.items()):
        src = f"{FILES_DIR}/{rel}"
        _copy(tree, f"{RUN_DIR}/{rel}", lambda src=src: tree.open_read(src), want)


def carry(record: Record | None, open_file: Callable[[str], int], dest: Tree, shown: str, tool_version: str) -> Record:
    """`record` (read from `shown`: another share's cache folder, or a published one) written into the cache folder
    `dest`, each file opened by `open_file(rel)` and checked against the record as it is copied. OutputError when
    there is no record to carry."""
    if record is None:
        raise OutputError(f"{shown}: no recorded kernel cache to carry ({RECORD_FIX} after a start there, then "
                          f"carry it again)")
    return publish_record(dest, record.key, {rel: (lambda rel=rel: open_file(rel), want)
                                             for rel, want in record.files.items()}, tool_version)


def carry_tree(source: Tree, dest: Tree, tool_version: str) -> Record:
    """`carry` from the cache folder of a share or output on disk."""
    return carry(read_record(source), lambda rel: source.open_read(f"{FILES_DIR}/{rel}"), dest, str(source.root),
                 tool_version)
