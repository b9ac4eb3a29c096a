"""A chunk of a rank tensor in model layout checked the same way by `diff` and `verify`: every pad
byte against its pad value, no E8M0 scale byte 0xFF; and where a finding lies (element index, byte
offsets in the rank file, through the forward layout for kernel-layout experts)."""
from __future__ import annotations

import numpy as np

from ..formats.dtypes import DTYPE_SIZE
from ..model.layouts import layout_by_name
from ..model.rules import NEG_INF_F32
from ..output.manifest_types import Region, TensorRecord
from .rankfile import HeaderTensor, RankFile, byte_shape
from .report import Problem, Report, fmt_index, hexbytes

PAD_BYTES = {"zero": b"\x00", "-inf": NEG_INF_F32}


def to_model(stored: np.ndarray, layout: str) -> np.ndarray:
    """A chunk of a stored tensor in model layout (expert tensors: [B, ...] per expert)."""
    if layout == "model":
        return stored
    return layout_by_name(layout).inverse(np.ascontiguousarray(stored))


def file_offsets(ht: HeaderTensor, info: TensorRecord, bcoord: tuple[int, ...]) -> list[int]:
    """Absolute byte offset(s) in the rank file of a model-layout byte (B-coords: last dim in bytes).

    Expert kernel layouts are bit permutations within one expert, so the bytes that hold bits of a
    model-layout byte are found exactly by laying out a one-hot probe (0xFF at that byte)."""
    item = DTYPE_SIZE[info.dtype]
    mshape = byte_shape(info.model_shape, item)
    if not info.kernel:
        return [ht.start + int(np.ravel_multi_index(bcoord, mshape))]
    e, inner = bcoord[0], bcoord[1:]
    per_expert = int(np.prod(mshape[1:], dtype=np.int64))
    probe = np.zeros((1, *mshape[1:]), np.uint8)
    probe[(0, *inner)] = 0xFF
    hits = np.flatnonzero(layout_by_name(info.layout).forward(probe))
    return [ht.start + e * per_expert + int(h) for h in hits]


def chunk_slices(dim: int, lo: int, hi: int, ndim: int, item: int) -> tuple[slice, ...]:
    """Element range [lo, hi) along `dim` of a byte array (the last dim scales by `item`)."""
    s = [slice(None)] * ndim
    k = item if dim == ndim - 1 else 1
    s[dim] = slice(lo * k, hi * k)
    return tuple(s)


def slice_starts(sl: tuple[slice, ...]) -> np.ndarray:
    return np.array([s.start or 0 for s in sl], np.int64)


