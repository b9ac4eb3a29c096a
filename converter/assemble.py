"""Build per-rank tensor bytes from source regions, chunk by chunk, reading each region once.

A chunk is a range of the target tensor's first dim (experts for stacked expert tensors, rows
otherwise). For one chunk, every rank's pieces are resolved to source boxes; boxes of the same
source key are merged into one bounding box read once through safetensors and fanned out.
Buffers are bytes (uint8) in model layout, last dim in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import SourceError
from .rules import DTYPE_SIZE, TensorSpec
from .source import Checkpoint

CHUNK_BYTES = 32 << 20


def chunks(spec: TensorSpec, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Ranges of dim 0 whose model-layout bytes stay near `chunk_bytes` (at least one index)."""
    n0 = spec.shape[0]
    per = max(1, spec.nbytes // max(1, n0))
    step = max(1, chunk_bytes // per)
    return [(a, min(a + step, n0)) for a in range(0, n0, step)]


@dataclass(frozen=True)
class Request:
    rank: int
    key: str
    src: tuple[slice, ...]  # element box in the source tensor
    dst: tuple[slice | int, ...]  # element box in the chunk buffer (dim 0 relative to the chunk)


def _requests(spec: TensorSpec, a: int, b: int) -> list[Request]:
    out = []
    for p in spec.pieces:
        if spec.experts:
            m = len(spec.matrix_shape)
            for e in range(a, b):
                src = [slice(None)] * m
                dst: list[slice | int] = [e - a] + [slice(None)] * m
                src[p.dim] = slice(p.src_start, p.src_start + p.length)
                dst[1 + p.dim] = slice(p.dst_start, p.dst_start + p.length)
                out.append(Request(spec.rank, p.source.format(e=e), tuple(src), tuple(dst)))
            continue
        n = len(spec.shape)
        src = [slice(None)] * n
        dst = [slice(None)] * n
        if p.dim == 0:
            lo, hi = max(a, p.dst_start), min(b, p.dst_start + p.length)
            if lo >= hi:
                continue
            src[0] = slice(p.src_start + lo - p.dst_start, p.src_start + hi - p.dst_start)
            dst[0] = slice(lo - a, hi - a)
        else:
            src[0] = slice(a, b)
            dst[0] = slice(0, b - a)
            src[p.dim] = slice(p.src_start, p.src_start + p.length)
            dst[p.dim] = slice(p.dst_start, p.dst_start + p.length)
        out.append(Request(spec.rank, p.source, tuple(src), tuple(dst)))
    return out


def _union(boxes: list[tuple[slice, ...]], shape: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for d, size in enumerate(shape):
        starts = [bx[d].indices(size)[0] for bx in boxes]
        stops = [bx[d].indices(size)[1] for bx in boxes]
        out.append(slice(min(starts), max(stops)))
    return tuple(out)


def _shift(box: tuple[slice, ...], origin: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for d, s in enumerate(box):
        start, stop, _ = s.indices(shape[d])
        o = origin[d].start
        out.append(slice(start - o, stop - o))
    return tuple(out)


def to_storage(t: torch.Tensor, src_dtype: str, out_dtype: str, key: str, file: str, n_experts: int) -> np.ndarray:
    """Source elements -> output dtype bytes (uint8, last dim in bytes), enforcing the dtype rules."""
    if src_dtype == "F8_E8M0":
        raw = t.contiguous().view(torch.uint8)
        bad = (raw == 0xFF).nonzero()
        if len(bad):
            idx = tuple(int(i) for i in bad[0])
            raise SourceError(f"{file}: tensor {key!r} has E8M0 scale byte 0xFF (NaN) at {list(idx)}; "
                              f"refusing to write a NaN scale")
    elif src_dtype == "I64" and out_dtype == "I32":
        if len(t) and (int(t.min()) < 0 or int(t.max()) >= n_experts):
            raise SourceError(f"{file}: tensor {key!r} holds expert ids outside [0, {n_experts}); "
                              f"cannot narrow to I32")
        t = t.to(torch.int32)
    t = t.contiguous()
    arr = t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()
    return arr.reshape(*t.shape[:-1], t.shape[-1] * DTYPE_SIZE[out_dtype]) if t.dim() else arr


def pad_buffer(spec: TensorSpec, rows: int) -> np.ndarray:
    """A chunk buffer of `rows` first-dim indices filled with the spec's pad pattern."""
    shape = list(spec.shape)
    shape[0] = rows
    shape[-1] *= DTYPE_SIZE[spec.dtype]
    if spec.pad == b"\x00":
        return np.zeros(shape, np.uint8)
    buf = np.empty(shape, np.uint8)
    buf.reshape(-1, len(spec.pad))[:] = np.frombuffer(spec.pad, np.uint8)
    return buf


def _byte_box(box: tuple[slice | int, ...], itemsize: int, last: int) -> tuple[slice | int, ...]:
    """Element box -> byte box (only the last dim scales)."""
    s = box[-1]
    start, stop, _ = s.indices(last)
    return (*box[:-1], slice(start * itemsize, stop * itemsize))


def assemble(ckpt: Checkpoint, specs: list[TensorSpec], a: int, b: int) -> list[np.ndarray]:
    """Model-layout bytes of rows [a, b) of the same tensor on every rank; each source box read once."""
    reqs = [r for spec in specs for r in _requests(spec, a, b)]
    by_key: dict[str, list[Request]] = {}
    for r in reqs:
        by_key.setdefault(r.key, []).append(r)
    bufs = [pad_buffer(spec, b - a) for spec in specs]
    slot = {spec.rank: i for i, spec in enumerate(specs)}
    spec0 = specs[0]
    item = DTYPE_SIZE[spec0.dtype]
    for key, group in by_key.items():
        entry = ckpt.tensors[key]
        union = _union([r.src for r in group], entry.shape)
        region = to_storage(ckpt.read(key, union), spec0.src_dtype, spec0.dtype, key, entry.file,
                            ckpt.config.n_experts)
        region_shape = tuple(s.stop - s.start for s in union)
        for r in group:
            local = _shift(r.src, union, entry.shape)
            src_bytes = region[_byte_box(local, item, region_shape[-1])]
            buf = bufs[slot[r.rank]]
            dst_last = buf.shape[-1] // item
            buf[_byte_box(r.dst, item, dst_last)] = src_bytes
    return bufs
