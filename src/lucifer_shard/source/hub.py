"""A source checkpoint on the Hugging Face Hub: what a repo holds at one commit, its shard headers
read by ranged requests, and the tool's own download folder for a streamed conversion.

Order of a conversion from a repo id (docs/cli.md, "From the Hub"): config.json first (the refusals
that need nothing else: another model, an unsupported variant), then the repo's file list with the
sizes and SHA-256 the Hub publishes and the index, then every shard's header by ranged requests (a few
KiB each: the plan, the fingerprint, the conversion id, OUT's refusals and the room check need no
weight), and only then weights, each shard just before the first part that reads it.

Every request goes through huggingface_hub (`hf_hub_download`, `HfApi.model_info`, and its HTTP session
with `build_hf_headers` for the ranged header reads), so HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and its
retries apply. huggingface_hub checks a download's size only (`file_download.http_get`: "Consistency
check failed: file should be of size ..."), so every file read from the Hub is checked here against what
the Hub publishes for that commit before a byte of it is used (`HubRepo.check`): a shard (LFS) against
its SHA-256, config.json, the index and the tokenizer files (git files) against their git blob id. So a
Hub that answers one file with other bytes on a later request (or other bytes of the same size) cannot
give the plan one config.json and OUT another. A download stopped part-way is continued by the next
run (`download_resumed`, shared with `fetch`; how the bytes cross the link: `source.download`).

The download folder holds only what this tool downloaded for one repo at one commit (a marker file
says which); shards are removed from it as soon as no later part needs them, never from the user's
Hugging Face cache (blobs there are shared between revisions and tools) or a local checkpoint.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import READ_AGAIN, SAME_COMMAND, EnvironmentRefused, Remedy, SourceError, UsageRefused
from ..formats.stheader import MAX_HEADER_BYTES, Header, HeaderError, parse_header
from ..guarded_io import Tree, open_regular
from ..stops import stop_behind
from .download import HASH_BLOCK, transfer

NOT_HERE = "no such directory here, and as a Hugging Face repo id"

logger = logging.getLogger("lucifer_shard.hub")  # -v: each shard's download, -vv: its SHA-256 check
MARKER = "lucifer-download.json"
HEADER_GUESS = 1 << 18  # first ranged read of a shard; a larger header takes one more request
READ_BLOCK = 1 << 16  # a ranged read's body is taken this much at a time, never more than was asked for
QUOTA = ("the Hub refused the download with HTTP 402: the account's download quota (its 30-day egress allowance) is "
         "spent; wait for it to renew or raise it on the Hub, and spend less of it: a share copied between the boxes "
         "(`stage`, then any copy) or a `fetch` of a published share costs a third of the "
         "download of three nodes each streaming the source")


class LinkFault(EnvironmentRefused):
    """The link to the Hub failed (refused, reset, timed out, a 5xx after huggingface_hub's retries, a
    402 quota): a fault of the network, not of the tool. `what` names the file and the bytes kept; the
    line ends with the command that continues, which each command knows (`then`)."""

    def __init__(self, what: str, then: Remedy = SAME_COMMAND):
        self.what = what
        super().__init__(what, remedy=then)

    def then(self, then: Remedy) -> LinkFault:
        """The same fault, continued by `then`."""
        return LinkFault(self.what, then)


def link_reason(e: BaseException) -> str | None:
    """Why the link failed, as one phrase, when `e` (or what it was raised from) is a network failure;
    None for anything else. huggingface_hub raises httpx2's errors as they are after its retries, a 5xx
    or 402 as HfHubHTTPError, and wraps a failed metadata request of `hf_hub_download` in
    LocalEntryNotFoundError (its cause is the network error)."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = " ".join(str(e).split())[:200]
        if isinstance(e, OfflineModeIsEnabled):
            return None  # the user's choice, not a fault of the link
        if isinstance(e, httpx2.ConnectError):
            return f"cannot connect to the Hub ({text or 'connection refused'})"
        if isinstance(e, httpx2.TimeoutException):
            return (f"the Hub did not answer within HF_HUB_DOWNLOAD_TIMEOUT ({type(e).__name__}), after "
                    f"huggingface_hub's retries")
        if isinstance(e, httpx2.TransportError):  # RemoteProtocolError, ReadError, WriteError, ...
            return f"the connection was closed mid-transfer ({type(e).__name__}: {text})"
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            status = e.response.status_code
            if status == 402 or type(e).__name__ == "EgressLimitError":
                return QUOTA
            if status >= 500 or status in (408, 429):
                return f"the Hub answered HTTP {status} after huggingface_hub's retries"
        e = e.__cause__ or e.__context__
    return None


