"""A streaming safetensors writer: header first (known from the plan), then tensor bytes in order.

The safetensors library cannot write a file piece by piece, so this is the smallest correct
writer: the header lists tensors with contiguous data offsets in the order given, padded with
spaces to 8 bytes; bytes go to a temporary name, are flushed and fsynced, and the file is
renamed into place only when every byte was written. Each tensor is digested with BLAKE3 while
it streams; the file digest is BLAKE3 over the header and the tensor digests (so verifying a
file costs one pass over its data).

How bytes reach the disk (docs/evidence/performance.md has the measurements):

* Direct I/O first: the file is opened with O_DIRECT and bytes are staged in a page-aligned
  STAGE_BYTES buffer that is written whole, so the page cache (which on the 2-core box cost
  1-2 CPU-seconds per GB written, more than the disk time) is bypassed. The last block is padded
  to ALIGN and the file truncated to its exact size before the fsync.
* Where O_DIRECT is refused (tmpfs, some network filesystems: EINVAL at open or at a write), the
  writer falls back to buffered writes with write-behind: every WRITE_BEHIND bytes the kernel is
  told to start writing that window back (`sync_file_range`), so the disk works from the first
  window instead of when the dirty-page threshold is reached, and the fsync at close has little
  left to do; windows older than WRITE_DEPTH are waited for and dropped from the page cache
  (POSIX_FADV_DONTNEED), bounding dirty memory per file.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import mmap
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

from .. import stops
from ..formats.dtypes import DTYPE_SIZE
from ..formats.stheader import META_CONTENT, read_header
from ..guarded_io import Tree, partial_name
from ..output.manifest import CONTENT_PLACEHOLDER, file_digest

DIRECT = True  # try O_DIRECT first (module switch for experiments and tests)
ALIGN = 4096  # O_DIRECT offset, length and address alignment (covers 512 B and 4 KiB sectors)
STAGE_BYTES = 16 << 20  # direct-I/O staging buffer per open file
WRITE_BEHIND = 64 << 20  # buffered fallback: start writeback of every window of this many bytes
WRITE_DEPTH = 4  # windows in flight per file before the oldest is waited for and dropped
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4


def _sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZE[self.dtype] * int(np.prod(self.shape, dtype=np.int64))


def encode_header(tensors: list[TensorHeader], metadata: dict[str, str], align: int = 8) -> bytes:
    """The 8-byte length prefix and JSON header, deterministic for the same input; padded with
    spaces so the data section starts at a multiple of `align` bytes."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return len(raw).to_bytes(8, "little") + raw


@dataclass(frozen=True)
class WrittenFile:
    path: Path
    bytes: int
    digest: str
    tensor_digests: dict[str, str]
    published: bool = True  # False: only hashed (`StreamHasher`), no file was written


