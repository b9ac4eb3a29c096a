"""What in OUT this tool wrote, and removing exactly that (`--force`, and a source found bad mid-run).

The conversion record (`.lucifer/conversion.json`), written before the first rank file, lists every
file the conversion writes; the manifest and the journal list rank files too. Those files (regular
files only, and their `.partial` temporaries), the state files and the folders holding them are
the tool's. Anything else in OUT (a user's file, a symlink, a FIFO, a mounted filesystem, a listed
name that is a directory) is not, and `--force` refuses to run while it is there, naming it. serve's
kernel caches (`kernel-cache/`: compiled code, recorded apart from the conversion) are neither: `--force`
keeps them, and a start whose key no longer matches the new conversion starts cold beside them.

Clearing deletes COMPLETE first and the record last, so a clearing that stops half-way (EPERM on
an immutable file, SIGKILL) leaves an OUT whose record still lists what is left: the same
`--force` finishes it. Only files with a single link give their blocks back, so the room check
counts only those (a hard link elsewhere keeps the data on the disk).
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ..errors import SAME_COMMAND, OutputError
from ..guarded_io import Refused, Tree, kind, mount_points, partial_name
from ..outnames import MANIFEST_NAME, STATE_DIR, SIDE_FILES
from ..output.kernel_cache import CACHE_DIR
from ..output.manifest import CARD_NAME, COMPLETE_NAME, RECORD_REL
from ..output.outlock import LOCK_NAME
from ..output.share import SHARE_NAME

JOURNAL = "journal.jsonl"
RECORD = RECORD_REL.removeprefix(f"{STATE_DIR}/")
JOURNAL_REL = f"{STATE_DIR}/{JOURNAL}"
LOCK_REL = f"{STATE_DIR}/{LOCK_NAME}"
RANK_FILE = re.compile(r"(target|draft)/rank-\d+/part-\d{5}\.safetensors")
# A streamed conversion's default download folder (engine/feed.py).
DOWNLOAD_DIR = re.escape(STATE_DIR) + r"/download"
OUR_DIR = re.compile(r"(target|draft)(/rank-\d+)?|" + re.escape(STATE_DIR) + "|" + DOWNLOAD_DIR)
STATE_FILE = re.compile(re.escape(STATE_DIR) + r"/(" + "|".join(map(re.escape, (RECORD, JOURNAL))) +
                        r"|internal-error-[0-9-]+\.log)|" + DOWNLOAD_DIR + r"/[^/]+")
OUTPUT_FILES = (*SIDE_FILES, CARD_NAME, MANIFEST_NAME, SHARE_NAME, COMPLETE_NAME)  # the share record: a node's convert
SHOWN = 5  # foreign entries named in a refusal


def is_output_name(rel: object) -> bool:
    """Whether `rel` is a name a conversion writes (a rank file, a copied side file, the card, manifest, COMPLETE)."""
    return isinstance(rel, str) and (rel in OUTPUT_FILES or RANK_FILE.fullmatch(rel) is not None)


def mounted_below(tree: Tree) -> set[str]:
    """rel of every mount point inside OUT: a bind mount of the same filesystem has the same
    st_dev, so the kernel's mount table is asked, not st_dev alone."""
    root = os.path.realpath(tree.root)
    dev = os.stat(root).st_dev
    found = {os.path.relpath(p, root) for p in mount_points() if p.startswith(root.rstrip("/") + "/")}
    for rel, st in tree.entries().items():  # and what st_dev shows where /proc is not mounted
        if stat.S_ISDIR(st.st_mode) and st.st_dev != dev:
            found.add(rel)
    return found


def scan(tree: Tree) -> dict[str, os.stat_result]:
    """rel -> lstat of everything under OUT, parents first; links, other filesystems and foreign
    folders are listed but not entered."""
    found: dict[str, os.stat_result] = {}
    mounts = mounted_below(tree)

    def walk(rel: str) -> None:
        for name, st in sorted(tree.entries(rel).items()):
            sub = f"{rel}/{name}" if rel else name
            found[sub] = st
            if stat.S_ISDIR(st.st_mode) and sub not in mounts and OUR_DIR.fullmatch(sub):
                walk(sub)

    walk("")
    return found


def read_json(tree: Tree, rel: str) -> object:
    """The JSON document at `rel`, or None when it is missing or not readable JSON (a refusal of
    its type, a FIFO say, is raised: it must not be read)."""
    try:
        return json.loads(tree.read(rel))
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError):
        return None