def link_fault(e: BaseException, where: str, kept: str = "", then: Remedy = SAME_COMMAND) -> LinkFault | None:
    """The one line of a network failure `e` while reading `where` (a file of a repo), saying what is
    kept; None when `e` is no network failure. A stop behind `e` (Ctrl-C or SIGTERM during huggingface_hub's
    retries) is raised as the stop it is."""
    stop = stop_behind(e)
    if stop is not None:
        raise stop from None
    reason = link_reason(e)
    if reason is None:
        return None
    return LinkFault(f"{where}: {reason}" + (f"; {kept}" if kept else ""), then)


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # the Hub's SHA-256 of an LFS file; None for a git file (its blob id is `blob`)
    blob: str | None

    @property
    def identity(self) -> str:
        """What names these bytes on the Hub: the SHA-256, or the git blob id."""
        return f"sha256:{self.sha256}" if self.sha256 else f"git:{self.blob}"


@dataclass(frozen=True)
class HubRepo:
    """A model repo at one commit: every file with its size and published identity."""

    repo: str
    commit: str
    files: dict[str, RemoteFile]
    card: dict = field(default_factory=dict)  # the repo card's front matter as the Hub parsed it (license, ...)

    def check(self, name: str, data: bytes, fix: Remedy = READ_AGAIN) -> None:
        """Refuse bytes read for `name` that are not the ones the Hub publishes for this commit: its size,
        then its SHA-256 (LFS) or git blob id (a git file), whichever the Hub gave; `fix` ends the line."""
        f = self.get(name)
        if len(data) != f.size:
            got = f"{len(data)} bytes, the Hub publishes {f.size}"
        elif f.sha256 is not None and hashlib.sha256(data).hexdigest() != f.sha256:
            got = f"its bytes do not have the SHA-256 the Hub publishes for it ({f.sha256[:16]}...)"
        elif f.sha256 is None and f.blob is not None and git_blob_id(data) != f.blob:
            got = f"its bytes are not the git blob the Hub publishes for it ({f.blob[:16]}...)"
        else:
            return
        raise SourceError(f"{name} of {self.repo} at {self.commit[:12]}: {got}; the endpoint served other bytes for "
                          f"this commit (the file changed under the conversion, or the download was damaged)",
                          remedy=fix)

    def get(self, name: str) -> RemoteFile:
        f = self.files.get(name)
        if f is None:
            raise SourceError(f"{self.repo} at {self.commit[:12]}: has no file {name}; the index or the repo is "
                              f"incomplete (check the revision)")
        return f


