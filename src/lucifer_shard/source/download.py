"""How a file of a Hub repo crosses the link, at the Hub's own speed (docs/cli.md, "From the Hub"): a
Xet-stored file through huggingface_hub's own hf_xet path, any other over several ranged connections at
once, each byte hashed against the Hub's SHA-256 as it is written and a cut file continued from the whole
prefix on disk: `source.hub.download_resumed`, shared by convert's download folder and `fetch`."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from ..errors import SourceError
from ..guarded_io import Tree
from ..stops import check

HASH_BLOCK = 16 << 20
WORKERS = 8  # ranged GETs of one file at once: snapshot_download's default max_workers
BLOCK = 32 << 20  # one ranged GET of a download; a file of one block takes one connection (at most
# WORKERS blocks are held in memory ahead of the writer: 256 MiB)
WAIT_S = 0.02  # how long the writer sleeps before it looks for a block's next bytes (and a stop) again


def download_route(metadata) -> str:
    """How a file is downloaded, from huggingface_hub's own metadata of it (`get_hf_file_metadata`): "xet"
    where the Hub stores it in Xet (`HfFileMetadata.xet_file_data`) and hf_xet is installed (huggingface_hub's
    own fastest path, chunks fetched in parallel), else "ranged" (several ranged connections at once)."""
    from huggingface_hub.utils._runtime import is_xet_available

    return "xet" if metadata.xet_file_data is not None and is_xet_available() else "ranged"


def transfer(metadata, headers: dict, tree: Tree, rel: str, size: int, name: str, shown: str,
             report: Callable[[int], None], sync: bool) -> str | None:
    """File `name` (`metadata`: huggingface_hub's `get_hf_file_metadata` of it) into `tree`'s `rel` by its
    route (`download_route`): Xet through `_xet`, any other `_in_blocks` after the bytes a stopped run left
    there. Returns its SHA-256, hashed as its bytes were written, or None for a Xet download (hf_xet writes
    the file itself): then the caller hashes it."""
    if download_route(metadata) == "xet":
        return _xet(metadata, headers, tree, rel, size, name, report, sync)
    with os.fdopen(tree.open_own(rel, os.O_RDWR), "r+b") as f:
        have = f.seek(0, os.SEEK_END)
        if have > size:  # not a start of this file: begin again
            have = f.seek(0)
            f.truncate()
        out = _Hashing(f, have, size, shown)
        report(have)
        if have < size:
            _in_blocks(metadata.location, headers, out, have, size, shown, report)
        if sync:
            f.flush()
            os.fsync(f.fileno())
        return out.sha.hexdigest()


def _xet(metadata, headers: dict, tree: Tree, rel: str, size: int, name: str, report: Callable[[int], None],
         sync: bool) -> None:
    """A Xet-stored file through huggingface_hub's own `xet_get` into `tree`'s `rel` (hf_xet keeps its own
    cache of chunks, so a stopped run's chunks are not fetched again); hashed by the caller. Not met with the
    real Hub's Xet storage here (docs/cli.md)."""
    from huggingface_hub.file_download import xet_get

    os.close(tree.open_own(rel, os.O_RDWR))  # the folder's own regular file (no link followed), for hf_xet to fill
    xet_get(incomplete_path=tree.path(rel), xet_file_data=metadata.xet_file_data, headers=headers,
            expected_size=size, displayed_filename=name, tqdm_class=_bar(lambda n: None))
    report(size)
    if sync:
        fd = tree.open_own(rel, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _in_blocks(url: str, headers: dict, out: _Hashing, have: int, size: int, shown: str,
               report: Callable[[int], None]) -> None:
    """Bytes [have, size) of `url` appended to `out` in order: blocks of `BLOCK` bytes fetched by up to
    `WORKERS` ranged GETs at once, no more than `WORKERS` blocks ahead of the writer (memory bounded), the
    block at the front written (and hashed) as its bytes come. A block's failure ends the file there: what
    came before it is on disk, a whole prefix."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from huggingface_hub.file_download import http_get

    starts = range(have, size, BLOCK)  # made into blocks as they are asked for: a size may be huge (a lie)
    quiet = _bar(lambda n: None)

    def fetch(b: _Block) -> None:
        http_get(url, b, headers={**headers, "Range": f"bytes={b.start}-{b.end - 1}"}, expected_size=b.end - b.start,
                 displayed_filename=shown, tqdm_class=quiet)

    pool = ThreadPoolExecutor(min(WORKERS, len(starts)), thread_name_prefix="lucifer-range")
    ahead: deque[tuple[_Block, Future]] = deque()  # the blocks asked for and not yet written, in file order
    stopping = False
    try:
        for start in starts:
            while len(ahead) < WORKERS and (nxt := start + len(ahead) * BLOCK) < size:
                b = _Block(nxt, min(nxt + BLOCK, size), shown)
                ahead.append((b, pool.submit(fetch, b)))
            block, job = ahead[0]
            while True:
                check()
                done = job.done()
                data = block.take()
                if data:
                    out.write(data)
                    report(len(data))
                elif done:
                    job.result()  # its error (after huggingface_hub's retries) ends the file here
                    break
                else:  # a sleep in this frame, not a wait in threading's: a stop lands here (cli.console)
                    time.sleep(WAIT_S)
            ahead.popleft()
    except KeyboardInterrupt:
        stopping = True
        raise
    finally:
        for b, _ in ahead:
            b.cancel()  # a block's next bytes end its GET
        # after a failure, the other GETs end before the file is handed back (nothing more is asked of the
        # Hub); a stop leaves at once (the process is leaving)
        pool.shutdown(wait=not stopping, cancel_futures=True)


class _Block:
    """One ranged GET's bytes, written by huggingface_hub's `http_get` as they come and taken by the one
    writer in file order. More than the block (a server that ignored the range) or a rewind is refused."""

    def __init__(self, start: int, end: int, shown: str):
        self.start, self.end, self.shown = start, end, shown
        self.length = 0  # bytes received (http_get's resume position on a retry)
        self.data = bytearray()  # received and not yet taken
        self.cancelled = False
        self.lock = threading.Lock()

    def write(self, data: bytes) -> int:
        with self.lock:
            if self.cancelled:
                raise SourceError(f"{self.shown}: the download was stopped")
            if self.length + len(data) > self.end - self.start:
                raise self._no_ranges()
            self.data += data
            self.length += len(data)
        return len(data)

    def take(self) -> bytes:
        """The bytes received since the last take."""
        with self.lock:
            data, self.data = bytes(self.data), bytearray()
        return data

    def tell(self) -> int:
        return self.length

    def seek(self, *args: int) -> int:
        raise self._no_ranges()

    def truncate(self, *args: int) -> int:
        raise self._no_ranges()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            self.data = bytearray()

    def _no_ranges(self) -> SourceError:
        return SourceError(f"{self.shown}: a ranged read of [{self.start}, {self.end}) was answered with other "
                           f"bytes than asked for; the endpoint does not serve byte ranges (check HF_ENDPOINT)")


class _Hashing:
    """The file the blocks are written into in order, hashing (SHA-256) the bytes already there and each
    write, so a download is checked without reading it again. A write past the file's published `size` is
    refused as it comes: a server that sends more than the file never fills the disk."""

    def __init__(self, f, have: int, size: int, shown: str):
        self.f, self.sha, self.size, self.shown = f, hashlib.sha256(), size, shown
        f.seek(0)
        while f.tell() < have and (chunk := f.read(min(HASH_BLOCK, have - f.tell()))):
            self.sha.update(chunk)

    def write(self, data: bytes) -> int:
        if self.f.tell() + len(data) > self.size:
            raise SourceError(f"{self.shown}: the endpoint sent more than the {self.size:,} bytes the Hub publishes "
                              f"for it; refused before writing them (check HF_ENDPOINT)")
        self.sha.update(data)
        return self.f.write(data)


def _bar(report: Callable[[int], None]) -> type:
    """A tqdm class for huggingface_hub's download that shows nothing and reports each update: the
    download is shown on the command's one progress line, not as a bar of its own per file."""
    from tqdm.auto import tqdm

    class Forward(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> None:
            report(int(n or 0))

    return Forward
