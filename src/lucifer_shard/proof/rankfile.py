"""Rank files read by the proof through their own headers, with readers of its own (none of the
engine's): positional reads, O_DIRECT where the filesystem allows it, into reused page-aligned
buffers. `verify` streams each file once; `diff` reads rank and source rows with `DirectFile`."""
from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

from ..errors import COMMAND_AGAIN, OutputError
from ..formats.dtypes import DTYPE_SIZE
from ..formats.stheader import read_header
from ..guarded_io import Tree, naming, open_regular
from ..output.manifest import file_digest

CHUNK_BYTES = 32 << 20
ALIGN = 4096  # O_DIRECT offset, length and address alignment
DIRECT = True  # read rank and source bytes with O_DIRECT where the filesystem allows it


@dataclass(frozen=True)
class HeaderTensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int

    @property
    def item(self) -> int:
        return DTYPE_SIZE[self.dtype]


class RankFile:
    """A rank file opened through its own header (not the manifest's idea of it), reached through
    real directories of OUT (`Tree.open_read`: a link anywhere on the way is refused). Descriptors are
    opened when data is read and closed by `close()`, so callers bound how many are open at once;
    each one must be the file whose header was read (a file replaced meanwhile is refused)."""

    def __init__(self, tree: Tree, rel: str):
        self.rel = rel
        self.tree = tree
        self.path = tree.path(rel)
        fd = tree.open_read(rel)
        try:
            st = os.fstat(fd)
            self._identity = (st.st_dev, st.st_ino)
            # Not `whole`: a truncated file is reported tensor by tensor, bytes after the data as a finding.
            with naming(self.path):
                header = read_header(self.path, whole=False, fd=fd)
        finally:
            os.close(fd)
        self.size = header.file_size
        self.header = header.block
        self.meta: dict = header.metadata
        self.trailing = max(0, header.file_size - header.data_end)  # bytes after the last tensor
        base = header.data_start
        self.tensors: dict[str, HeaderTensor] = {
            t.name: HeaderTensor(t.dtype, t.shape, base + t.start, base + t.end) for t in header.tensors.values()}
        self._fd: int | None = None
        self._direct: DirectFile | None = None
        self._lock = threading.Lock()

    def truncated(self, name: str) -> bool:
        return self.tensors[name].end > self.size

    def _open(self, flags: int) -> int:
        fd = self.tree.open_read(self.rel, flags)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self._identity:
            os.close(fd)
            raise OutputError(f"{self.path}: was replaced while it was being checked; a writer changed OUT during "
                              f"this run", remedy=COMMAND_AGAIN.at(command="the check").after("let it finish"))
        return fd

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = advise_sequential(self._open(0))
            return self._fd

    def direct(self) -> DirectFile:
        with self._lock:
            if self._direct is None:
                self._direct = DirectFile(self.path, opener=self._open)
            return self._direct

    def read(self, name: str, a: int, b: int) -> np.ndarray:
        """Rows [a, b) of dim 0 as stored: uint8 [b-a, *shape[1:-1], shape[-1]*item] (1-D: bytes)."""
        t = self.tensors[name]
        return read_rows(self.fd(), t.start, t.shape, t.item, a, b)

    def manifest_digest(self, chunk_bytes: int = CHUNK_BYTES) -> str | None:
        """Its digest as the manifest records it (`output.manifest.file_digest`, what verify computes: over
        the header and each tensor's BLAKE3 in data order), or None when it ends inside a tensor (a finding
        of its own)."""
        digests = []
        with naming(self.path):  # a read the disk refuses names the file
            for ht in sorted(self.tensors.values(), key=lambda t: t.start):
                h = blake3(max_threads=blake3.AUTO)
                for pos in range(ht.start, ht.end, chunk_bytes):
                    chunk = os.pread(self.fd(), min(chunk_bytes, ht.end - pos), pos)
                    if len(chunk) != min(chunk_bytes, ht.end - pos):
                        return None
                    h.update(chunk)
                digests.append(h.hexdigest())
        return "blake3:" + file_digest(self.header, digests)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)
            if self._direct is not None:
                self._direct.close()
                self._direct = None


def byte_shape(shape: tuple[int, ...] | list[int], item: int) -> tuple[int, ...]:
    shape = tuple(shape)
    return (*shape[:-1], shape[-1] * item) if shape else (item,)


def read_rows(fd: int, start: int, shape: tuple[int, ...], item: int, a: int, b: int,
              into: np.ndarray | None = None) -> np.ndarray:
    """Rows [a, b) of a row-major tensor stored at absolute offset `start`, as bytes (into `into` if given)."""
    bshape = byte_shape(shape, item)
    row = int(np.prod(bshape[1:], dtype=np.int64)) if len(bshape) > 1 else item
    out_shape = (b - a, *bshape[1:]) if len(bshape) > 1 else ((b - a) * item,)
    buf = np.empty(out_shape, np.uint8) if into is None else into.reshape(out_shape)
    pread_into(fd, buf, start + a * row)
    return buf