def git_blob_id(data: bytes) -> str:
    """The id git gives `data` as a blob: what the Hub publishes for a file that is not in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hub_error(repo: str, revision: str | None, what: str, e: Exception) -> SourceError:
    """One line for a failed Hub request: which repo, revision and file, why, and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = revision or "main"
    if isinstance(e, GatedRepoError):
        return SourceError(f"{repo}: gated; accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)")
    if isinstance(e, RepositoryNotFoundError):
        return SourceError(f"{repo}: {NOT_HERE}: no model repo on {constants.ENDPOINT} (or it is private: log "
                           f"in with `hf auth login` or HF_TOKEN); check the path or the repo id")
    if isinstance(e, RevisionNotFoundError):
        return SourceError(f"{repo}: no revision {at}; pass an existing branch, tag or commit to --revision")
    if isinstance(e, RemoteEntryNotFoundError):
        return SourceError(f"{repo} at {at}: has no {what}; not a safetensors checkpoint (check the repo id)")
    if isinstance(e, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub is unreachable"
        return SourceError(f"{repo}: {NOT_HERE}: {what} of {repo} at {at} is not in the local Hugging Face cache "
                           f"({constants.HF_HUB_CACHE}) and {why}; run `hf download {repo}"
                           f"{' --revision ' + revision if revision else ''}` where the Hub is reachable, or pass a "
                           f"local checkpoint directory")
    return SourceError(f"{repo}: cannot read {what} of {repo} at {at} from the Hub ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''})")


def guarded(repo: str, revision: str | None, what: str, call: Callable, kept: Callable[[], str] = lambda: ""):
    """`call()`, its failures as one line: a stop behind a failure stays the stop, a network failure is
    a LinkFault (`kept()`: what of the file stays on disk), any other a SourceError."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return call()
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError, httpx2.TransportError) as e:
        stop = stop_behind(e)
        if stop is not None:
            raise stop from None
        link = link_fault(e, f"{what} of {repo} at {(revision or 'main')[:12]}", kept())
        if link is not None:
            raise link from None
        raise _hub_error(repo, revision, what, e) from None


def small_file(repo: str, name: str, revision: str | None) -> Path:
    """A small file of the repo (config.json, the index) through huggingface_hub's cache; its path,
    whose folder is named for the commit the revision resolved to."""
    from huggingface_hub import hf_hub_download

    return Path(guarded(repo, revision, name, lambda: hf_hub_download(repo, name, revision=revision)))


def repo_at(repo: str, commit: str) -> HubRepo | None:
    """The repo's files at `commit`, with the sizes and SHA-256 the Hub publishes (one request); None
    when the Hub cannot be reached (HF_HUB_OFFLINE, no network): then only the cache can serve."""
    import httpx2
    from huggingface_hub import HfApi

    def info():
        try:
            return HfApi().model_info(repo, revision=commit, files_metadata=True)
        except (ConnectionError, httpx2.ConnectError, httpx2.TimeoutException):  # OfflineModeIsEnabled too
            return None
    info = guarded(repo, commit, "the file list", info)
    if info is None:
        return None
    files = {}
    for s in info.siblings or []:
        sha = s.lfs.sha256 if s.lfs is not None else None
        size = s.lfs.size if s.lfs is not None else s.size
        if size is None:
            raise SourceError(f"{repo} at {commit[:12]}: the Hub gave no size for {s.rfilename}; try again later")
        files[s.rfilename] = RemoteFile(s.rfilename, size, sha, s.blob_id)
    card = info.card_data.to_dict() if info.card_data is not None else {}
    return HubRepo(repo, info.sha or commit, files, card)


def _ranged(repo: HubRepo, name: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file of the repo, by one ranged GET through huggingface_hub's session, read
    as they come and never past `end - start` bytes: a server that ignored the range (sending the whole
    file) is refused at the first byte too many, not after its body was taken into memory."""
    import httpx2
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    want = end - start

    def get() -> bytes:
        headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        with get_session().stream("GET", hf_hub_url(repo.repo, name, revision=repo.commit), headers=headers,
                                  follow_redirects=True) as r:
            if r.status_code >= 400:  # the error's body for huggingface_hub's message: its first blocks only
                body = b"".join(itertools.islice(r.iter_raw(READ_BLOCK), 16))
                hf_raise_for_status(httpx2.Response(r.status_code, headers=r.headers, content=body, request=r.request))
            data = bytearray()
            for block in r.iter_raw(READ_BLOCK):
                data += block
                if len(data) > want:
                    break
        return bytes(data)
    data = guarded(repo.repo, repo.commit, name, get)
    if len(data) != want:  # a server that ignored the range sends the whole file: refuse, do not use it
        got = f"more than {want} bytes" if len(data) > want else f"{len(data)} bytes"
        raise SourceError(f"{repo.repo}: a ranged read of {name} [{start}, {end}) returned {got}; the endpoint does "
                          f"not serve byte ranges (check HF_ENDPOINT)")
    return data


def remote_header(repo: HubRepo, name: str) -> Header:
    """A shard's header from its first bytes on the Hub, validated as a local one is (`stheader`)."""
    size = repo.get(name).size
    first = _ranged(repo, name, 0, min(size, HEADER_GUESS)) if size >= 8 else b""
    n = int.from_bytes(first[:8], "little") if len(first) >= 8 else 0
    # a header past the safetensors limit is refused by parse_header from its length alone: never read it
    if len(first) >= 8 and 8 + n > len(first) and 8 + n <= size and n <= MAX_HEADER_BYTES:
        first += _ranged(repo, name, len(first), 8 + n)
    try:
        return parse_header(f"{repo.repo}/{name}", first[:8 + n] if len(first) >= 8 else first, size)
    except HeaderError as e:
        raise SourceError(f"{name} of {repo.repo} at {repo.commit[:12]}: {e.reason}; the shard on the Hub is damaged "
                          f"or not safetensors", key=e.tensor) from None


def cached_snapshot(repo: HubRepo, names: list[str]) -> Path | None:
    """The Hugging Face cache's snapshot folder of `repo` at its commit when it holds every file of
    `names` (then nothing needs downloading), else None."""
    from huggingface_hub import try_to_load_from_cache

    paths = [try_to_load_from_cache(repo.repo, n, revision=repo.commit) for n in names]
    return Path(paths[0]).parent if paths and all(isinstance(p, str) for p in paths) else None


def download_resumed(repo: str, commit: str, name: str, tree: Tree, rel: str, size: int,
                     report: Callable[[int], None], sync: bool = False) -> str | None:
    """File `name` of `repo` at `commit` into `tree`'s `rel`, at the Hub's own speed (`source.download.download_route`):
    a Xet-stored file through huggingface_hub's `xet_get` (hf_xet); any other in blocks of `BLOCK` bytes,
    up to `WORKERS` ranged GETs at once (as snapshot_download's workers; a CDN caps each connection, not
    the link), each through huggingface_hub's own `http_get` (its headers, retries and range handling),
    written to the file in order by one writer, so the file on disk is always a whole prefix: a stopped
    run's bytes are continued from where they end. Not `hf_hub_download(local_dir=)`: huggingface_hub
    2.4.0 writes each download to a process-unique `<etag>.<uuid>.incomplete` opened "wb"
    (file_download.py `_download_to_tmp_and_move`), so a killed run would start the file again from byte 0.
    `report(n)` gets the bytes as they come (those already there first). `sync`: flushed to the disk (for a
    file published by a link). Returns the file's SHA-256, hashed as its bytes were written (no second
    read), or None for a Xet download (hf_xet writes the file itself): then the caller hashes it."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    def get() -> str | None:
        headers = build_hf_headers()
        metadata = get_hf_file_metadata(hf_hub_url(repo, name, revision=commit), headers=headers)
        return transfer(metadata, headers, tree, rel, size, name, f"{name} of {repo} at {commit[:12]}", report, sync)

    def kept() -> str:
        st = tree.lstat(rel)
        have = st.st_size if st is not None else 0
        return f"{have:,} of its {size:,} bytes are kept in {tree.path(rel)} (the next run continues from them)"
    return guarded(repo, commit, name, get, kept)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    fd = open_regular(path)
    try:
        while chunk := os.read(fd, HASH_BLOCK):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def refuse_download_dir(root: Path) -> None:
    """--download-dir must be a folder or a new path: a file there is refused before anything is written."""
    if os.path.lexists(root) and not os.path.isdir(root):
        raise UsageRefused(f"--download-dir {root}: not a folder; name a new folder, an empty one or a lucifer-shard "
                           f"download folder")


class DownloadFolder:
    """The folder a streamed conversion downloads into (`OUT/.lucifer/download` or --download-dir): a
    marker names the repo and commit, so a folder of another download (or a user's) is refused, and
    only files of that repo which this tool downloaded are ever removed from it; the folder itself only
    when this tool made it (a mount point or a folder the user made stays). One conversion at a time
    uses a folder: it is locked (flock on the directory, dropped when the process ends) from `lock()`
    until `close()`, so a second conversion naming the same --download-dir is refused in one line, kind
    `locked`, instead of removing the shards the first still reads (a lock, not a subfolder each: a
    stopped run's bytes stay where its --resume looks for them)."""

    def __init__(self, repo: HubRepo, root: Path, report: Callable[[int], None] | None = None):
        self.repo, self.root, self.tree = repo, Path(root), Tree(root)
        self.report = report or (lambda n: None)  # bytes downloaded, for the one progress display
        self.downloaded = 0
        self.seconds = 0.0
        self.made = False
        self._lock: ExitStack | None = None

    def marker(self) -> dict:
        return {"format": "lucifer-shard-download", "hf": f"{self.repo.repo}@{self.repo.commit}"}

    def lock(self) -> None:
        """Make the folder if it is not there, and hold it for this process alone."""
        import fcntl

        from ..errors import Locked

        if self._lock is not None:
            return
        refuse_download_dir(self.root)
        if not self.root.exists():
            self.root.mkdir(parents=True)
            self.made = True
        held = ExitStack()
        fd = held.enter_context(self.tree.directory())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.close()
            raise Locked(f"{self.root}: the download folder of another lucifer-shard command that is running; give "
                         f"each its own --download-dir, or wait for it to finish") from None
        self._lock = held  # closing its descriptor drops the lock

    def claim(self) -> None:
        """Make the folder (or take over this download's), refusing one that holds anything else."""
        self.lock()
        entries = self.tree.entries()
        if MARKER in entries:
            try:
                theirs = json.loads(self.tree.read(MARKER))
            except (ValueError, UnicodeDecodeError):
                theirs = None
            if not isinstance(theirs, dict) or {k: theirs.get(k) for k in self.marker()} != self.marker():
                what = str(theirs.get("hf"))[:80] if isinstance(theirs, dict) else "an unreadable marker"
                raise SourceError(f"{self.root}: a download folder of {what}, not of {self.repo.repo} at "
                                  f"{self.repo.commit[:12]}; choose another --download-dir (or empty this one)")
            self.made = theirs.get("made") is True  # who made it: the run that wrote the marker
        elif entries:
            raise SourceError(f"{self.root}: not empty and not a lucifer-shard download folder; choose an empty or "
                              f"new --download-dir (lucifer-shard deletes only files it downloaded)")
        else:
            self.tree.write_bytes(MARKER, (json.dumps({**self.marker(), "made": self.made}, sort_keys=True)
                                           + "\n").encode())

    def fetch(self, name: str) -> Path:
        """`name` in the folder, downloaded (continued where a stopped run left it) unless already whole,
        and checked against the Hub's SHA-256 (a git file: its blob id, `HubRepo.check`) before any byte of
        it is used; a file that fails is removed and named."""
        remote = self.repo.get(name)
        st = self.tree.lstat(name)
        sha = None
        if st is None or st.st_size != remote.size:
            t0 = time.perf_counter()
            sha = download_resumed(self.repo.repo, self.repo.commit, name, self.tree, name, remote.size, self.report)
            took = time.perf_counter() - t0
            self.seconds += took
            self.downloaded += remote.size - (st.st_size if st is not None else 0)
            logger.info("%s: downloaded, %d bytes in %.1f s", name, remote.size, took)
        t0 = time.perf_counter()
        if remote.sha256 is not None and (sha or _sha256(self.tree.path(name))) != remote.sha256:
            self.remove(name)
            raise SourceError(f"{name} of {self.repo.repo} at {self.repo.commit[:12]}: its bytes do not have the "
                              f"SHA-256 the Hub publishes for it ({remote.sha256[:16]}...); removed. The download "
                              f"was damaged or the endpoint served other bytes", remedy=READ_AGAIN)
        if remote.sha256 is None:  # a git file (config, tokenizer): small, read whole (its size was just checked)
            try:
                self.repo.check(name, self.tree.read(name, remote.size))
            except SourceError:
                self.remove(name)
                raise
        logger.debug("%s: SHA-256 checked in %.1f s", name, time.perf_counter() - t0)
        return self.tree.path(name)

    def remove(self, name: str) -> None:
        """Remove a file of the repo this folder downloaded."""
        self.tree.remove(name)

    def close(self, names: list[str]) -> None:
        """Remove what is left of the download (`names`: the repo files it may hold), the marker, then the
        folder itself if this tool made it and it is empty; the lock is dropped."""
        for name in names:
            self.remove(name)
        self.tree.remove(MARKER)
        self.release()

    def release(self) -> None:
        """Drop the lock; the folder stays as it is (a stopped run's bytes for the next), unless this tool
        made it and it is empty."""
        if self._lock is None:
            return
        if self.made and not self.tree.entries():
            Tree(self.root.parent).remove_dir(self.root.name)
        self._lock.close()
        self._lock = None
