"""`lucifer-shard stage OUT DEST`: write one node's share of a finished output (output/share.py).

Each file goes in by a hard link when DEST is on OUT's filesystem (no byte copied), otherwise by a
copy that is hashed while it is written and read back before it is published. What is placed is
checked against the manifest, not against OUT's bytes alone: first the one output check every reader
runs (output/output_check), then every file's size and digest (a rank file's over its header and tensor
digests, as verify computes it, and its identity stamp): a link is hashed once made (it is OUT's inode:
a damaged OUT would otherwise publish a damaged share), a copy as it is written. A file already in DEST
is kept only when it verifies against the manifest, and is never replaced by bytes that do not.
Nothing outside DEST is written (guarded_io.Tree; a DEST that is itself a link is refused). Order: the manifest and the copies, the rank
files, `lucifer-share.json`, `COMPLETE` last, so a stage stopped part-way is an unfinished share that
the same command finishes; a file left half-written under its temporary name is removed by the next
run. OUT is held with a shared lock on its writer lock for the whole stage (no convert rewrites it
meanwhile), DEST with an exclusive lock on its directory (one stage at a time).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from blake3 import blake3

from .. import stops
from ..errors import COMMAND_AGAIN, CONVERT_RESUME, SAME_COMMAND, VERIFY, Locked, MismatchError, OutputError, UsageRefused
from ..formats.stheader import Header, HeaderError, read_header
from ..guarded_io import Refused, Tree, naming, write_all
from ..outnames import strays, MANIFEST_NAME, STATE_DIR
from .. import __version__
from ..output.kernel_cache import Record, cache_tree, carry_tree, read_record
from ..output.manifest import COMPLETE_NAME, file_digest, file_metadata, read_manifest_bytes
from ..output.manifest_types import Manifest
from ..output.outlock import reading
from ..output.output_check import check_output
from ..output.share import SHARE_NAME, ShareRecord, describe, read_share, share_doc, share_text
from ..units import duration, size
from .diskspace import check_room

logger = logging.getLogger("lucifer_shard.stage")
CHUNK = 16 << 20


@dataclass
class StageSummary:
    out: str
    dest: str
    share: ShareRecord
    linked: int = 0
    copied: int = 0
    kept: int = 0
    bytes: int = 0  # the share's bytes (rank files, manifest, copies)
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    kernel_cache: dict | None = None  # with --kernel-cache: the carried record's files and bytes

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "files"}

    def lines(self) -> list[str]:
        cache = self.kernel_cache
        return [f"share      {self.dest}: {describe(self.share)} of {self.out}",
                f"files      {self.linked} hard-linked, {self.copied} copied and read back, {self.kept} already there",
                f"size       {size(self.bytes)}",
                *([f"kernels    {cache['files']} files, {size(cache['bytes'])}: the recorded kernel cache, each file "
                   f"checked against its record"] if cache is not None else []),
                f"time       {duration(self.seconds)}"]

    def carried(self, record: Record) -> None:
        self.kernel_cache = {"files": len(record.files), "bytes": record.bytes}


@dataclass(frozen=True)
class Want:
    """A file of a share as the manifest records it."""

    rel: str
    bytes: int
    digest: str  # "blake3:..."
    rank_file: bool  # the digest is over the header and tensor digests (`file_digest`), else over the bytes
    stamp: dict[str, str] | None = None  # a rank file's identity stamp (`file_metadata`), as verify compares it


def share_files(manifest: Manifest, ranks: list[int], manifest_bytes: bytes) -> list[Want]:
    """Every file a share of `ranks` holds but COMPLETE and the share record: the manifest first (a
    DEST stopped part-way is then known as this output's share), the copies, then each role's rank
    files of those ranks."""
    files = [Want(MANIFEST_NAME, len(manifest_bytes), "blake3:" + blake3(manifest_bytes).hexdigest(), False)]
    files += [Want(name, rec.bytes, rec.digest, False) for name, rec in sorted(manifest.copies.items())]
    cid, tp = manifest.conversion_id, manifest.tp_size
    for role in manifest.roles:
        for rank in ranks:  # the manifest lists a rank's files as its parts 0.. in order (`part_path`)
            files += [Want(f.path, f.bytes, f.digest, True, file_metadata(cid, role, rank, part, tp, f.content))
                      for part, f in enumerate(manifest.rank(role, rank).files)]
    return files


def stage(out: Path, dest: Path, ranks: list[int], nnodes: int | None = None, node_rank: int | None = None,
          kernel_cache: bool = False) -> StageSummary:
    """`kernel_cache`: carry OUT's recorded kernel cache too (output/kernel_cache.py), after the share."""
    t0 = time.perf_counter()
    out, dest = Path(out), Path(dest)
    if not out.is_dir():
        raise OutputError(f"{out}: no such output directory")
    if Tree(out).lstat(SHARE_NAME) is not None:
        raise UsageRefused(f"{out} is itself a node's share; stage from the whole output convert wrote")
    _refuse_dest_path(out, dest)
    with reading(out, "stage"):  # no convert rewrites OUT while its files are placed
        manifest = check_output(out).refuse()  # what verify refuses without hashing, stage refuses
        wants = share_files(manifest, ranks, read_manifest_bytes(out))
        if kernel_cache and read_record(cache_tree(out)) is None:  # before DEST changes
            raise OutputError(f"{out}: --kernel-cache, but it holds no recorded kernel cache (lucifer-shard cache "
                              f"record {out} after a start there); stage without --kernel-cache")
        src = Tree(out)
        for want in wants:  # before DEST changes: a damaged OUT is named, not staged
            _check_source(src, want)
        dest.mkdir(parents=True, exist_ok=True)  # DEST itself, as convert makes OUT; below it only through Tree
        with only_writer(dest):
            refuse_dest(dest, manifest, ranks, wants)
            check_share_room(src, Tree(dest), wants)
            summary = _stage_locked(src, Tree(dest), manifest, ranks, wants, nnodes, node_rank, t0)
            if kernel_cache:
                summary.carried(carry_tree(cache_tree(out), cache_tree(dest, create=True), __version__))
                summary.seconds = time.perf_counter() - t0
            return summary


def check_share_room(src: Tree, tree: Tree, wants: list[Want], command: str = "stage") -> None:
    """NoRoom before DEST changes, in convert's words (`diskspace.check_room`), when what this run still writes
    does not fit: every file not already there at its size, as a copy where DEST is on another filesystem than
    OUT (on the same one a hard link costs a file, no bytes). A file there at another size is given back."""
    linked = os.stat(src.root).st_dev == os.stat(tree.root).st_dev
    sizes, given_back = [], 0
    for want in wants:
        there = tree.lstat(want.rel)
        if there is not None and there.st_size == want.bytes:
            continue  # kept when it verifies (else replaced: a rare run that needs its bytes again)
        if there is not None and stat.S_ISREG(there.st_mode) and there.st_nlink == 1:
            given_back += there.st_size
        sizes.append(0 if linked else want.bytes)
    check_room(tree.root, sizes, given_back, COMMAND_AGAIN.at(command=f"the same {command}"),
               what=f"the share's files {command} {'links' if linked else 'copies'}",
               instead=f"{command} into a DEST on another filesystem")


def _stage_locked(src: Tree, tree: Tree, manifest: Manifest, ranks: list[int], wants: list[Want], nnodes: int | None,
                  node_rank: int | None, t0: float) -> StageSummary:
    doc = share_doc(manifest.conversion_id, manifest.tp_size, ranks, nnodes, node_rank)
    summary = StageSummary(str(src.root), str(tree.root), doc)
    with _named(tree.path(COMPLETE_NAME)):
        tree.remove(COMPLETE_NAME)  # a stage that changes DEST is unfinished until it ends
    for want in wants:
        how = _place(src, tree, want)
        setattr(summary, how, getattr(summary, how) + 1)
        summary.bytes += want.bytes
        summary.files.append(want.rel)
        logger.info("%s: %s", want.rel, how)
    with _named(tree.path(SHARE_NAME)):
        tree.write_bytes(SHARE_NAME, share_text(doc).encode())
    with _named(tree.path(COMPLETE_NAME)):
        tree.write_bytes(COMPLETE_NAME, src.read(COMPLETE_NAME))
    summary.seconds = time.perf_counter() - t0
    return summary


@contextmanager
def only_writer(dest: Path, command: str = "stage") -> Iterator[None]:
    """DEST's directory locked for this stage (or fetch) alone (flock on the directory: nothing is written for it)."""
    with Tree(dest).directory() as fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Locked(f"{dest} is being staged by another lucifer-shard stage or fetch",
                         remedy=COMMAND_AGAIN.at(command=f"this {command}").after(
                             "wait for it to finish", f"{command} into another DEST")) from None
        yield  # closing the descriptor drops the lock


def _refuse_dest_path(out: Path, dest: Path) -> None:
    refuse_dest_link(dest)
    if _inside(out, dest):
        raise UsageRefused(f"{dest}: inside the output {out}; stage into a directory of its own")
    if dest.exists() and not dest.is_dir():
        raise OutputError(f"{dest}: a file, not a directory; choose another DEST")


def refuse_dest_link(dest: Path, command: str = "stage") -> None:
    """DEST itself must not be a link: a share is written where DEST names, never where a link points
    (Refused, as a link inside DEST is)."""
    if dest.is_symlink():
        raise Refused(f"{dest}: is a symlink (to {os.readlink(dest)}); lucifer-shard {command} does not follow a "
                      f"link for DEST: name the directory itself, or {command} into a new one")


def _inside(out: Path, dest: Path) -> bool:
    """Whether DEST is OUT or lies below it: by path, and by identity (a folder of DEST's path that is
    OUT's very directory, st_dev and st_ino alike), which a bind mount of OUT (or of a folder above
    it) shows and its path does not."""
    st = os.stat(out)
    here = dest.resolve()
    for folder in (here, *here.parents):
        try:
            seen = os.stat(folder)
        except OSError:  # not made yet: its parent may be OUT
            continue
        if (seen.st_dev, seen.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def refuse_dest(dest: Path, manifest: Manifest, ranks: list[int], wants: list[Want],
                command: str = "stage") -> None:
    """DEST must be empty, or an unfinished or finished share of the same conversion, source content
    and ranks, holding nothing in its role and rank folders but that share's files."""
    tree = Tree(dest)
    entries = tree.entries()
    if not entries:
        return
    if STATE_DIR in entries:
        raise OutputError(f"{dest}: holds a conversion (its {STATE_DIR}/), not a share; choose another DEST")
    there = None
    if MANIFEST_NAME in entries:
        try:
            there = Manifest.load(dest, check_digest=False)
        except OutputError:
            there = None
    if there is None or there.conversion_id != manifest.conversion_id:
        raise OutputError(f"{dest}: not empty and not a share of this output; {command} into a new or empty "
                          f"directory")
    theirs, ours = there.source.content.digest, manifest.source.content.digest
    if theirs != ours:  # same headers and options, other weights: a share of another checkpoint
        raise OutputError(f"{dest}: a share of other weights (source content {str(theirs)[:20]}..., OUT's "
                          f"{str(ours)[:20]}...: another checkpoint with the same headers); {command} into a new or "
                          f"empty directory")
    share = read_share(dest, manifest.conversion_id, manifest.tp_size)
    if share is not None and list(share.ranks) != sorted(ranks):
        raise OutputError(f"{dest}: already a share of {describe(share)}; {command} other ranks into another DEST")
    foreign = [s for s in strays(tree, [w.rel for w in wants if w.rank_file], manifest.roles, manifest.tp_size)
               if not s.ours]
    if foreign:  # verify would fail on it: another rank's file, or one the tool did not write
        st = tree.lstat(foreign[0].rel)
        plain = st is None or stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
        raise (OutputError if plain else Refused)(  # a link or a FIFO is never followed: kind refused
            f"{tree.path(foreign[0].rel)}: {foreign[0].what.split(';')[0]}, not a file of this share "
            f"({len(foreign)} such entr{'y' if len(foreign) == 1 else 'ies'}); move it away or {command} into a new or "
            f"empty directory")


# What else fixes a damaged OUT that stage reads (besides verify naming its problems).
STAGE_REPAIR = f"repair it with {CONVERT_RESUME.command} and stage again"


def _damaged(src: Tree, rel: str, what: str, instead: str = STAGE_REPAIR) -> MismatchError:
    """A file of `src` (OUT, or a published output) that is not what its manifest records: verify names
    every problem of `src` and its fix (OUT's: the same convert with --resume); `instead`: what else would do."""
    return MismatchError(f"{src.path(rel)}: {what}: {src.root} is damaged",
                         remedy=VERIFY.at(out=str(src.root)).after("", instead))


def _check_source(src: Tree, want: Want) -> None:
    """OUT's file is there (its size and copies were the output check's; its digest is checked as it
    is placed)."""
    with _named(src.path(want.rel)):
        if src.lstat(want.rel) is None:
            raise _damaged(src, want.rel, "missing")


def _place(src: Tree, tree: Tree, want: Want) -> str:
    """Put OUT's file into DEST: 'kept' (already there and it verifies), 'linked' (then hashed: a link
    is OUT's very bytes, which only the digest proves) or 'copied'."""
    rel = want.rel
    with _named(tree.path(rel)):
        there = tree.lstat(rel)
        if there is not None:
            if there.st_size == want.bytes and verifies(tree, want):
                return "kept"
            tree.remove(rel)  # under the share's name but not its file: this stage wrote it, or it is stale
    try:
        tree.link_in(src, rel)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise OSError(e.errno, e.strerror, str(src.path(rel)), None, str(tree.path(rel))) from None
    else:
        with _named(src.path(rel)):  # a read the disk refuses names OUT's file: the link is its inode
            problem = file_problem(tree, want)
        if problem is None:
            return "linked"
        tree.remove(rel)  # DEST keeps no damaged link
        raise _damaged(src, rel, problem)
    copy_checked(src, tree, want)
    return "copied"


def copy_checked(src: Tree, tree: Tree, want: Want, instead: str = STAGE_REPAIR) -> None:
    """Publish a copy of `src`'s file in DEST once its bytes are the manifest's (else MismatchError,
    `instead` what else fixes it), then read it back."""
    rel = want.rel
    with _named(tree.path(rel)):
        wrote = _copy(src, tree, want, instead)
        got = _digest(tree, rel)
        if got != wrote:
            tree.remove(rel)
            raise OutputError(f"{tree.path(rel)}: the copy reads back other bytes than {src.path(rel)} (blake3 "
                              f"{got[:16]}... != {wrote[:16]}...)", remedy=SAME_COMMAND.after("check DEST's disk"))


def _copy(src: Tree, tree: Tree, want: Want, instead: str) -> str:
    """Publish a copy of OUT's file in DEST, once the bytes read are the manifest's; their BLAKE3."""
    with _named(src.path(want.rel)):
        fd_in = src.open_read(want.rel)
    try:
        try:
            header = _header(src, want, fd_in)
        except HeaderError as e:
            raise _damaged(src, want.rel, f"unreadable safetensors header ({e.reason})", instead) from None
        if problem := stamp_problem(header, want):
            raise _damaged(src, want.rel, problem, instead)
        digest = ManifestDigest(header)

        def write(fd: int) -> None:
            while True:
                stops.check()
                with naming(src.path(want.rel)):  # a read OUT's disk refuses names OUT's file, not DEST's
                    chunk = os.read(fd_in, CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
                write_all(fd, chunk)
            if digest.pos != want.bytes:  # first: a file's bytes past its tensors are in no digest
                raise _damaged(src, want.rel, size_problem(digest.pos, want.bytes), instead)
            if digest.manifest_digest() != want.digest:  # not published: DEST keeps no damaged copy
                raise _damaged(src, want.rel, f"not the bytes the manifest records (blake3 {want.digest[7:23]}...)",
                               instead)

        tree.publish(want.rel, write)
    finally:
        os.close(fd_in)
    return digest.whole.hexdigest()


def _header(tree: Tree, want: Want, fd: int) -> Header | None:
    """A rank file's header, which tells its tensors apart for the digest (HeaderError: unreadable)."""
    return read_header(tree.path(want.rel), whole=False, fd=fd) if want.rank_file else None


def verifies(tree: Tree, want: Want) -> bool:
    """Whether `tree`'s file is the one the manifest records."""
    return file_problem(tree, want) is None


def file_problem(tree: Tree, want: Want) -> str | None:
    """Why `tree`'s file is not the one the manifest records (its identity stamp, size and digest, read in
    full), or None."""
    fd = tree.open_read(want.rel)
    try:
        try:
            header = _header(tree, want, fd)
        except HeaderError as e:
            return f"unreadable safetensors header ({e.reason})"
        if problem := stamp_problem(header, want):
            return problem
        digest = ManifestDigest(header)
        while chunk := os.read(fd, CHUNK):
            stops.check()
            digest.update(chunk)
        if digest.pos != want.bytes:
            return size_problem(digest.pos, want.bytes)
        if digest.manifest_digest() != want.digest:
            return f"not the bytes the manifest records (blake3 {want.digest[7:23]}...)"
        return None
    finally:
        os.close(fd)


def stamp_problem(header: Header | None, want: Want) -> str | None:
    """Why a rank file's identity stamp is not the one the manifest gives it (its digest covers the header, but
    a re-sealed manifest can record another stamp beside the same digest), or None."""
    for key, value in (want.stamp or {}).items():
        got = header.metadata.get(key) if header is not None else None
        if got != value:
            return f"__metadata__ {key} is {str(got)[:30]!r}..., the manifest gives {value[:30]!r}..."
    return None


def size_problem(got: int, want: int) -> str:
    """A file's size against the manifest's, in verify's words."""
    return f"{got} bytes, the manifest records {want} ({'truncated' if got < want else 'grown'})"


class ManifestDigest:
    """A file's digest as the manifest records it, from its bytes in order: a rank file's over its
    header and each tensor's BLAKE3 in data order (`file_digest`, what verify computes), another
    file's over its bytes; `whole` is the BLAKE3 of every byte (what the read-back compares)."""

    def __init__(self, header: Header | None):
        self.whole = blake3()
        self.pos = 0
        self.head = bytearray()
        self.block = len(header.block) if header is not None else 0
        self.ranges = sorted(((self.block + t.start, self.block + t.end) for t in header.tensors.values())
                             if header is not None else [])
        self.tensors = [blake3() for _ in self.ranges]
        self.next = 0  # the first tensor not yet hashed to its end
        self.rank_file = header is not None

    def update(self, chunk: bytes) -> None:
        self.whole.update(chunk)
        view, lo, hi = memoryview(chunk), self.pos, self.pos + len(chunk)
        if lo < self.block:
            self.head += view[:self.block - lo]
        while self.next < len(self.ranges):
            a, b = self.ranges[self.next]
            if a >= hi:
                break
            if b > lo:
                self.tensors[self.next].update(view[max(a, lo) - lo:min(b, hi) - lo])
            if b > hi:
                break
            self.next += 1
        self.pos = hi

    def manifest_digest(self) -> str:
        if not self.rank_file:
            return "blake3:" + self.whole.hexdigest()
        return "blake3:" + file_digest(bytes(self.head), [h.hexdigest() for h in self.tensors])


@contextmanager
def _named(path: Path) -> Iterator[None]:
    """An OS error inside names `path` in full, saying whether it is OUT's or DEST's file (the guarded
    helpers name only the entry in its directory); one that already names a full path is kept."""
    try:
        yield
    except OSError as e:
        if e.filename is not None and "/" in str(e.filename):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


def _digest(tree: Tree, rel: str) -> str:
    """The BLAKE3 of every byte of `tree`'s `rel`."""
    h = blake3()
    fd = tree.open_read(rel)
    try:
        while chunk := os.read(fd, CHUNK):
            stops.check()
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)
