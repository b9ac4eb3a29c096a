"""Rank-file tensors read straight into parameter storage, optionally hashed as they land.

Each tensor's bytes are read with positional reads (`os.preadv`) at the offset its file's header
gives. A contiguous CPU destination is filled in place: one copy, page cache to parameter, as `cat`
does, with no mmap page faults, no intermediate tensor and no file pages held in the process's RSS.
Any other destination (a GPU parameter) is filled through a small ring of host buffers, pinned when
CUDA is present, each chunk copied to the device as soon as it is read. With `digests=True` a reader
thread works ahead while the calling thread computes BLAKE3 over every chunk as it lands (blake3
releases the GIL), so hashing overlaps reading instead of following it.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from lucifer_shard.guarded_io import open_regular

from .errors import ShimError

CHUNK = 16 << 20  # bytes per read
AHEAD = 4  # chunks the reader thread may be ahead of the hashing thread
RING = AHEAD + 2  # host buffers of a device load: queued + being hashed + being filled
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


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (same memory)."""
    return t.reshape(-1).view(torch.uint8)


def in_place(t: torch.Tensor, staged: bool | None = None) -> bool:
    """Whether reads land in `t` itself (a CPU tensor, unless `staged` says otherwise)."""
    return t.device.type == "cpu" if staged is None else not staged


def read_tensors(path: Path, reads: list[TensorRead], digests: bool = False,
                 staged: bool | None = None, fd: int | None = None) -> dict[str, str]:
    """Fill every read's destination from `path` (from `fd` when given, which stays open), in file
    order; with `digests`, the BLAKE3 hex digest of each tensor's bytes. `staged` forces (True) or
    forbids (False) the host-buffer path that non-CPU destinations take (tests use it to exercise
    that path on CPU)."""
    reads = sorted(reads, key=lambda r: r.offset)
    for r in reads:
        if not r.dst.is_contiguous():
            raise ShimError(f"parameter {r.name} is not contiguous in memory; this vLLM build lays out parameters "
                            f"differently, use a supported build (lucifer-shard doctor)")
    _advise_huge_pages([r for r in reads if in_place(r.dst, staged)])
    own = fd is None
    if own:
        fd = open_regular(path)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        chunks = _chunks(fd, path, reads, staged)
        if not digests:
            for _ in chunks:
                pass
            return {}
        return _hash_while_reading(chunks, reads)
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


def _chunks(fd: int, path: Path, reads: list[TensorRead], staged: bool | None) -> Iterator[tuple[str, memoryview]]:
    """Read every tensor chunk by chunk into its destination; yield (name, the chunk's host bytes)."""
    ring: list[torch.Tensor] = []
    k = 0
    for r in reads:
        dst = flat_bytes(r.dst)
        direct = in_place(r.dst, staged)
        host = memoryview(dst.numpy()) if direct else None
        for pos in range(0, r.nbytes, CHUNK):
            n = min(CHUNK, r.nbytes - pos)
            if direct:
                view = host[pos:pos + n]
            else:
                if len(ring) < RING:
                    ring.append(torch.empty(CHUNK, dtype=torch.uint8, pin_memory=torch.cuda.is_available()))
                slot = ring[k % RING]
                k += 1
                view = memoryview(slot.numpy())[:n]
            _pread_exactly(fd, view, r.offset + pos, path, r.name)
            if not direct:
                dst[pos:pos + n].copy_(slot[:n])
            yield r.name, view


def _pread_exactly(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ShimError(f"{path} ends inside tensor {name} (byte {offset + done} of the file); the file is "
                            f"truncated, re-copy it or re-run lucifer-shard convert --resume")
        done += n


def _hash_while_reading(chunks: Iterator[tuple[str, memoryview]], reads: list[TensorRead]) -> dict[str, str]:
    from blake3 import blake3

    q: queue.Queue = queue.Queue(maxsize=AHEAD)
    stop = threading.Event()
    end = object()

    def offer(item) -> bool:
        """Queue `item` unless the hashing thread has stopped listening."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def reader() -> None:
        try:
            for item in chunks:
                if not offer(item):
                    return
            offer(end)
        except BaseException as e:  # noqa: BLE001 - handed to the hashing thread, which raises it
            offer(e)

    hashers = {r.name: blake3() for r in reads}
    thread = threading.Thread(target=reader, name="lucifer_tp3-reader", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            name, view = item
            hashers[name].update(view)
    finally:
        stop.set()
        thread.join()
    return {name: h.hexdigest() for name, h in hashers.items()}
