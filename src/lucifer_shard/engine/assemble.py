"""Build per-rank tensor bytes from source regions, chunk by chunk, reading each region once.

A chunk is a range of the target tensor's first dim (experts for stacked expert tensors, rows
otherwise). For one chunk, every rank's pieces are resolved to source boxes and the boxes to byte
ranges of the shards, at the offsets of the headers that `source.open_checkpoint` validated:

* a box that is one contiguous byte range of its tensor (column-parallel slices, whole experts'
  w1/w3 rows, replicated tensors) is read as that range;
* otherwise (row-parallel slices along the last dim, dtype narrowing) its bounding rows are read;
* ranges of the same tensor that touch or overlap (the ranks' slices tile it) merge into one read,
  so each source byte is read once per chunk and fanned out to every rank with numpy.

Reads are positional (`os.preadv`) with O_DIRECT into page-aligned buffers where the filesystem
allows it (else buffered, with POSIX_FADV_SEQUENTIAL), and run on a reader thread PREFETCH
chunks ahead of assembly, so the disk never waits for the CPU and the page cache (which on the
2-core box cost more CPU than the disk took time) is bypassed. Only pad tails are filled with the
pad value; pieces tile every other byte. Output buffers are uint8 in model layout, last dim in
bytes, taken from a pool so that no chunk pays page faults, and returned to it by the writer once
written.

Why not `safetensors.safe_open`: it memory-maps each shard, and every page touched stays in the
process's resident set until the handle closes, so peak RSS grew with the model (9 GiB for one
Flash layer); positional reads into pooled buffers keep it at a few chunks.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import CONVERT_RESUME, ENVIRONMENT_ERRNOS, EnvironmentRefused, SourceError
from ..formats.dtypes import CONVERSIONS, convert_bytes, DTYPE_SIZE
from ..guarded_io import open_regular
from ..model.tensorspecs import TensorSpec
from ..source.checkpoint import Checkpoint
from ..source.content import ContentDigests

CHUNK_BYTES = 16 << 20
DIRECT = True  # read with O_DIRECT where the filesystem allows it
ALIGN = 4096  # O_DIRECT offset, length and address alignment
PREFETCH = 2  # chunks whose reads run ahead of assembly
READERS = 4  # reader threads: concurrent requests keep a virtio/NVMe queue busy
READ_BLOCK = 8 << 20  # largest single read
_FADVISE = hasattr(os, "posix_fadvise")


def chunks(spec: TensorSpec, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """Ranges of dim 0 whose model-layout bytes stay near `chunk_bytes` (at least one index)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    n0 = spec.shape[0]
    per = max(1, spec.nbytes // max(1, n0))
    step = max(1, chunk_bytes // per)
    return [(a, min(a + step, n0)) for a in range(0, n0, step)]


# ---------------------------------------------------------------- boxes


def _boxes(spec: TensorSpec, a: int, b: int, tail: bool) -> list[tuple[str, tuple, tuple]]:
    """(source key, source box, chunk box) of each piece for chunk [a, b), or with `tail` of each
    piece's pad tail (its source box then means nothing). Boxes are in elements; stacked experts
    have an int expert index first in the chunk box."""
    out = []
    for p in spec.pieces:
        d0, d1 = (p.dst_start + p.length, p.dst_start + p.seg_len) if tail else (p.dst_start, p.dst_start + p.length)
        if d1 <= d0:
            continue
        s0 = p.src_start + d0 - p.dst_start
        if spec.experts:
            m = len(spec.matrix_shape)
            for e in range(a, b):
                src = [slice(None)] * m
                dst: list[slice | int] = [e - a] + [slice(None)] * m
                src[p.dim] = slice(s0, s0 + d1 - d0)
                dst[1 + p.dim] = slice(d0, d1)
                out.append((p.source.format(e=e), tuple(src), tuple(dst)))
            continue
        n = len(spec.shape)
        src = [slice(None)] * n
        dst = [slice(None)] * n
        if p.dim == 0:
            lo, hi = max(a, d0), min(b, d1)
            if lo >= hi:
                continue
            src[0] = slice(s0 + lo - d0, s0 + hi - d0)
            dst[0] = slice(lo - a, hi - a)
        else:
            src[0] = slice(a, b)
            dst[0] = slice(0, b - a)
            src[p.dim] = slice(s0, s0 + d1 - d0)
            dst[p.dim] = slice(d0, d1)
        out.append((p.source, tuple(src), tuple(dst)))
    return out


def _norm(box: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Box -> [start, stop) per dim (an int index is a length-1 range)."""
    out = []
    for s, n in zip(box, shape):
        if isinstance(s, int):
            out.append((s, s + 1))
        else:
            start, stop, _ = s.indices(n)
            out.append((start, stop))
    return out


def _contiguous(ranges: list[tuple[int, int]], shape: tuple[int, ...]) -> bool:
    """Whether a box is one contiguous run of a C-ordered array: every dim before the last partial
    one has length 1 (the dims after it are whole by definition)."""
    lengths = [e - s for s, e in ranges]
    partial = [d for d, n in enumerate(shape) if lengths[d] != n]
    return not partial or all(x == 1 for x in lengths[:partial[-1]])


def _linear(ranges: list[tuple[int, int]], shape: tuple[int, ...]) -> int:
    """Element offset of a box's first element in a C-ordered array."""
    off = 0
    for (s, _), n in zip(ranges, shape):
        off = off * n + s
    return off


def _byte_box(box: tuple, item: int, last: int) -> tuple:
    """Element box -> byte box (only the last dim scales)."""
    s = box[-1]
    start, stop = (s, s + 1) if isinstance(s, int) else s.indices(last)[:2]
    return (*box[:-1], slice(start * item, stop * item))


def _fill(view: np.ndarray, pad: bytes) -> None:
    if len(pad) == 1:
        view[...] = pad[0]
    else:
        view.reshape(*view.shape[:-1], view.shape[-1] // len(pad), len(pad))[...] = np.frombuffer(pad, np.uint8)


# ---------------------------------------------------------------- buffers and reads


class EngineBufferPool:
    """Reusable uint8 chunk buffers of one capacity (larger requests get a private array)."""

    def __init__(self, capacity: int | None = None, keep: int = 16):
        self.capacity = CHUNK_BYTES if capacity is None else capacity
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        if n > self.capacity:
            return np.empty(shape, np.uint8)
        with self._lock:
            base = self._free.pop() if self._free else None
        if base is None:
            base = np.empty(self.capacity, np.uint8)
        return base[:n].reshape(shape)

    def give(self, arr: np.ndarray) -> None:
        base = arr.base if arr.base is not None else arr
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if isinstance(base, np.ndarray) and base.nbytes == self.capacity and base.ndim == 1:
            with self._lock:
                if len(self._free) < self.keep:
                    self._free.append(base)


class ReadBuffers:
    """Page-aligned (mmap-backed) read buffers, reused; O_DIRECT needs the alignment."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= n]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        m = mmap.mmap(-1, max(ALIGN, -(-n // (2 << 20)) * (2 << 20)))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)  # bigger physically contiguous segments per disk request
        return np.frombuffer(m, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))


@dataclass
class _Segment:
    """One read: bytes [start, end) of tensor `key`'s data, at file offset `pos`. In the chunk's
    read buffer its ALIGN-aligned span starts at `at`, so its bytes start at at + pos % ALIGN."""

    key: str
    start: int
    end: int
    pos: int = 0
    at: int = 0

    @property
    def span(self) -> int:
        lo = self.pos - self.pos % ALIGN
        return -(-(self.pos + self.end - self.start) // ALIGN) * ALIGN - lo


@dataclass
class _Plan:
    """Everything one chunk needs: its reads, and per rank buffer what to copy from them."""

    specs: list[TensorSpec]
    a: int
    b: int
    segments: list[_Segment]
    # (segment index, byte offset in the segment, source box ranges, [(rank, dst box), ...], strided?)
    copies: list[tuple[int, int, list[tuple[int, int]], list[tuple[int, tuple]], bool]]
    size: int = 0  # bytes of the read buffer


class EngineSourceReader:
    """Positional reads of source byte ranges, one descriptor per shard, O_DIRECT where allowed.
    Thread-safe: the reads of one chunk run on several threads at once."""

    def __init__(self, ckpt: Checkpoint, direct: bool | None = None):
        self.ckpt = ckpt
        self.direct = (DIRECT if direct is None else direct) and hasattr(os, "O_DIRECT")
        self._fds: dict[str, tuple[int, int, bool]] = {}
        self._retired: list[int] = []  # descriptors replaced while other threads may still use them
        self._lock = threading.Lock()

    def _open(self, file: str, direct: bool) -> tuple[int, int, bool]:
        path = self.ckpt.root / file
        base = self.ckpt.data_start[file]  # as validated: the header is not read twice
        if direct:
            try:
                return open_regular(path, follow=True, flags=os.O_DIRECT), base, True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        fd = open_regular(path, follow=True)
        if _FADVISE:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd, base, False

    def _fd(self, file: str) -> tuple[int, int, bool]:
        with self._lock:
            got = self._fds.get(file)
            if got is None:
                got = self._fds[file] = self._open(file, self.direct)
            return got

    def _buffered(self, file: str, fd: int) -> None:
        """The filesystem refused a direct read: this shard is read through the page cache."""
        with self._lock:
            if self._fds[file][0] == fd and self._fds[file][2]:
                self._retired.append(fd)
                self._fds[file] = self._open(file, False)

    def base(self, file: str) -> int:
        """File offset of the shard's data section."""
        return self._fd(file)[1]

    def jobs(self, seg: _Segment, buf: np.ndarray) -> list[tuple]:
        """`seg` as reads of at most READ_BLOCK bytes (arguments of `read_range`): its aligned span
        lands at buf[seg.at:], so file byte x goes to buf[seg.at + x - lo]."""
        file = self.ckpt.tensors[seg.key].file
        lo = seg.pos - seg.pos % ALIGN
        hi = lo + seg.span
        stop = seg.pos + seg.end - seg.start
        out = []
        for x0 in range(lo, hi, READ_BLOCK):
            x1 = min(hi, x0 + READ_BLOCK)
            out.append((file, seg.key, x0, x1, max(x0, seg.pos), min(x1, stop), buf, seg.at + x0 - lo))
        return out

    def read_range(self, file: str, key: str, x0: int, x1: int, need0: int, need1: int, buf: np.ndarray,
                   at: int) -> None:
        """File bytes [x0, x1) (ALIGN-aligned) into buf[at:]; [need0, need1) must arrive (the rest is
        alignment slop, and may lie past the end of the file). Buffered reads fetch just the need."""
        fd, _, direct = self._fd(file)
        if not direct:
            at += need0 - x0
            x0, x1 = need0, need1
        view = memoryview(buf)[at:at + x1 - x0]
        need = need1 - x0
        got = 0
        while got < need:
            try:
                n = os.preadv(fd, [view[got:]], x0 + got)
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    self._buffered(file, fd)
                    return self.read_range(file, key, x0, x1, need0, need1, buf, at)
                raise read_failed(self.ckpt.root / file, key, e) from None
            if n == 0:
                raise SourceError(f"{file}: truncated inside tensor {key!r}; re-download this shard")
            got += n
            if direct and n % ALIGN and got < need:  # a short direct read at an odd size: redo it buffered
                self._buffered(file, fd)
                return self.read_range(file, key, x0, x1, need0, need1, buf, at)

    def close(self) -> None:
        with self._lock:
            fds = [f for f, _, _ in self._fds.values()] + self._retired
            self._fds.clear()  # forgotten first: a failing close is never retried on another thread's number
            self._retired.clear()
            for fd in fds:
                os.close(fd)


def read_failed(path: Path, key: str, e: OSError) -> EnvironmentRefused:
    """A source read the machine refused (EIO of a failing disk or mount): a fault of the environment,
    not of the checkpoint, so nothing finished is given up; `--resume` goes on once it reads again."""
    why = ENVIRONMENT_ERRNOS.get(e.errno, "the system refused the read")
    return EnvironmentRefused(f"{path}: reading tensor {key!r} failed ({e.strerror}); finished files are kept",
                              remedy=CONVERT_RESUME.after(f"once the file reads again ({why})"))


def _check_scales(data: np.ndarray, key: str, entry, start: int) -> None:
    """Refuse E8M0 0xFF (NaN) bytes; `data` are bytes [start, ...) of the tensor's data."""
    if data.size and int(data.max()) == 0xFF:
        first = start + int(np.argmax(data == 0xFF))
        idx = [int(i) for i in np.unravel_index(first, entry.shape)] if entry.shape else [first]
        raise SourceError(f"{entry.file}: tensor {key!r} has E8M0 scale byte 0xFF (NaN) at {idx}; "
                          f"refusing to write a NaN scale")


def _convert(raw: np.ndarray, src: str, dst: str, key: str, file: str, n_experts: int) -> np.ndarray:
    """Source bytes as the rank tensor's dtype (formats/dtypes.CONVERSIONS); I64 holds expert ids (tid2eid),
    refused outside [0, n_experts)."""
    if src == "I64":
        v = np.ascontiguousarray(raw).view(np.int64)
        if v.size and (int(v.min()) < 0 or int(v.max()) >= n_experts):
            raise SourceError(f"{file}: tensor {key!r} holds expert ids outside [0, {n_experts}); cannot narrow to I32")
    return convert_bytes(raw, src, dst)


# ---------------------------------------------------------------- assembly


def swap_folded(spec: TensorSpec) -> TensorSpec | None:
    """`spec` with its two fused halves placed swapped (the `swap_halves` layout step done while
    assembling instead of as a copy afterwards), or None when the spec is not two equal halves."""
    if not spec.experts or len(spec.pieces) != 2:
        return None
    p0, p1 = spec.pieces
    half = spec.matrix_shape[0] // 2
    if not (p0.dim == p1.dim == 0 and p0.seg_len == p1.seg_len == half and p0.dst_start == 0
            and p1.dst_start == half and 2 * half == spec.matrix_shape[0]):
        return None
    return replace(spec, pieces=(replace(p0, dst_start=half), replace(p1, dst_start=0)))


class Assembler:
    """Plans each chunk's reads, runs them on reader threads ahead of time, and builds every
    rank's chunk buffer from them (one copy out of the read buffer, or a strided gather)."""

    def __init__(self, ckpt: Checkpoint, pool: EngineBufferPool | None = None, direct: bool | None = None,
                 prefetch: int | None = None, digests: ContentDigests | None = None):
        self.ckpt = ckpt
        self.reader = EngineSourceReader(ckpt, direct)
        self.digests = digests  # fed every source byte as it arrives (the content fingerprint)
        self.pool = pool or EngineBufferPool()
        self.reads = ReadBuffers()
        self.prefetch = PREFETCH if prefetch is None else prefetch
        self._thread = (ThreadPoolExecutor(READERS, thread_name_prefix="lucifer-read") if self.prefetch
                        else None)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.reader.close()

    # -- planning

    def plan(self, specs: list[TensorSpec], a: int, b: int) -> _Plan:
        """The reads of chunk [a, b) of the same tensor on every rank (each spec may carry swapped
        pieces, see `swap_folded`), merged per source key."""
        by_key: dict[str, list[tuple[int, tuple, tuple]]] = {}
        for i, spec in enumerate(specs):
            for key, src, dst in _boxes(spec, a, b, tail=False):
                by_key.setdefault(key, []).append((i, src, dst))
        convert = (specs[0].src_dtype, specs[0].dtype) in CONVERSIONS
        segments: list[_Segment] = []
        copies = []
        for key, group in by_key.items():
            entry = self.ckpt.tensors[key]
            shape = entry.shape if entry.shape else (1,)
            item = DTYPE_SIZE[entry.dtype]
            row = item * int(np.prod(shape[1:], dtype=np.int64))
            wants: dict[tuple, list] = {}  # (start, end, source box, strided) -> [(rank, dst box)]
            for i, src, dst in group:
                sr = _norm(src, shape)
                if not convert and _contiguous(sr, shape):
                    n = item
                    for s, e in sr:
                        n *= e - s
                    start = _linear(sr, shape) * item
                    wants.setdefault((start, start + n, tuple(sr), False), []).append((i, dst))
                else:
                    wants.setdefault((sr[0][0] * row, sr[0][1] * row, tuple(sr), True), []).append((i, dst))
            spans = sorted({(s, e) for s, e, _, _ in wants})
            merged: list[list[int]] = []
            for s, e in spans:
                if merged and s <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], e)
                else:
                    merged.append([s, e])
            first = len(segments)
            segments.extend(_Segment(key, s, e) for s, e in merged)
            for (s, e, sr, strided), dsts in wants.items():
                j = first + next(k for k, (ms, me) in enumerate(merged) if ms <= s and e <= me)
                copies.append((j, s - segments[j].start, list(sr), dsts, strided))
        size = 0
        for seg in segments:
            seg.pos = self.reader.base(self.ckpt.tensors[seg.key].file) + self.ckpt.tensors[seg.key].offsets[0] + seg.start
            seg.at = size
            size += seg.span
        return _Plan(specs, a, b, segments, copies, size)

    # -- reading

    def _start(self, plan: _Plan) -> tuple[np.ndarray, list]:
        """Begin the chunk's reads (on the reader threads, or here without prefetching)."""
        buf = self.reads.take(plan.size)
        digest = not plan.specs[0].alias  # an alias re-reads bytes its owner's spec digests
        jobs = [(*j, digest) for seg in plan.segments for j in self.reader.jobs(seg, buf)]
        if self._thread is None:
            try:
                for j in jobs:
                    self._read(*j)
            except BaseException:
                self.reads.give(buf)
                raise
            return buf, []
        return buf, [self._thread.submit(self._read, *j) for j in jobs]

    def _read(self, file: str, key: str, x0: int, x1: int, need0: int, need1: int, buf: np.ndarray,
              at: int, digest: bool = True) -> None:
        """One read job, then its bytes into the content digest (on the reader thread: hashing overlaps
        assembly and writing)."""
        self.reader.read_range(file, key, x0, x1, need0, need1, buf, at)
        if self.digests is not None and digest:
            start = self.reader.base(file) + self.ckpt.tensors[key].offsets[0]
            self.digests.feed(key, need0 - start, buf[at + need0 - x0:at + need1 - x0])

    def _wait(self, buf: np.ndarray, futs: list) -> None:
        """Wait for a chunk's reads; on failure wait for all of them, free the buffer, raise."""
        try:
            for f in futs:
                f.result()
        except BaseException:
            for f in futs:
                f.cancel()
            for f in futs:
                try:
                    f.result()
                except BaseException:
                    pass
            self.reads.give(buf)
            raise

    @staticmethod
    def _data(plan: _Plan, buf: np.ndarray, j: int) -> np.ndarray:
        """Segment j's bytes inside the read buffer."""
        seg = plan.segments[j]
        at = seg.at + seg.pos % ALIGN
        return buf[at:at + seg.end - seg.start]

    # -- building

    def build(self, plan: _Plan, buf: np.ndarray) -> list[np.ndarray]:
        specs, a, b = plan.specs, plan.a, plan.b
        spec0 = specs[0]
        item = DTYPE_SIZE[spec0.dtype]
        out = []
        for spec in specs:
            shape = list(spec.shape)
            shape[0] = b - a
            shape[-1] *= item
            rank_buf = self.pool.take(tuple(shape))
            for _, _, dst in _boxes(spec, a, b, tail=True):
                _fill(rank_buf[_byte_box(dst, item, spec.shape[-1])], spec.pad)
            out.append(rank_buf)
        if spec0.src_dtype == "F8_E8M0":
            for j, seg in enumerate(plan.segments):
                _check_scales(self._data(plan, buf, j), seg.key, self.ckpt.tensors[seg.key], seg.start)
        for j, off, sr, dsts, strided in plan.copies:
            seg = plan.segments[j]
            entry = self.ckpt.tensors[seg.key]
            shape = entry.shape if entry.shape else (1,)
            src_item = DTYPE_SIZE[entry.dtype]
            data = self._data(plan, buf, j)
            if not strided:
                n = src_item
                for s, e in sr:
                    n *= e - s
                box = data[off:off + n].reshape(*[e - s for s, e in sr[:-1]], -1)
                for i, dst in dsts:
                    out[i][_byte_box(dst, item, specs[i].shape[-1])] = box
                continue
            rows = sr[0][1] - sr[0][0]
            region = data[off:off + rows * src_item * int(np.prod(shape[1:], dtype=np.int64))]
            region = region.reshape(rows, *shape[1:-1], shape[-1] * src_item)
            if src_item != item:
                region = _convert(region, entry.dtype, spec0.dtype, seg.key, entry.file,
                                  self.ckpt.config.n_experts).reshape(
                    rows, *shape[1:-1], shape[-1] * item)
            local = tuple([slice(0, rows)] + [slice(s, e) for s, e in sr[1:]])
            for i, dst in dsts:
                out[i][_byte_box(dst, item, specs[i].shape[-1])] = region[_byte_box(local, item, shape[-1])]
        return out

    def chunk(self, specs: list[TensorSpec], a: int, b: int) -> list[np.ndarray]:
        """Model-layout bytes of rows [a, b) of the same tensor on every rank."""
        plan = self.plan(specs, a, b)
        buf, futs = self._start(plan)
        self._wait(buf, futs)
        try:
            return self.build(plan, buf)
        finally:
            self.reads.give(buf)

    def stream(self, items):
        """For (tag, specs, a, b) items in order, yield (tag, rank buffers); the reads of the next
        PREFETCH items run on the reader threads meanwhile."""
        items = iter(items)
        ahead: deque = deque()

        def submit() -> None:
            item = next(items, None)
            if item is not None:
                tag, specs, a, b = item
                plan = self.plan(specs, a, b)
                ahead.append((tag, plan, *self._start(plan)))

        for _ in range(max(1, self.prefetch)):
            submit()
        try:
            while ahead:
                tag, plan, buf, futs = ahead.popleft()
                submit()
                self._wait(buf, futs)
                try:
                    bufs = self.build(plan, buf)
                finally:
                    self.reads.give(buf)
                yield tag, bufs
        finally:
            while ahead:  # stopped early (an error): let queued reads finish, free their buffers
                _, _, buf, futs = ahead.popleft()
                try:
                    self._wait(buf, futs)
                    self.reads.give(buf)
                except BaseException:
                    pass


def assemble(ckpt: Checkpoint, specs: list[TensorSpec], a: int, b: int) -> list[np.ndarray]:
    """Model-layout bytes of rows [a, b) of the same tensor on every rank; each source box read once.
    (A one-off `Assembler`; the engine streams through one per part.)"""
    asm = Assembler(ckpt, EngineBufferPool(capacity=0), prefetch=0)
    try:
        return asm.chunk(specs, a, b)
    finally:
        asm.close()
