"""The source side of `diff`: raw reads of source tensor rows straight from the shards (no
safetensors, none of the engine's readers), a chunk's regions read once in few large requests and
shared by every rank's comparison, the source's content digests checked shard by shard, and a source
on the Hub streamed through a download folder."""
from __future__ import annotations

import os
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from .. import stops
from ..errors import VERIFY, MismatchError, NoRoom, UsageRefused
from ..formats.dtypes import CONVERSIONS, InexactConversion, convert_bytes, DTYPE_SIZE
from ..guarded_io import JSON_LIMIT, Refused, read_regular
from ..output.manifest_types import Source
from ..source.checkpoint import Checkpoint
from ..source.content import ContentDigests, checkpoint_digest, shard_digests
from ..units import size
from .rankfile import DirectFile, ProofBufferPool, byte_shape
from .report import Problem, Report


class NarrowingError(ValueError):
    """A source value does not survive the conversion to the dtype the output stores."""


COALESCE_GAP = 256 << 10  # source regions closer than this are read with one request
MAX_BLOCK = 64 << 20


class ProofSourceReader:
    """Raw reads of source tensor rows, straight from the shards (no safetensors, no engine code):
    positional O_DIRECT reads (where the filesystem allows) into reused page-aligned buffers."""

    def __init__(self, ckpt: Checkpoint, digests: ContentDigests):
        self.ckpt = ckpt
        self.digests = digests
        self._files: dict[str, DirectFile] = {}
        self.bytes_needed = 0  # bytes of source tensors compared
        self.bytes_read = 0  # bytes read from disk (needed bytes plus small gaps between them)
        self.keys_read: set[str] = set()
        self.pool = ProofBufferPool()
        self._lock = threading.Lock()

    def _file(self, file: str) -> DirectFile:
        with self._lock:
            f = self._files.get(file)
            if f is None:
                f = self._files[file] = DirectFile(self.ckpt.root / file)
            return f

    def span(self, key: str, r0: int, r1: int) -> tuple[str, int, int]:
        """(file, absolute start, end) of rows [r0, r1) of `key`."""
        entry = self.ckpt.tensors[key]
        row = row_bytes(entry.shape, DTYPE_SIZE[entry.dtype])
        start = self.ckpt.data_start[entry.file] + entry.offsets[0] + r0 * row
        return entry.file, start, start + (r1 - r0) * row

    def read_block(self, file: str, start: int, end: int, needed: int, keys: list[str],
                   buf: np.ndarray) -> np.ndarray:
        """File bytes [start, end) into `buf` (page-aligned, DirectFile.span bytes); the view of them."""
        got = self._file(file).read(start, end - start, buf)
        with self._lock:
            self.bytes_read += end - start
            self.bytes_needed += needed
            self.keys_read.update(keys)
        return got

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def forget(self, file: str) -> None:
        """Close a shard no later read needs (a streamed source's, about to be removed)."""
        with self._lock:
            f = self._files.pop(file, None)
        if f is not None:
            f.close()


def row_bytes(shape: tuple[int, ...], item: int) -> int:
    n = item
    for d in shape[1:]:
        n *= d
    return n


class ContentCheck:
    """The source's content against the digests convert recorded, shard by shard as soon as every converted
    tensor of a shard has been read; a difference stops the diff (one line) unless `keep_going`."""

    def __init__(self, report: Report, ckpt: Checkpoint, keys: list[str], recorded: dict | None, stop: str):
        self.report, self.ckpt, self.stop = report, ckpt, stop
        self.recorded = recorded  # shard -> "blake3:..." (None: the manifest has no content digests)
        self.digests = ContentDigests({k: ckpt.tensors[k].offsets[1] - ckpt.tensors[k].offsets[0] for k in keys})
        self.keys_of: dict[str, list[str]] = {}
        for k in keys:
            self.keys_of.setdefault(ckpt.tensors[k].file, []).append(k)
        self.left = {shard: len(ks) for shard, ks in self.keys_of.items()}
        self.shards: dict[str, str] = {}  # shard -> digest computed here
        self.differs: list[str] = []

    def settle(self) -> None:
        """Check every shard whose tensors have all been read since the last call."""
        for key in self.digests.completed():
            shard = self.ckpt.tensors[key].file
            self.left[shard] -= 1
            if self.left[shard] == 0:
                self._check(shard)

    def _check(self, shard: str) -> None:
        got = shard_digests(self.digests.finished(self.keys_of[shard]), {k: shard for k in self.keys_of[shard]})[shard]
        self.shards[shard] = got
        want = (self.recorded or {}).get(shard) if self.recorded is not None else got
        if got == want:
            return
        self.differs.append(shard)
        what = (f"{shard}: its content differs from the shard converted (BLAKE3 {got[7:23]}... vs recorded "
                f"{str(want)[7:23]}...)")
        if self.stop:
            raise MismatchError(f"diff: {what}; {self.stop}")
        self.report.add_first(Problem("source", what, file=shard))

    def info(self) -> dict:
        done = len(self.shards) == len(self.keys_of)
        return {"recorded": self.recorded is not None, "shards_checked": len(self.shards),
                "shards": len(self.keys_of), "differs": self.differs,
                "digest": checkpoint_digest(self.shards) if done else None}