def pad_violations(view: np.ndarray, pad: bytes) -> np.ndarray:
    """Boolean mask of bytes of `view` (last dim in bytes) that differ from the repeating pad pattern."""
    if pad == b"\x00":
        return view != 0
    n = len(pad)
    pattern = np.frombuffer(pad * (view.shape[-1] // n), np.uint8)
    return view != pattern


def regions_in_chunk(info: TensorRecord, a: int, b: int,
                     stacked: bool) -> list[tuple[Region, tuple[slice, ...], int]]:
    """(region, byte slices in the model-layout chunk, dim-0 offset) of each zero region in rows [a, b)."""
    item = DTYPE_SIZE[info.dtype]
    ndim = len(info.model_shape)
    out = []
    for region in info.zero_regions:
        dim, lo, hi = region
        if stacked:
            sl = chunk_slices(dim + 1, lo, hi, ndim, item)
            out.append((region, sl, 0))
            continue
        if dim == 0:
            lo2, hi2 = max(lo, a), min(hi, b)
            if lo2 >= hi2:
                continue
            out.append((region, chunk_slices(0, lo2 - a, hi2 - a, ndim, item), 0))
        else:
            out.append((region, chunk_slices(dim, lo, hi, ndim, item), 0))
    return out


def check_pads(report: Report, model: np.ndarray, info: TensorRecord, ht: HeaderTensor, rf: RankFile, role: str,
               rank: int, name: str, a: int, b: int) -> int:
    """Pad bytes of rows [a, b) (experts when stacked) in model layout; returns how many were checked."""
    stacked = info.stacked
    item = DTYPE_SIZE[info.dtype]
    pad_name = info.pad
    pad = PAD_BYTES[pad_name]
    checked = 0
    for region, sl, _ in regions_in_chunk(info, a, b, stacked):
        view = model[sl]
        checked += view.size
        if pad == b"\x00" and not _nonzero(view):
            continue  # the common case, without a mask array
        bad = pad_violations(view, pad)
        if not bad.any():
            continue
        total = int(np.count_nonzero(bad))
        local = slice_starts(sl)
        origin = local.copy()
        origin[0] += a * (item if model.ndim == 1 else 1)
        found = []
        for pos in first_positions(bad, min(1, report.room)):  # one finding per region and chunk, counted
            bc = tuple(int(x) for x in origin + pos)
            got = model[tuple(int(x) for x in local + pos)]
            k = bc[-1] % len(pad)
            tidx = element_index(bc, item)
            found.append(Problem(
                "pad", f"byte {hexbytes([got])} at {fmt_index(tidx)} in its {pad_name} pad region "
                f"[dim {region[0]}, {region[1]}:{region[2]}) (first of {total} bad pad byte(s) here)",
                role, rank, name, rf.rel,
                {"region": list(region), "tensor_index": tidx, "file_offset": file_offsets(ht, info, bc),
                 "expected": hexbytes(pad[k:k + 1]), "found": hexbytes([got])}))
        report.add_many(found, total, Problem("pad", "", role, rank, name, rf.rel))
    return checked


def _nonzero(view: np.ndarray) -> bool:
    """Whether any byte of `view` is non-zero (on 8-byte words where the layout allows it)."""
    if view.ndim and view.shape[-1] % 8 == 0 and view.strides[-1] == 1:
        try:
            view = view.view(np.uint64)
        except ValueError:
            pass
    return bool(view.any())


def first_positions(bad: np.ndarray, k: int, block: int = 1 << 20) -> np.ndarray:
    """Indices (rows of an [n, ndim] array) of the first `k` True entries of `bad`, in C order."""
    if k <= 0:
        return np.zeros((0, bad.ndim), np.int64)
    flat = bad.reshape(-1)
    hits: list[np.ndarray] = []
    n = 0
    for start in range(0, flat.size, block):
        idx = np.flatnonzero(flat[start:start + block])
        if idx.size:
            hits.append(idx[: k - n] + start)
            n += min(idx.size, k - n)
            if n >= k:
                break
    if not hits:
        return np.zeros((0, bad.ndim), np.int64)
    return np.stack(np.unravel_index(np.concatenate(hits), bad.shape), axis=1)


def element_index(bcoord: tuple[int, ...], item: int) -> list[int]:
    """B-coords (last dim in bytes) -> element index."""
    return [*bcoord[:-1], bcoord[-1] // item]


def check_scales(report: Report, model: np.ndarray, info: TensorRecord, ht: HeaderTensor, rf: RankFile, role: str,
                 rank: int, name: str, a: int) -> None:
    """No E8M0 scale byte may be 0xFF (NaN)."""
    bad = model == 0xFF
    if not bad.any():
        return
    total = int(np.count_nonzero(bad))
    item = DTYPE_SIZE[info.dtype]
    found = []
    for pos in first_positions(bad, report.room):
        bc = tuple(int(x) for x in pos)
        bc = (bc[0] + a * (item if model.ndim == 1 else 1), *bc[1:])
        found.append(Problem("scale", f"E8M0 scale byte 0xFF (NaN) at {fmt_index(element_index(bc, item))} "
                             f"({total} in this chunk)", role, rank, name, rf.rel,
                             {"tensor_index": element_index(bc, item), "file_offset": file_offsets(ht, info, bc)}))
    report.add_many(found, total, Problem("scale", "", role, rank, name, rf.rel))


def is_scale(info: TensorRecord) -> bool:
    return info.source_dtype == "F8_E8M0" or info.dtype == "F8_E8M0"
