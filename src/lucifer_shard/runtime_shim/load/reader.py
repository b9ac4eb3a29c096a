"""Rank-file tensors read straight into parameter storage, optionally hashed as they land.

Each tensor is cut into chunks (`CHUNK`, 16 MiB) read with positional reads (`os.preadv`, which
releases the GIL) at the offset its file's header gives, by a small pool of reader threads
(`THREADS`: 4, fewer on a machine with fewer cores): several reads are in flight at once, of the
same tensor or the next ones. The calling thread hands out the chunks in file order and collects
them in that order, so an error is the one a serial reader would have met first, and every thread
is joined before it is raised.

A contiguous CPU destination is filled in place: one copy, page cache to parameter, as `cat` does,
with no mmap page faults, no intermediate tensor and no file pages held in the process's RSS. Any
other destination (a GPU parameter) is filled through a ring of `SLOTS` host buffers of `CHUNK`
bytes, pinned for CUDA: each chunk read into a slot is copied to the device asynchronously
(`non_blocking`) on a dedicated CUDA stream, and a CUDA event per slot keeps the slot from being read
into again before its copy finished. Pinned memory is bounded by `PINNED_BOUND_MIB` (8 x 16 MiB =
128 MiB) per call; `slots`/`chunk` change it (the GPU benchmark does).

With `digests=True` each tensor's BLAKE3 is computed where its bytes land. A GPU parameter is hashed
on its GPU (`device_blake3`, Triton) once its last chunk's copy is done, on a stream of its own so the
next tensors' copies go on meanwhile: on the host, that hash was a fourth pass over memory per byte and
cost 18-25% of a warm load (docs/evidence/performance.md). The rest (CPU destinations, tensors of one KiB or
less, lengths not a whole number of words, no Triton) are hashed on the host: one hashing thread
computes BLAKE3 over every chunk as it lands, in file order (so each tensor's chunks reach its hasher
in byte order); blake3 releases the GIL and, with `max_threads=AUTO`, spreads one 16 MiB update over
the cores, so hashing overlaps reading instead of following it. A slot is reused only once both its
copy and its host hash are done.

Reads stay buffered (no O_DIRECT): a restart mostly finds the rank files in the page cache, where
O_DIRECT would re-read the disk; cold, the disk is the limit for both (issue 41's table: buffered
1.54-1.57 GB/s against 1.50 for four O_DIRECT streams), and the reads in flight here supply the
concurrency that put runai-model-streamer ahead there.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from lucifer_shard.guarded_io import open_regular

from lucifer_shard.errors import CONVERT_RESUME, DOCTOR, VERIFY

from ..errors import ShimError

logger = logging.getLogger("lucifer_shard.runtime_shim")
CHUNK = 16 << 20  # bytes per read (and per ring slot)
SLOTS = 8  # ring slots: chunks read, being copied or being hashed at once
# reads in flight at once (os.preadv releases the GIL); no more than the cores we may run on: each
# read is a CPU copy out of the page cache, and more readers than cores only take turns
THREADS = min(4, len(os.sched_getaffinity(0)))
PINNED_BOUND_MIB = SLOTS * CHUNK >> 20  # host (pinned) memory a device load holds: 128 MiB
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) PMD size: the unit MADV_HUGEPAGE can fault in


@dataclass(frozen=True)
class TensorRead:
    name: str
    offset: int  # absolute file offset of the tensor's first byte
    dst: torch.Tensor  # contiguous destination whose bytes are exactly the tensor's

    @property
    def nbytes(self) -> int:
        return self.dst.numel() * self.dst.element_size()


@dataclass(frozen=True)
class _Chunk:
    name: str
    offset: int  # absolute file offset of the chunk's first byte
    dst: torch.Tensor  # the chunk's bytes of the destination (flat uint8)
    host: memoryview | None  # the same bytes when the destination is read in place, else None
    last: bool  # the tensor's last chunk


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (same memory)."""
    return t.reshape(-1).view(torch.uint8)


def in_place(t: torch.Tensor, staged: bool | None = None) -> bool:
    """Whether reads land in `t` itself (a CPU tensor, unless `staged` says otherwise)."""
    return t.device.type == "cpu" if staged is None else not staged