class ChunkSources:
    """The source regions of one chunk, read in few large requests (regions of a file that lie
    together are coalesced), each byte once, shared by all ranks' tasks."""

    def __init__(self, reader: ProofSourceReader, regions: dict[tuple[str, int, int], bool]):
        """`regions`: each region, and whether its bytes feed the content digest."""
        stops.check()  # each chunk of diff begins here, on the main thread
        self.reader = reader
        self._digested = regions
        self._where: dict[tuple[str, int, int], tuple[Future, int]] = {}
        self._converted: dict[tuple[str, int, int], np.ndarray] = {}
        self._lock = threading.Lock()
        spans = sorted((reader.span(*r), r) for r in regions)
        self.blocks: list[list] = []  # [Future, file, start, end, needed, regions, offset in self.buf]
        cur = None
        for (file, start, end), region in spans:
            if cur is not None and cur[1] == file and start - cur[3] <= COALESCE_GAP and end - cur[2] <= MAX_BLOCK:
                cur[3] = max(cur[3], end)
                cur[4] += end - start
                cur[5].append((region, start))
                continue
            cur = [Future(), file, start, end, end - start, [(region, start)], 0]
            self.blocks.append(cur)
        size = 0
        for blk in self.blocks:
            blk[6] = size
            size += DirectFile.span(blk[2], blk[3] - blk[2])
        self.buf = reader.pool.take(size) if size else None
        for fut, file, start, end, needed, members, at in self.blocks:
            for region, rstart in members:
                self._where[region] = (fut, rstart - start)

    def read(self, i: int) -> None:
        """Read block `i` and hash its regions into the content digests (run on the pool before any rank
        task of the chunk; the hashing is done before the buffer can be released)."""
        fut, file, start, end, needed, members, at = self.blocks[i]
        try:
            got = self.reader.read_block(file, start, end, needed, [r[0][0] for r in members], self.buf[at:])
            for (key, r0, r1), rstart in members:
                if not self._digested[(key, r0, r1)]:
                    continue
                row = row_bytes(self.reader.ckpt.tensors[key].shape, DTYPE_SIZE[self.reader.ckpt.tensors[key].dtype])
                at_block = rstart - start
                self.reader.digests.feed(key, r0 * row, got[at_block:at_block + (r1 - r0) * row])
            fut.set_result(got)
        except BaseException as e:
            fut.set_exception(e)

    def release(self) -> None:
        """Give the chunk's buffer back (every task that reads it is done)."""
        if self.buf is not None:
            self.reader.pool.give(self.buf)
            self.buf = None

    def get(self, key: str, r0: int, r1: int, out_dtype: str) -> np.ndarray:
        """Rows [r0, r1) of source `key` as bytes of the output dtype (last dim in bytes)."""
        fut, off = self._where[(key, r0, r1)]
        block = fut.result()
        entry = self.reader.ckpt.tensors[key]
        item = DTYPE_SIZE[entry.dtype]
        n = (r1 - r0) * row_bytes(entry.shape, item)
        shape = byte_shape((r1 - r0, *entry.shape[1:]), item) if len(entry.shape) > 1 else (n,)
        raw = block[off:off + n].reshape(shape)
        if (entry.dtype, out_dtype) in CONVERSIONS:
            with self._lock:
                got = self._converted.get((key, r0, r1))
            if got is None:
                try:
                    got = convert_bytes(raw, entry.dtype, out_dtype)
                except InexactConversion as e:
                    raise NarrowingError(f"source tensor {key!r} holds {e}; the {out_dtype} rank tensor cannot "
                                         f"equal it") from None
                with self._lock:
                    self._converted[(key, r0, r1)] = got
            return got
        return raw


def what_differs(src: Source, ckpt: Checkpoint, out: Path) -> str:
    """What makes the checkpoint's fingerprint (or its recorded shard list) differ from the manifest's, in words."""
    was, now = src.files, ckpt.files
    gone, new = sorted(set(was) - set(now)), sorted(set(now) - set(was))
    if gone or new:
        return f"its shards are others ({len(gone)} missing, {len(new)} not converted; first {(gone or new)[0]})"
    resized = [n for n in sorted(now) if now[n] != was[n]]
    if resized:
        return f"shard {resized[0]} has {now[resized[0]]:,} bytes, the converted one had {was[resized[0]]:,}"
    try:
        ours = read_regular(out / "config.json", JSON_LIMIT)  # an output's copy: never through a link
    except (OSError, Refused):
        ours = None
    if ours != ckpt.config_bytes:
        return "its config.json differs from the one converted (OUT/config.json)"
    return "its shard headers differ from the converted ones (same names and sizes)"