_local = threading.local()


def advise_sequential(fd: int) -> int:
    """`fd`, with the kernel told to read ahead aggressively."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass
    return fd


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned (mmap-backed) byte buffer, as O_DIRECT needs; 2 MiB granules, huge pages asked for."""
    m = mmap.mmap(-1, max(ALIGN, -(-nbytes // (2 << 20)) * (2 << 20)))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, np.uint8)


def scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread reusable, page-aligned byte buffer (fresh 32 MiB arrays would page-fault on every chunk)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = aligned_buffer(max(nbytes, 1 << 20))
        setattr(_local, name, buf)
    return buf[:nbytes]


class ProofBufferPool:
    """Page-aligned buffers handed between threads (a chunk's source blocks), reused."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return aligned_buffer(nbytes)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))


class DirectFile:
    """A file read with positional O_DIRECT reads into aligned buffers (no page cache: no copy through
    it and none of its page faults), through the page cache where the filesystem refuses direct I/O."""

    def __init__(self, path: Path, direct: bool | None = None, opener: Callable[[int], int] | None = None):
        """`opener(flags)`: a read-only descriptor of the file with `flags` added (default: `path` opened)."""
        self.path = path
        self._opener = opener or (lambda flags: open_regular(path, follow=True, flags=flags))  # a source shard
        self.direct = (DIRECT if direct is None else direct) and hasattr(os, "O_DIRECT")
        self.fd = -1
        self._retired: list[int] = []
        self._lock = threading.Lock()
        if self.direct:
            try:
                self.fd = self._opener(os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd < 0:
            self.fd = advise_sequential(self._opener(0))

    def _buffered(self, fd: int) -> None:
        with self._lock:
            if self.direct and self.fd == fd:
                self._retired.append(fd)
                self.fd = advise_sequential(self._opener(0))
                self.direct = False

    @staticmethod
    def span(start: int, nbytes: int) -> int:
        """Bytes of buffer a read of [start, start + nbytes) needs (its ALIGN-aligned span)."""
        lo = start - start % ALIGN
        return -(-(start + nbytes) // ALIGN) * ALIGN - lo

    def read(self, start: int, nbytes: int, buf: np.ndarray) -> np.ndarray:
        """File bytes [start, start + nbytes) read into `buf` (page-aligned, at least span() bytes);
        returns the view of them in `buf`."""
        with naming(self.path):
            return self._read(start, nbytes, buf)

    def _read(self, start: int, nbytes: int, buf: np.ndarray) -> np.ndarray:
        fd, direct = self.fd, self.direct
        if not direct:
            view = buf[:nbytes]
            pread_into(fd, view, start)
            return view
        lo = start - start % ALIGN
        hi = -(-(start + nbytes) // ALIGN) * ALIGN
        mv = memoryview(buf)[:hi - lo]
        need = start + nbytes - lo
        got = 0
        while got < need:
            try:
                n = os.preadv(fd, [mv[got:]], lo + got)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                n = -1
            if n == 0:
                raise EOFError(f"{self.path}: short read at byte {lo + got}")
            if n < 0 or (n % ALIGN and got + n < need):  # refused, or an odd short read: go buffered
                self._buffered(fd)
                return self.read(start, nbytes, buf)
            got += n
        return buf[start - lo:start - lo + nbytes]

    def close(self) -> None:
        with self._lock:
            for fd in [self.fd, *self._retired]:
                if fd >= 0:
                    os.close(fd)
            self.fd = -1
            self._retired.clear()


def read_rows_direct(f: DirectFile, start: int, shape: tuple[int, ...], item: int, a: int, b: int,
                     name: str) -> np.ndarray:
    """`read_rows` through a DirectFile into the per-thread scratch buffer `name`."""
    bshape = byte_shape(shape, item)
    row = int(np.prod(bshape[1:], dtype=np.int64)) if len(bshape) > 1 else item
    out_shape = (b - a, *bshape[1:]) if len(bshape) > 1 else ((b - a) * item,)
    pos, n = start + a * row, (b - a) * row
    return f.read(pos, n, scratch(name, DirectFile.span(pos, n))).reshape(out_shape)


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"short read at byte {offset + done}")
        done += n


def row_chunks(n0: int, row_bytes: int, limit: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    step = max(1, limit // max(1, row_bytes))
    return [(a, min(a + step, n0)) for a in range(0, n0, step)] or [(0, 0)]