class StreamHasher:
    """The digests of safetensors file `path` as its bytes stream in tensor by tensor, without
    writing it: each tensor's BLAKE3 and the file digest over the header and those (`file_digest`).
    `StreamWriter` is this plus the file; a node's convert (`--ranks`) hashes the other ranks' files
    with it alone, for the manifest that lists every rank."""

    def __init__(self, path: Path, tensors: list[TensorHeader], metadata: dict[str, str], align: int = 8):
        self.path = path
        self.tensors = tensors
        self.header = encode_header(tensors, metadata, align)
        self.size = len(self.header) + sum(t.nbytes for t in tensors)
        self._index = 0
        self._left = tensors[0].nbytes if tensors else 0
        self._hash = blake3()
        self.digests: dict[str, str] = {}

    def write(self, name: str, data: np.ndarray | bytes | memoryview) -> memoryview:
        """Hash bytes of tensor `name`, which must be the tensor being written; the bytes as a view."""
        view = memoryview(data).cast("B")
        current = self.tensors[self._index] if self._index < len(self.tensors) else None
        if current is None or current.name != name or len(view) > self._left:
            raise AssertionError(f"{self.path.name}: write of {len(view)} bytes for {name!r} out of order")
        self._hash.update(view)
        self._left -= len(view)
        while self._left == 0 and self._index < len(self.tensors):
            self.digests[current.name] = self._hash.hexdigest()
            self._hash = blake3()
            self._index += 1
            if self._index < len(self.tensors):
                current = self.tensors[self._index]
                self._left = current.nbytes
        return view

    def _restamp(self, content: str) -> tuple[int, bytes]:
        """Put the content stamp over its placeholder in the header (same length: nothing moves); its
        offset and bytes. The stamp is known only once every source byte of the file was read."""
        key = f'"{META_CONTENT}":"'.encode()
        at = self.header.index(key + CONTENT_PLACEHOLDER.encode()) + len(key)
        value = content.encode()
        if len(value) != len(CONTENT_PLACEHOLDER):
            raise AssertionError(f"content stamp {content!r} is not {len(CONTENT_PLACEHOLDER)} characters")
        self.header = self.header[:at] + value + self.header[at + len(value):]
        return at, value

    def _finished(self) -> None:
        if self._index != len(self.tensors):
            raise AssertionError(f"{self.path.name}: closed before {self.tensors[self._index].name} was written")

    def _result(self, published: bool) -> WrittenFile:
        digests = [self.digests[t.name] for t in self.tensors]
        return WrittenFile(self.path, self.size, file_digest(self.header, digests), dict(self.digests), published)

    def close(self, content: str | None = None) -> WrittenFile:
        """The file's digests as if written; `content` fills the header's content stamp placeholder."""
        self._finished()
        if content is not None:
            self._restamp(content)
        return self._result(published=False)

    def abort(self) -> None:
        """Nothing to remove: no file was made."""