def read_tensors(path: Path, reads: list[TensorRead], digests: bool = False,
                 staged: bool | None = None, fd: int | None = None, *, threads: int = THREADS,
                 slots: int = SLOTS, chunk: int | None = None, hash_on_device: bool = True) -> dict[str, str]:
    """Fill every read's destination from `path` (from `fd` when given, which stays open); with
    `digests`, the BLAKE3 hex digest of each tensor's bytes (of a GPU destination's, hashed there
    unless `hash_on_device` is False: the benchmark compares both). `staged` forces (True) or forbids
    (False) the host-buffer path that non-CPU destinations take (tests use it to exercise that path
    on CPU). `threads` reads in flight, `slots` ring slots of `chunk` bytes (default `CHUNK`)."""
    reads = sorted(reads, key=lambda r: r.offset)
    for r in reads:
        if not r.dst.is_contiguous():
            raise ShimError(f"parameter {r.name} is not contiguous in memory; this vLLM build lays out parameters "
                            f"differently, use a supported build", DOCTOR.at(out="OUT"))
    if chunk is not None and chunk < 1:
        raise ShimError(f"{path}: chunk size {chunk}: reads need a chunk of at least one byte")
    own = fd is None
    if own:
        fd = open_regular(path)
    try:
        _refuse_outside(path, os.fstat(fd).st_size, reads)
        _advise_huge_pages([r for r in reads if in_place(r.dst, staged)])
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        on_device = [r for r in reads if digests and hash_on_device and not in_place(r.dst, staged)
                     and _device_hashable(r.dst)]
        return _Pipeline(fd, path, reads, staged, digests, on_device, max(1, threads), max(1, slots),
                         chunk or CHUNK).run()
    finally:
        if own:
            os.close(fd)


def _advise_huge_pages(reads: list[TensorRead]) -> None:
    """Ask for transparent huge pages under the in-place destinations, before the reads first touch
    them. A parameter vLLM allocated but never touched is otherwise faulted in one 4 KiB page at a
    time inside read(): measured on the bench machine, that costs more CPU than the read itself. Only
    the 2 MiB-aligned interior of each tensor is advised (the memory around it is not ours); advice
    only: a kernel without THP, or with THP off, ignores or refuses it and nothing changes."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for r in reads:
        interior = huge_page_interior(r.dst.data_ptr(), r.nbytes)
        if interior:
            madvise(interior[0], interior[1] - interior[0], MADV_HUGEPAGE)


def huge_page_interior(address: int, nbytes: int) -> tuple[int, int] | None:
    """[start, end) of the whole huge pages inside [address, address + nbytes), or None."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end) if end > start else None


class _Pipeline:
    """One call's chunks through read (thread pool) -> copy (CUDA stream, or CPU) -> hash (one thread),
    at most `slots` chunks between being handed out and being done; the tensors of `on_device` hashed on
    their GPU instead, each once its last copy is done."""

    def __init__(self, fd: int, path: Path, reads: list[TensorRead], staged: bool | None, digests: bool,
                 on_device: list[TensorRead], threads: int, slots: int, chunk: int):
        self.fd, self.path, self.reads, self.staged = fd, path, reads, staged
        self.threads, self.slots, self.chunk = threads, slots, chunk
        self.on_device = {r.name: r for r in on_device}
        self.hashers = _hashers([r for r in reads if r.name not in self.on_device]) if digests else {}
        self.device_digests: dict[str, torch.Tensor] = {}  # name -> BLAKE3's 8 words, on the tensor's GPU
        devices = {r.dst.device for r in reads if not in_place(r.dst, staged)}
        cuda = [d for d in devices if d.type == "cuda"]
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=bool(cuda)) for _ in range(slots)] \
            if devices else []
        self.streams = {d: torch.cuda.Stream(d) for d in cuda}
        for d, s in self.streams.items():  # destinations allocated or filled on the current stream come first
            s.wait_stream(torch.cuda.current_stream(d))
        self.events = [torch.cuda.Event() for _ in range(slots)] if cuda else []
        self.hash_streams = {d: torch.cuda.Stream(d) for d in {r.dst.device for r in on_device}}

    def run(self) -> dict[str, str]:
        free = list(range(self.slots))
        reading: deque[tuple[_Chunk, int, Future]] = deque()  # handed to a reader, in file order
        landed: deque[tuple[int, bool, Future | None]] = deque()  # read; copy or hash may still run
        with ThreadPoolExecutor(self.threads, "lucifer-read") as pool, \
                ThreadPoolExecutor(1, "lucifer-hash") as hashing:
            try:
                for c in self._chunks():
                    while not free:
                        if landed:
                            free.append(self._release(*landed.popleft()))
                        else:
                            landed.append(self._land(*reading.popleft(), hashing))
                    slot = free.pop()
                    reading.append((c, slot, pool.submit(self._read, c, slot)))
                while reading:
                    landed.append(self._land(*reading.popleft(), hashing))
                while landed:
                    self._release(*landed.popleft())
            finally:  # on an error: start nothing queued, let the running finish (the pools join them)
                for *_, f in reading:
                    f.cancel()
                for *_, h in landed:
                    if h is not None:
                        h.cancel()
                for s in (*self.streams.values(), *self.hash_streams.values()):
                    s.synchronize()
        got = {name: h.hexdigest() for name, h in self.hashers.items()}
        got.update({name: _device_blake3().hexdigest(words) for name, words in self.device_digests.items()})
        return got

    def _chunks(self) -> Iterator[_Chunk]:
        for r in self.reads:
            dst = flat_bytes(r.dst)
            host = memoryview(dst.numpy()) if in_place(r.dst, self.staged) else None
            for pos in range(0, r.nbytes, self.chunk):
                end = min(pos + self.chunk, r.nbytes)
                yield _Chunk(r.name, r.offset + pos, dst[pos:end], host[pos:end] if host is not None else None,
                             end == r.nbytes)

    def _view(self, c: _Chunk, slot: int) -> memoryview:
        """Where chunk `c`'s bytes are read to: the destination itself, or ring slot `slot`."""
        return c.host if c.host is not None else memoryview(self.buffers[slot].numpy())[:c.dst.numel()]

    def _read(self, c: _Chunk, slot: int) -> None:
        _pread_exactly(self.fd, self._view(c, slot), c.offset, self.path, c.name)

    def _land(self, c: _Chunk, slot: int, read: Future, hashing: ThreadPoolExecutor) -> tuple[int, bool, Future | None]:
        """Wait for chunk `c`'s read (raising its error), start its copy and its hash (on the host, or on
        the GPU after the tensor's last copy)."""
        read.result()
        copying = c.host is None and self._copy(c, slot)
        hasher = self.hashers.get(c.name)
        h = hashing.submit(hasher.update, self._view(c, slot)) if hasher is not None else None
        if c.last and c.name in self.on_device:
            self._hash_on_device(self.on_device[c.name])
        return slot, copying, h

    def _copy(self, c: _Chunk, slot: int) -> bool:
        """Copy slot `slot` to the chunk's destination: on the destination's stream, recording the
        slot's event (True), or at once for a CPU destination (False)."""
        src = self.buffers[slot][:c.dst.numel()]
        stream = self.streams.get(c.dst.device)
        if stream is None:
            c.dst.copy_(src)
            return False
        with torch.cuda.stream(stream):
            c.dst.copy_(src, non_blocking=True)
            self.events[slot].record(stream)
        return True

    def _hash_on_device(self, r: TensorRead) -> None:
        """BLAKE3 of `r`'s destination on its GPU's hash stream, after every copy enqueued so far."""
        copied = torch.cuda.Event()
        copied.record(self.streams[r.dst.device])
        stream = self.hash_streams[r.dst.device]
        stream.wait_event(copied)
        with torch.cuda.stream(stream):
            self.device_digests[r.name] = _device_blake3().digest_words(r.dst)

    def _release(self, slot: int, copying: bool, h: Future | None) -> int:
        """Slot `slot` once its copy and its hash are done (raising a hash's error)."""
        if copying:
            self.events[slot].synchronize()
        if h is not None:
            h.result()
        return slot