def _dicts(value: object, key: str) -> list:
    got = value.get(key) if isinstance(value, dict) else None
    return got if isinstance(got, list) else list(got.values()) if isinstance(got, dict) else []


def listed(tree: Tree) -> set[str]:
    """The output files that OUT's record, manifest and journal list (only names a conversion writes;
    anything else they hold, of any type, is ignored)."""
    names: list[object] = []
    record = read_json(tree, RECORD_REL)
    if isinstance(record, dict) and isinstance(record.get("files"), list):
        names += record["files"]
    manifest = read_json(tree, MANIFEST_NAME)
    if isinstance(manifest, dict):
        names.append(MANIFEST_NAME)
        for role in _dicts(manifest, "roles"):
            for rank in _dicts(role, "ranks"):
                names += [f.get("path") for f in _dicts(rank, "files") if isinstance(f, dict)]
        source = manifest.get("source")
        if isinstance(source, dict) and isinstance(source.get("side_files"), list):
            names += source["side_files"]
    try:
        lines = tree.read(JOURNAL_REL).splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(entry, dict):
            names.append(entry.get("path"))
    return {n for n in names if is_output_name(n)}


def is_output(tree: Tree) -> bool:
    """Whether OUT holds (the start of) a conversion of this tool: a record or manifest that lists files."""
    return bool(listed(tree)) or isinstance(read_json(tree, RECORD_REL), dict)


@dataclass
class Clearing:
    """What `--force` deletes (in order), the folders it then removes, and what it leaves alone."""

    files: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # "rel (what it is)"
    freed: int = 0  # bytes the deletions give back

    def refuse_foreign(self, out: object) -> None:
        if self.foreign:
            more = f" and {len(self.foreign) - SHOWN} more" if len(self.foreign) > SHOWN else ""
            raise OutputError(f"--force: {out} holds what this tool did not write, so it deletes nothing: "
                              f"{', '.join(self.foreign[:SHOWN])}{more}",
                              remedy=SAME_COMMAND.after("move them out of OUT", "choose another OUT"))


def _order(rel: str) -> tuple:
    """COMPLETE first (no reader sees a complete output any more), the record last (until it goes,
    a stopped clearing is still recognised as this tool's output)."""
    return (rel != COMPLETE_NAME, rel == RECORD_REL, rel)


def plan_clearing(tree: Tree) -> Clearing:
    """Sort OUT's entries into the tool's (to delete) and the rest (see the module docstring)."""
    entries = scan(tree)
    names = listed(tree)
    ours = names | {partial_name(n) for n in names} | {partial_name(RECORD_REL)}
    mounts = mounted_below(tree)
    plan = Clearing()
    foreign: set[str] = set()
    for rel, st in entries.items():
        if any(str(p) in foreign for p in PurePosixPath(rel).parents):
            continue  # inside something foreign: the folder is named already
        if rel == LOCK_REL and stat.S_ISREG(st.st_mode):
            continue  # held by this process
        if rel == CACHE_DIR or rel.startswith(f"{CACHE_DIR}/"):
            continue  # serve's kernel caches: kept (module docstring)
        if rel in mounts:
            plan.foreign.append(f"{rel} (another filesystem mounted there)")
            foreign.add(rel)
            continue
        if stat.S_ISDIR(st.st_mode) and OUR_DIR.fullmatch(rel):
            if rel != STATE_DIR:  # it holds the lock
                plan.dirs.append(rel)
            continue
        if stat.S_ISREG(st.st_mode) and (rel in ours or STATE_FILE.fullmatch(rel)):
            plan.files.append(rel)
            if st.st_nlink == 1:
                plan.freed += st.st_blocks * 512
            continue
        what = kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else "not listed by its conversion"
        plan.foreign.append(f"{rel} ({what})")
        foreign.add(rel)
    plan.files.sort(key=_order)
    plan.dirs.sort(key=lambda d: (-d.count("/"), d))  # deepest first
    return plan


def clear(tree: Tree, plan: Clearing) -> None:
    """Delete the plan's files, then its folders once empty; a deletion that fails stops it with
    one line (OUT is left for the same command to finish, see the module docstring)."""
    for i, rel in enumerate(plan.files):
        try:
            tree.remove(rel)
        except (OSError, Refused) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise OutputError(f"{tree.path(rel)}: cannot delete it ({why}); clearing stopped after {i} of "
                              f"{len(plan.files)} files and can be finished",
                              remedy=SAME_COMMAND.after("make it deletable (e.g. chattr -i, or fix its folder's "
                                                        "permissions)")) from None
    for rel in plan.dirs:
        tree.remove_dir(rel)
