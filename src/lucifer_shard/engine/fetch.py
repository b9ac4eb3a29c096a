"""`lucifer-shard fetch SOURCE DEST`: one node's share of a published output, from the Hub or from a
directory, every byte checked against the output's manifest before it is published in DEST.

SOURCE is a repo id holding an OUT uploaded without `.lucifer/` (at `--revision`, resolved once to the
commit every file then comes from), or a directory holding one (a mount, NFS, a copy). The manifest is
read first; the files are stage's (`stage.share_files`: the manifest, the copies, the rank files of the
node's ranks, in that order), then `lucifer-share.json` and `COMPLETE` last, so DEST ends byte-identical
to what `stage OUT DEST` writes for the same ranks, and a fetch stopped part-way is an unfinished share
that the same command finishes (a file already in DEST that verifies is kept, as stage keeps it).

Checks: the one output check every reader runs (output/output_check), on a directory SOURCE before DEST
changes and on DEST's share before COMPLETE is written; then, reused from stage (its `ManifestDigest`,
`verifies`, `copy_checked`), each file's size and a rank file's identity stamp and digest over its header and
tensor digests, another file's BLAKE3, all as the manifest records them; DEST that is a link is refused, as
stage refuses it. From the Hub, also the SHA-256 the Hub publishes for each LFS file, because
huggingface_hub checks only the size of what it downloads (file_download.py `http_get`, 2.4.0: its one check after the body is "Consistency check
failed: file should be of size ..."), so a file whose bytes changed on the way would otherwise pass to
the manifest check with the wrong fix.

Where the Hub's rank files land: DEST/.lucifer-fetch/<role>/rank-<r>/<part>, on DEST's own filesystem,
each continued by the next run with a Range request from the bytes already there (`source.hub.download_resumed`,
which streamed conversions share); a file reaches its name in DEST only by a hard link made after both checks
passed; nothing goes through the Hugging Face cache, so a 59 GiB Flash share is on the disk once, not twice.
The small files (manifest, COMPLETE, config and tokenizer files) come through `hf_hub_download` and its cache,
read whole and checked before they are written: the manifest is needed before DEST is touched, and
`--dry-run` writes nothing to DEST.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from blake3 import blake3

from .. import __version__
from .. import stops
from ..errors import FETCH_AGAIN, SAME_COMMAND, MismatchError, OutputError, UsageRefused
from ..formats.stheader import HeaderError, read_header
from ..guarded_io import JSON_LIMIT, Tree, open_regular, read_regular
from ..outnames import MANIFEST_NAME
from ..output.kernel_cache import (CACHE_DIR, FILES_DIR, RECORD_NAME, Record, cache_tree, carry, parse_record,
                                   read_record)
from ..output.manifest import COMPLETE_NAME
from ..output.manifest_types import Manifest
from ..output.output_check import check_output
from ..output.share import SHARE_NAME, share_doc, share_text
from ..source.hub import LinkFault, download_resumed, link_fault
from ..units import byte_bar
from .stage import (CHUNK, ManifestDigest, StageSummary, Want, copy_checked, only_writer, refuse_dest, refuse_dest_link,
                    share_files, size_problem, stamp_problem, verifies)

STAGING = ".lucifer-fetch"  # DEST's download area (the Hub route), removed once the share is complete
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
REPUBLISH = ("the published output is not the one its manifest describes: republish it from an OUT that verify "
             "passes, or fetch from another copy")


@dataclass(frozen=True)
class Published:
    """A published output: a directory (`root`), or a repo at one commit with the SHA-256 the Hub
    publishes for each of its LFS files."""

    shown: str
    root: Path | None = None
    repo: str | None = None
    commit: str | None = None
    sha256: dict[str, str] = field(default_factory=dict)

    def name(self, rel: str) -> str:
        """`rel` as the user finds it: a path, or repo@commit:rel."""
        return str(self.root / rel) if self.root is not None else f"{self.shown}:{rel}"

    def hf_download(self, wants: list[Want], dest: Path) -> str:
        """The `hf download` line that brings the same files (a rank folder by pattern: it holds only its
        rank's files), without the checks against the manifest and without the share record."""
        names = [w.rel for w in wants if not w.rank_file] + [COMPLETE_NAME]
        names += dict.fromkeys(f"{PurePosixPath(w.rel).parent}/*" for w in wants if w.rank_file)
        include = " ".join(f'--include "{n}"' for n in names)
        return f"hf download {self.repo} --revision {self.commit} {include} --local-dir {dest}"


def locate(source: str, revision: str | None) -> Published:
    """SOURCE as a directory or a repo at a commit (`--revision` resolved now: one commit for every file)."""
    path = Path(source)
    if path.is_dir():
        if revision is not None:
            raise UsageRefused(f"--revision applies only to a repo id, and {source} is a directory; drop --revision")
        return Published(str(path), root=path)
    if path.exists() or source.startswith((".", "/", "~")) or not REPO_ID.fullmatch(source):
        raise OutputError(f"{source}: not a directory holding a lucifer-shard output, nor a repo id owner/name")
    return _resolve(source, revision)


def _resolve(repo: str, revision: str | None) -> Published:
    import httpx2
    from huggingface_hub import HfApi  # only for a repo id
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    at = revision or "main"
    try:
        with _link_faults(f"{repo} at {at}: the file list"):
            info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except RevisionNotFoundError:
        raise OutputError(f"{repo}: no revision {at} on the Hub; pass a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise OutputError(f"{repo}: no such model repo on the Hub (or it is private: log in with `hf auth login`)") \
            from None
    except (HfHubHTTPError, OSError, ValueError, httpx2.TransportError) as e:
        raise OutputError(f"{repo}: cannot resolve {at} on the Hub ({type(e).__name__}: {e})",
                          remedy=SAME_COMMAND.after("check the network and HF_ENDPOINT")) from None
    sha256 = {s.rfilename: s.lfs.sha256 for s in info.siblings or () if s.lfs is not None}
    return Published(f"{repo}@{info.sha}", repo=repo, commit=info.sha, sha256=sha256)


def read_small(pub: Published, rel: str) -> bytes:
    """A small file of the output (manifest, COMPLETE, a copy), whole; OutputError when it is not there."""
    if pub.root is not None:
        try:
            return Tree(pub.root).read(rel, JSON_LIMIT)
        except FileNotFoundError:
            raise OutputError(f"{pub.name(rel)}: missing; {pub.root} does not hold a finished lucifer-shard output "
                              f"(convert writes {MANIFEST_NAME} and {COMPLETE_NAME} last)") from None
    return read_regular(_download(pub, rel), JSON_LIMIT, follow=True)  # a link into the cache's blobs


def _download(pub: Published, rel: str) -> str:
    """`rel` of the pinned commit through `hf_hub_download` and its cache: its path there."""
    from huggingface_hub import hf_hub_download

    with _hub_errors(pub, rel):
        return hf_hub_download(pub.repo, rel, revision=pub.commit)


@contextmanager
def _link_faults(where: str) -> Iterator[None]:
    """A network failure inside as its one line (kind environment): nothing of DEST is lost, and the same
    fetch continues (a rank file from the bytes kept: `download_resumed` names them)."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        yield
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError, httpx2.TransportError) as e:
        link = link_fault(e, where, "nothing in DEST is lost", FETCH_AGAIN)
        if link is None:
            raise
        raise link from None


@contextmanager
def _hub_errors(pub: Published, rel: str) -> Iterator[None]:
    """huggingface_hub's failures for `rel` as one line with the fix."""
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        with _link_faults(pub.name(rel)):
            yield
    except EntryNotFoundError:
        raise OutputError(f"{pub.name(rel)}: not in the repo; it does not hold a finished lucifer-shard output "
                          f"(publish the whole OUT, without .lucifer/: docs/output-format.md)") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise OutputError(f"{pub.name(rel)}: download failed ({type(e).__name__}: {' '.join(str(e).split())})",
                          remedy=FETCH_AGAIN) from None


def load_manifest(pub: Published) -> tuple[Manifest, bytes]:
    """The output's manifest, checked as `Manifest.load` checks it (format, fields, layout, self-digest)."""
    data = read_small(pub, MANIFEST_NAME)
    manifest = Manifest.parse(data, pub.name(MANIFEST_NAME))
    if not manifest.sealed:
        raise OutputError(f"{pub.name(MANIFEST_NAME)}: manifest_digest does not match its content: the manifest "
                          f"was edited after conversion; {REPUBLISH}")
    return manifest, data


def complete_bytes(pub: Published, manifest: Manifest) -> bytes:
    """The output's COMPLETE, which must hold the manifest's conversion id (a finished output)."""
    data = read_small(pub, COMPLETE_NAME)
    if data.decode("utf-8", "replace").strip() != manifest.conversion_id:
        raise OutputError(f"{pub.name(COMPLETE_NAME)}: does not hold the manifest's conversion id "
                          f"{manifest.conversion_id[:16]}...: not a finished output; {REPUBLISH}")
    return data


@dataclass
class FetchSummary(StageSummary):
    downloaded: int = 0  # files brought from the Hub (copied: from a directory)

    def lines(self) -> list[str]:
        lines = super().lines()
        lines[1] = (f"files      {self.downloaded} downloaded, {self.copied} copied, {self.kept} already there; "
                    f"each checked against the manifest")
        return lines


def fetch(pub: Published, dest: Path, manifest: Manifest, manifest_bytes: bytes, ranks: list[int],
          nnodes: int | None = None, node_rank: int | None = None, progress: bool = False,
          check_config: Callable[[Path], None] | None = None, kernel_cache: bool = False) -> FetchSummary:
    """Bring the share of `ranks` from `pub` into DEST (see the module docstring). `check_config(dest)`
    runs once the manifest and the copies are in DEST, before any rank file (the rule-table check,
    which needs config.json). `kernel_cache`: the published output's recorded kernel cache too, after the
    share, each file checked against its record (output/kernel_cache.py)."""
    t0 = time.perf_counter()
    dest = Path(dest)
    refuse_dest_link(dest, "fetch")
    if dest.exists() and not dest.is_dir():
        raise OutputError(f"{dest}: a file, not a directory; choose another DEST")
    if pub.root is not None and (dest.resolve() == pub.root.resolve() or pub.root.resolve() in dest.resolve().parents):
        raise UsageRefused(f"{dest}: inside SOURCE {pub.root}; fetch into a directory of its own")
    complete = complete_bytes(pub, manifest)
    if pub.root is not None:  # what verify refuses without hashing, fetch refuses before DEST changes (as stage)
        check_output(pub.root, manifest).refuse()
    wants = share_files(manifest, ranks, manifest_bytes)
    record = published_record(pub) if kernel_cache else None  # refused before DEST changes
    dest.mkdir(parents=True, exist_ok=True)  # DEST itself; below it only through Tree
    with only_writer(dest, "fetch"):
        refuse_dest(dest, manifest, ranks, wants, "fetch")
        summary = FetchSummary(pub.shown, str(dest), share_doc(manifest.conversion_id, manifest.tp_size, ranks,
                                                                  nnodes, node_rank))
        _fetch_locked(pub, Tree(dest), manifest, wants, complete, summary, progress, check_config)
        if record is not None:
            summary.carried(carry(record, lambda rel: _open_cached(pub, rel), cache_tree(dest, create=True),
                                  pub.name(CACHE_DIR), __version__))
    summary.seconds = time.perf_counter() - t0
    return summary


def published_record(pub: Published) -> Record:
    """The published output's kernel-cache record (OutputError: none, or not one this tool wrote)."""
    rel = f"{CACHE_DIR}/{RECORD_NAME}"
    if pub.root is not None:
        record = read_record(cache_tree(pub.root))
    else:
        try:
            data = read_small(pub, rel)
        except OutputError:
            data = None
        try:
            record = None if data is None else parse_record(data)
        except ValueError as e:
            raise OutputError(f"{pub.name(rel)}: {e}; {REPUBLISH}") from None
    if record is None:
        raise OutputError(f"{pub.name(rel)}: missing: --kernel-cache, but the output holds no recorded kernel cache "
                          f"(lucifer-shard cache record, then publish {CACHE_DIR}/{RECORD_NAME} and {CACHE_DIR}/"
                          f"{FILES_DIR}/); fetch without --kernel-cache")
    return record


def _open_cached(pub: Published, rel: str) -> int:
    """A read-only descriptor of the recorded kernel-cache file `rel`: in the directory, or as downloaded (a link
    into the Hugging Face cache's blobs)."""
    path = f"{CACHE_DIR}/{FILES_DIR}/{rel}"
    if pub.root is not None:
        return Tree(pub.root).open_read(path)
    return open_regular(_download(pub, path), follow=True)


def _fetch_locked(pub: Published, tree: Tree, manifest: Manifest, wants: list[Want], complete: bytes,
                  summary: FetchSummary, progress: bool, check_config: Callable[[Path], None] | None) -> None:
    """The manifest and the copies, the config check, the rank files; then the share record, the output
    check of the share (every reader's), and COMPLETE."""
    tree.remove(COMPLETE_NAME)  # a fetch that changes DEST is unfinished until it ends
    bar = byte_bar(sum(w.bytes for w in wants), "fetch", progress)
    try:
        _place_all(pub, tree, [w for w in wants if not w.rank_file], bar, summary)
        if check_config is not None:
            check_config(tree.root)
        _place_all(pub, tree, [w for w in wants if w.rank_file], bar, summary)
    finally:
        bar.close()
    _clear_staging(tree, wants)
    tree.write_bytes(SHARE_NAME, share_text(summary.share).encode())
    check_output(tree.root, manifest, finishing=True).refuse()  # a share verify would refuse gets no COMPLETE
    tree.write_bytes(COMPLETE_NAME, complete)


def _place_all(pub: Published, tree: Tree, wants: list[Want], bar, summary: FetchSummary) -> None:
    for want in wants:
        how = _place(pub, tree, want, bar)
        setattr(summary, how, getattr(summary, how) + 1)
        summary.bytes += want.bytes
        summary.files.append(want.rel)


def _place(pub: Published, tree: Tree, want: Want, bar) -> str:
    """Put `want` into DEST: 'kept' (there and verifies), 'copied' (from a directory) or 'downloaded'."""
    there = tree.lstat(want.rel)
    if there is not None:
        if stat.S_ISREG(there.st_mode) and there.st_size == want.bytes and verifies(tree, want):
            bar.update(want.bytes)
            return "kept"
        tree.remove(want.rel)  # under the share's name but not its file: stale, or another output's
    if pub.root is not None:
        if Tree(pub.root).lstat(want.rel) is None:
            raise OutputError(f"{pub.name(want.rel)}: missing; {pub.root} does not hold the whole output its manifest "
                              f"lists; fetch from a complete copy")
        copy_checked(Tree(pub.root), tree, want, "fetch from a sound copy of the output")
        bar.update(want.bytes)
        return "copied"
    if not want.rank_file:
        data = read_small(pub, want.rel)
        if len(data) != want.bytes or "blake3:" + blake3(data).hexdigest() != want.digest:
            raise MismatchError(f"{pub.name(want.rel)}: not the bytes the manifest records (blake3 "
                                f"{want.digest[7:23]}...); {REPUBLISH}")
        tree.write_bytes(want.rel, data)
        bar.update(want.bytes)
        return "downloaded"
    staging = _staging(tree)
    _download_rank_file(pub, staging, want, bar)
    _check_staged(pub, staging, want)
    tree.link_in(staging, want.rel)  # its name in DEST only now, checked; the same inode, no copy
    staging.remove(want.rel)
    return "downloaded"


def _staging(tree: Tree) -> Tree:
    tree.make_dirs(STAGING)  # a real directory of DEST's filesystem (no link followed)
    return Tree(tree.path(STAGING))


def _download_rank_file(pub: Published, staging: Tree, want: Want, bar) -> None:
    """Download `want` into the download area, continuing the bytes an earlier run left there, and flush
    it to the disk (the link to come publishes bytes that are on the disk)."""
    try:
        # off the main thread, joined in slices: a stalled link never holds a stop (its bytes stay for the next run)
        stops.joined(lambda: download_resumed(pub.repo, pub.commit, want.rel, staging, want.rel, want.bytes,
                                              bar.update, sync=True), "lucifer-fetch")
    except LinkFault as e:
        raise e.then(FETCH_AGAIN) from None


def _check_staged(pub: Published, staging: Tree, want: Want) -> None:
    """The downloaded file is the Hub's (SHA-256) and the manifest's (digest), read once; else it is
    removed (the next run downloads it again) and refused by name with the fix."""
    fd = staging.open_read(want.rel)
    try:
        size = os.fstat(fd).st_size
        try:
            header = read_header(staging.path(want.rel), whole=False, fd=fd)
            digest, header_problem = ManifestDigest(header), stamp_problem(header, want)
        except HeaderError as e:
            digest, header_problem = None, f"unreadable safetensors header ({e.reason})"
        sha = hashlib.sha256()
        while chunk := os.read(fd, CHUNK):
            stops.check()
            sha.update(chunk)
            if digest is not None:
                digest.update(chunk)
    finally:
        os.close(fd)
    published = pub.sha256.get(want.rel)
    remedy = None
    if published is not None and sha.hexdigest() != published:  # first: the fix is another download
        problem = (f"SHA-256 {sha.hexdigest()[:16]}... is not the {published[:16]}... the Hub publishes for it; the "
                   f"bytes changed on the way")
        remedy = FETCH_AGAIN
    elif header_problem is not None:  # unreadable, or another identity stamp than the manifest's
        problem = f"{header_problem}; {REPUBLISH}"
    elif size != want.bytes:
        problem = f"{size_problem(size, want.bytes)}; {REPUBLISH}"
    elif digest.manifest_digest() != want.digest:
        problem = f"not the bytes the manifest records (blake3 {want.digest[7:23]}...); {REPUBLISH}"
    else:
        return
    staging.remove(want.rel)
    raise MismatchError(f"{pub.name(want.rel)}: {problem}", remedy=remedy)


def _clear_staging(tree: Tree, wants: list[Want]) -> None:
    """Remove DEST's download area: the partial files by the share's names (a run stopped between a link
    and its removal leaves one), then its folders, deepest first, once empty."""
    if tree.lstat(STAGING) is None:
        return
    staging = Tree(tree.path(STAGING))
    folders = {""}
    for want in wants:
        staging.remove(want.rel)
        folders |= {str(p) for p in PurePosixPath(want.rel).parents if str(p) != "."}
    for rel in sorted(folders - {""}, key=lambda d: -d.count("/")):
        staging.remove_dir(rel)
    tree.remove_dir(STAGING)