def _device_hashable(dst: torch.Tensor) -> bool:
    """Whether `dst`'s BLAKE3 can be computed on its GPU: Triton is installed (vLLM brings it), the
    kernels take the tensor (`device_blake3.eligible`) and hash right on that GPU (checked once; if
    not, the host hashes, and the log says why once)."""
    if not dst.is_cuda or importlib.util.find_spec("triton") is None or not _device_blake3().eligible(dst):
        return False
    why = _device_blake3().self_check(dst.device)
    if why is not None:
        _warn_once(why)
    return why is None


def _device_blake3():
    """src/lucifer_shard/runtime_shim/load/device_blake3.py, imported only where a GPU tensor is hashed: it needs Triton."""
    from . import device_blake3

    return device_blake3


@functools.cache
def _warn_once(why: str) -> None:
    logger.warning("lucifer_tp3: verify=full hashes on the host instead: %s", why)


def _hashers(reads: list[TensorRead]) -> dict:
    from blake3 import blake3

    # AUTO: one large update is hashed on all cores (the digest does not depend on it)
    return {r.name: blake3(max_threads=blake3.AUTO) for r in reads}


def _refuse_outside(path: Path, size: int, reads: list[TensorRead]) -> None:
    """ShimError naming the first read, in file order, that starts outside the file's `size` bytes; from
    one that starts inside and runs past the end on, the reads name it ("ends inside tensor": a
    truncated file), as a serial reader would."""
    for r in reads:
        if not 0 <= r.offset <= size:
            raise ShimError(f"{path}: tensor {r.name} starts at byte {r.offset}, outside the file ({size} bytes); "
                            f"the offsets come from its header", VERIFY.at(out="OUT"))
        if r.offset + r.nbytes > size:
            return


def _pread_exactly(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:  # the disk's refusal (EIO, ENOMEM...): named, one line, the shim's kind
            raise ShimError(f"{path}: reading tensor {name} at byte {offset + done} failed ({e.strerror or e})",
                            VERIFY.at(out="OUT").after("check the disk (dmesg)", "start vLLM again")) from None
        if n == 0:
            raise ShimError(f"{path} ends inside tensor {name} (byte {offset + done} of the file); the file is "
                            f"truncated", CONVERT_RESUME.after("", "re-copy it"))
        done += n