def download_bytes(out: Path) -> int:
    """What `diff OUT` (its MODEL the recorded source) downloads from the Hub: the source's shard bytes where
    the source is a repo id whose shards the Hugging Face cache does not all hold at the recorded commit
    (the source of a streamed convert), else 0 (read on disk). No request is made."""
    from huggingface_hub import try_to_load_from_cache

    from ..output.manifest_types import Manifest, source_model
    from ..source.checkpoint import is_repo_id

    m = Manifest.load(out, check_digest=False)
    model, revision, _ = source_model(out, m, None)
    files = m.source.files
    if not is_repo_id(model) or all(isinstance(try_to_load_from_cache(model, name, revision=revision), str)
                                    for name in files):
        return 0
    return sum(files.values())


def refuse_download(out: Path, ckpt: Checkpoint) -> None:
    """A diff against a source on the Hub downloads every shard again (the bytes a streamed convert
    downloaded): never by default, after the fingerprint (config and headers, a few KiB) was compared."""
    hub = ckpt.hub
    raise UsageRefused(f"diff: {hub.repo} at {hub.commit[:12]} is not in the Hugging Face cache: the byte-for-byte "
                       f"proof downloads its {len(ckpt.files)} shards again, {size(sum(ckpt.files.values()))} from the "
                       f"Hub", remedy=VERIFY.at(out=str(out)).after(
                           "", "pass --download-source to download them (each removed once compared)"))


class SourceStream:
    """A diff's source on the Hub, not in the Hugging Face cache: its shards are downloaded into a folder
    of their own (`source.hub.DownloadFolder`) just before the first group that reads them and removed
    once the last such group is merged, the groups taken in the order that holds fewest shards at once
    (`source.streaming`); the room for that is checked first. `of` gives a no-op stream for a source on
    disk."""

    def __init__(self, ckpt: Checkpoint, root: Path | None):
        from ..source.hub import DownloadFolder

        hub = ckpt.hub
        self.ckpt = ckpt
        self.root = Path(root or Path(tempfile.gettempdir()) / f"lucifer-diff-{hub.commit[:12]}")
        self.folder = DownloadFolder(hub, self.root)
        ckpt.root = self.root  # where a checkpoint on the Hub is read from: the folder its shards land in
        self.files: list[list[str]] = []
        self.last: dict[str, int] = {}
        self.reader: ProofSourceReader | None = None
        self.opened = False

    @classmethod
    def of(cls, ckpt: Checkpoint, root: Path | None, download: bool, out: Path) -> SourceStream | _OnDisk:
        """The source's stream: on disk, or on the Hub and asked for (`download`: --download-source), else
        refused (`refuse_download`)."""
        if ckpt.hub is None:
            return _OnDisk(ckpt)
        if not download:
            refuse_download(out, ckpt)
        return cls(ckpt, root)

    def side(self, name: str) -> Path:
        """A config/tokenizer file of the source (downloaded now: they are small)."""
        return self._fetch(name) if name in self.ckpt.side else self.root / name

    def _fetch(self, name: str) -> Path:
        if not self.opened:
            self.folder.claim()
            self.opened = True
        # off the main thread, joined in slices: a stalled link never holds a stop (its bytes stay for the next run)
        return stops.joined(lambda: self.folder.fetch(name), "lucifer-download")

    def order(self, work: list, reader: ProofSourceReader) -> list:
        """`work` (diff's groups) in the order that holds fewest shards at once; refused before any
        shard is downloaded when the folder's filesystem lacks the room for that many."""
        from ..source.streaming import peak_bytes, stream_order

        tensors = self.ckpt.tensors
        files = {id(g): sorted({tensors[k].file for ms in g[1] for m in ms for k in m[0].sources() if k in tensors})
                 for g in work}
        work = stream_order(work, files, self.ckpt.files)
        need = peak_bytes(work, files, self.ckpt.files, lead=0) + sum(self.ckpt.side.values())
        at = self.root
        while not at.exists():
            at = at.parent
        st = os.statvfs(at)
        if need > st.f_bavail * st.f_frsize:
            raise NoRoom(f"{self.root}: diff streams up to {size(need)} of {self.ckpt.hub.repo}'s shards at once and "
                         f"its filesystem has {size(st.f_bavail * st.f_frsize)} free; pass --download-dir on a disk "
                         f"with the room (or `hf download` the checkpoint and pass its folder)", exit_code=2)
        self.files = [files[id(g)] for g in work]
        self.last = {f: i for i, names in enumerate(self.files) for f in names}
        self.reader = reader
        return work

    def before(self, g: int) -> None:
        for name in self.files[g]:
            self._fetch(name)

    def after(self, g: int) -> None:
        for name in [f for f in self.files[g] if self.last[f] == g]:
            self.reader.forget(name)
            self.folder.remove(name)

    def close(self, keep: bool = False) -> None:
        """Remove the download (`keep`: leave its bytes for the next run, after the link failed)."""
        if self.opened:
            if keep:
                self.folder.release()
            else:
                self.folder.close([*self.ckpt.files, *self.ckpt.side])


class _OnDisk:
    """The stream of a source on disk: read in place, nothing fetched or removed."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def side(self, name: str) -> Path:
        return self.ckpt.root / name

    def order(self, work: list, reader: ProofSourceReader) -> list:
        return work

    def before(self, g: int) -> None:
        pass

    def after(self, g: int) -> None:
        pass

    def close(self, keep: bool = False) -> None:
        pass