class StreamWriter(StreamHasher):
    """Write one safetensors file `rel` under `tree` tensor by tensor, into a new temporary file
    (`Tree.open_new`: no link followed, nothing overwritten), hashing it as `StreamHasher` does;
    `close()` publishes it atomically."""

    def __init__(self, tree: Tree, rel: str, tensors: list[TensorHeader], metadata: dict[str, str],
                 write_behind: int | None = None, direct: bool | None = None, align: int = 8):
        super().__init__(tree.path(rel), tensors, metadata, align)
        self.tree, self.rel = tree, rel
        self._tmp_rel = partial_name(rel)
        self._tmp = tree.path(self._tmp_rel)
        self._fd: int | None = None
        self._tmp_created = False  # abort removes only a temporary file this writer made
        self._direct = False
        self._stage = None
        try:
            if (DIRECT if direct is None else direct) and hasattr(os, "O_DIRECT"):
                try:
                    self._fd = tree.open_new(self._tmp_rel, os.O_DIRECT)
                    self._direct = True
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    tree.remove(self._tmp_rel)  # some filesystems create the file before refusing O_DIRECT
            if self._fd is None:
                self._fd = tree.open_new(self._tmp_rel)
            self._tmp_created = True
            self._was_direct = self._direct
            self._stage = np.frombuffer(mmap.mmap(-1, STAGE_BYTES), np.uint8) if self._direct else None
            self._fill = 0  # staged bytes not yet written
            self._pos = 0  # bytes handed to the file
            self._behind = WRITE_BEHIND if write_behind is None else write_behind
            self._started = 0  # buffered: bytes before this offset were handed to writeback
            self._windows: deque[tuple[int, int]] = deque()
            self._emit(memoryview(self.header))
        except BaseException:  # nothing half-made stays behind (an error, or Ctrl-C right here)
            self.abort()
            raise

    def _emit(self, view: memoryview) -> None:
        """Append bytes to the file: through the stage with direct I/O, else straight away."""
        if not self._direct:
            return self._raw_write(view)
        src = np.frombuffer(view, np.uint8)
        i = 0
        while i < len(src):
            n = min(len(src) - i, STAGE_BYTES - self._fill)
            self._stage[self._fill:self._fill + n] = src[i:i + n]
            self._fill += n
            i += n
            if self._fill == STAGE_BYTES:
                self._flush_stage(STAGE_BYTES)
                if not self._direct:  # fell back to buffered writes: no more staging
                    return self._raw_write(view[i:])

    def _flush_stage(self, n: int) -> None:
        view = memoryview(self._stage)[:n]
        self._fill = 0
        self._raw_write(view)

    def _buffered(self) -> None:
        """Leave direct I/O for the rest of the file (the filesystem refused it, or a short write
        left the offset unaligned); the next write then fails with the filesystem's own error."""
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False
        if self._fill:  # staged bytes go first
            self._flush_stage(self._fill)

    def _raw_write(self, view: memoryview) -> None:
        done = 0
        try:
            while done < len(view):
                try:
                    n = os.write(self._fd, view[done:])
                except OSError as e:
                    if self._direct and e.errno == errno.EINVAL:
                        self._buffered()
                        continue
                    raise
                done += n
                if self._direct and n % ALIGN and done < len(view):
                    self._buffered()
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self._tmp)) from None  # the caller knows what is left to write
        self._pos += done
        if not self._direct and self._behind and _SFR is not None and self._pos - self._started >= self._behind:
            self._write_behind()

    def _write_behind(self) -> None:
        start, end = self._started, self._pos
        self._started = end
        if _SFR(self._fd, start, end - start, _SFR_WRITE) != 0:
            return  # not supported here: the fsync at close does all the work
        self._windows.append((start, end))
        while len(self._windows) > WRITE_DEPTH:
            s, e = self._windows.popleft()
            if _SFR(self._fd, s, e - s, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER) == 0:
                os.posix_fadvise(self._fd, s, e - s, os.POSIX_FADV_DONTNEED)

    def write(self, name: str, data: np.ndarray | bytes | memoryview) -> memoryview:
        """Append bytes of tensor `name`, which must be the tensor being written."""
        view = super().write(name, data)
        self._emit(view)
        return view

    def _stamp(self, content: str) -> None:
        """Write the content stamp over its placeholder in the file's header."""
        at, value = self._restamp(content)
        if self._direct:  # a small unaligned write: through the page cache
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self._direct = False
        if os.pwrite(self._fd, value, at) != len(value):
            raise OSError(errno.EIO, "short write of the content stamp", str(self._tmp))

    def close(self, content: str | None = None) -> WrittenFile:
        """Finish and publish the file; `content` fills the header's content stamp placeholder."""
        self._finished()
        if self._fill:  # direct I/O: the last block, zero-padded to ALIGN, then cut to the real size
            n = -(-self._fill // ALIGN) * ALIGN
            self._stage[self._fill:n] = 0
            self._flush_stage(n)
        try:
            if self._was_direct:
                os.ftruncate(self._fd, self.size)
            if content is not None:
                self._stamp(content)
            os.fsync(self._fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self._tmp)) from None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written and synced: clean, droppable
        fd, self._fd = self._fd, None  # before the close: never closed twice, even if the close fails
        os.close(fd)
        self._stage = None
        self.tree.rename(self._tmp_rel, self.rel)
        return self._result(published=True)

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._stage = None
        if self._tmp_created:
            self.tree.remove(self._tmp_rel)


def hash_file(tree: Tree, rel: str, block: int = 16 << 20) -> tuple[str, dict[str, str]]:
    """Recompute a file's digest and its tensors' digests exactly as StreamWriter records them."""
    fd = tree.open_read(rel)
    try:
        header = read_header(tree.path(rel), fd=fd)
        digests: dict[str, str] = {}
        for name, t in header.tensors.items():  # in data order
            pos, end = header.data_start + t.start, header.data_start + t.end
            h = blake3(max_threads=blake3.AUTO)
            while pos < end:
                stops.check()  # a --resume's survey of a large output stops between blocks
                data = os.pread(fd, min(block, end - pos), pos)
                if not data:
                    raise ValueError(f"{tree.path(rel)}: truncated inside tensor {name!r}")
                h.update(data)
                pos += len(data)
            digests[name] = h.hexdigest()
    finally:
        os.close(fd)
    return file_digest(header.block, list(digests.values())), digests
