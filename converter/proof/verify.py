"""`verify OUT`: the integrity of a converted output without the source checkpoint.

Checks, collected into one report (nothing stops at the first problem unless the manifest itself
cannot be read): the manifest's self-digest; `COMPLETE` equal to the conversion id; the manifest's
tensor entries equal to what the rule table gives for OUT/config.json and the recorded options;
every listed file present with the recorded size, digest and `__metadata__` identity; header
names, shapes and dtypes as recorded; every zero region zero (or -inf) after the inverse layout;
no E8M0 scale byte 0xFF; replicated tensors byte-equal on every rank; no stray files in rank
folders. Each file is read once: the digest and the content checks share one streaming pass.

The pieces shared with `diff` live here too: rank-file header parsing and chunked reads, model
layout of a chunk, pad checks, byte offsets of a model-layout position in its rank file, and the
problem report.
"""
from __future__ import annotations

import errno
import functools
import json
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from blake3 import blake3
from tqdm import tqdm

from .. import __version__
from ..errors import LuciferError, OutputError
from ..spec.config import load_config, ModelConfig
from ..spec.layouts import EXPERT_TENSORS, expert_layout, layout_by_name
from ..spec.manifest import (COMPLETE_NAME, FORMAT_VERSION, MANIFEST_NAME, STATE_DIR, Options, conversion_id,
                             file_digest, file_metadata, load_manifest)
from ..spec.plan import make_plan
from ..spec.rules import DTYPE_SIZE, NEG_INF_F32, TensorSpec, build_specs
from ..spec.stheader import HeaderError, read_header
from ..units import byte_bar, duration, rate, size

CHUNK_BYTES = 32 << 20
ALIGN = 4096  # O_DIRECT offset, length and address alignment
DIRECT = True  # read rank and source bytes with O_DIRECT where the filesystem allows it
PAD_BYTES = {"zero": b"\x00", "-inf": NEG_INF_F32}
SHOW_TENSORS = 20  # tensors listed in the human report


# ---------------------------------------------------------------- report


@dataclass
class Problem:
    """One finding. `kind`: manifest, file, header, structure, coverage, source, data, pad, scale, replica."""

    kind: str
    message: str
    role: str | None = None
    rank: int | None = None
    tensor: str | None = None
    file: str | None = None
    detail: dict = field(default_factory=dict)

    def where(self) -> str:
        parts = [p for p in (self.role, f"rank {self.rank}" if self.rank is not None else None, _shown(self.tensor)) if p]
        return " ".join(parts)

    def line(self) -> str:
        where = self.where()
        return f"{self.kind.upper():<9} {where + ': ' if where else ''}{self.message}"

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "message": self.message, "role": self.role, "rank": self.rank,
             "tensor": self.tensor, "file": self.file}
        d.update(self.detail)
        return d


@dataclass
class Report:
    """Findings (the first `limit` in full, all counted) and the run's numbers."""

    command: str
    limit: int = 10
    problems: list[Problem] = field(default_factory=list)
    count: int = 0
    by_tensor: dict[str, int] = field(default_factory=dict)  # "role rank-r name" (or file) -> bad bytes/items
    stats: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    lead: int = 0  # problems listed first (add_first)

    @property
    def ok(self) -> bool:
        return self.count == 0

    @property
    def room(self) -> int:
        return max(0, self.limit - len(self.problems))

    def add(self, problem: Problem, weight: int = 1) -> None:
        self.count += 1
        if len(self.problems) < self.limit:
            self.problems.append(problem)
        key = _tensor_key(problem)
        self.by_tensor[key] = self.by_tensor.get(key, 0) + weight

    def add_first(self, problem: Problem) -> None:
        """A finding that explains the others (the source is not the one converted): listed before them,
        in the order found."""
        self.add(problem)
        if self.problems and self.problems[-1] is problem:
            self.problems.pop()
        self.problems.insert(self.lead, problem)
        self.lead += 1
        del self.problems[self.limit:]

    def add_many(self, problems: list[Problem], total: int, key_of: Problem) -> None:
        """`total` findings of one kind in one tensor, of which `problems` are the first few, in full."""
        self.count += total
        self.problems.extend(problems[: self.room])
        key = _tensor_key(key_of)
        self.by_tensor[key] = self.by_tensor.get(key, 0) + total

    def merge(self, other: "Report") -> None:
        """Append another report's findings (in order) and counts."""
        self.count += other.count
        self.problems.extend(other.problems[: self.room])
        for k, n in other.by_tensor.items():
            self.by_tensor[k] = self.by_tensor.get(k, 0) + n

    def outcome_lines(self, ok_text: str, noun: str) -> list[str]:
        """The closing lines of a text report: the OK sentence, or every problem and the count."""
        if self.ok:
            return [f"OK: {ok_text}"]
        return [*self.problem_lines(), f"FAILED: {self.count} {noun}"]

    def to_dict(self) -> dict:
        return {"command": self.command, "ok": self.ok, "problem_count": self.count, **self.info,
                "summary": self.stats, "problems": [p.to_dict() for p in self.problems],
                "tensors_with_problems": dict(sorted(self.by_tensor.items()))}

    def problem_lines(self) -> list[str]:
        lines = []
        for p in self.problems:
            lines.append(p.line())
            d = p.detail
            where = []
            if "tensor_index" in d:
                where.append(f"at {p.tensor}{_idx(d['tensor_index'])}")
            if "file_offset" in d:
                where.append(f"{p.file} byte offset {', '.join(str(o) for o in d['file_offset'])}")
            if where:
                lines.append("          " + ", ".join(where))
        if self.count > len(self.problems):
            lines.append(f"... and {self.count - len(self.problems)} more finding(s) (raise --max-mismatches "
                         f"or use --json)")
        if self.by_tensor:
            lines.append(f"tensors with problems ({len(self.by_tensor)}):")
            for k, n in sorted(self.by_tensor.items())[:SHOW_TENSORS]:
                lines.append(f"  {k}  ({n})")
            if len(self.by_tensor) > SHOW_TENSORS:
                lines.append(f"  ... and {len(self.by_tensor) - SHOW_TENSORS} more")
        return lines

    def first(self) -> str:
        if not self.problems:
            return ""
        p = self.problems[0]
        where = p.where()
        return f"{where + ': ' if where else ''}{p.message}"


def _shown(name: str | None) -> str | None:
    """A tensor name for a report line: names read from a damaged header may hold control characters."""
    return name if name is None or name.isprintable() else repr(name)


def _tensor_key(p: Problem) -> str:
    if p.tensor:
        return " ".join(x for x in (p.role, f"rank-{p.rank}" if p.rank is not None else None, _shown(p.tensor)) if x)
    return p.file or p.kind


def _idx(index) -> str:
    return "" if index is None else "[" + ", ".join(str(i) for i in index) + "]"


def hexbytes(b: np.ndarray | bytes) -> str:
    return "0x" + bytes(b).hex()


# ---------------------------------------------------------------- rank files


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
    """A rank file opened through its own header (not the manifest's idea of it)."""

    def __init__(self, rel: str, path: Path):
        self.rel = rel
        self.path = path
        # Not `whole`: a truncated file is reported tensor by tensor, bytes after the data as a finding.
        header = read_header(path, whole=False)
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

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = open_sequential(self.path)
            return self._fd

    def direct(self) -> DirectFile:
        with self._lock:
            if self._direct is None:
                self._direct = DirectFile(self.path)
            return self._direct

    def read(self, name: str, a: int, b: int) -> np.ndarray:
        """Rows [a, b) of dim 0 as stored: uint8 [b-a, *shape[1:-1], shape[-1]*item] (1-D: bytes)."""
        t = self.tensors[name]
        return read_rows(self.fd(), t.start, t.shape, t.item, a, b)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
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


def open_sequential(path: Path) -> int:
    """A read-only descriptor with the kernel told to read ahead aggressively."""
    fd = os.open(path, os.O_RDONLY)
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

    def __init__(self, path: Path, direct: bool | None = None):
        self.path = path
        self.direct = (DIRECT if direct is None else direct) and hasattr(os, "O_DIRECT")
        self.fd = -1
        self._retired: list[int] = []
        self._lock = threading.Lock()
        if self.direct:
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd < 0:
            self.fd = open_sequential(path)

    def _buffered(self, fd: int) -> None:
        with self._lock:
            if self.direct and self.fd == fd:
                self._retired.append(fd)
                self.fd = open_sequential(self.path)
                self.direct = False

    @staticmethod
    def span(start: int, nbytes: int) -> int:
        """Bytes of buffer a read of [start, start + nbytes) needs (its ALIGN-aligned span)."""
        lo = start - start % ALIGN
        return -(-(start + nbytes) // ALIGN) * ALIGN - lo

    def read(self, start: int, nbytes: int, buf: np.ndarray) -> np.ndarray:
        """File bytes [start, start + nbytes) read into `buf` (page-aligned, at least span() bytes);
        returns the view of them in `buf`."""
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


# ---------------------------------------------------------------- layouts and positions


def to_model(stored: np.ndarray, layout: str) -> np.ndarray:
    """A chunk of a stored tensor in model layout (expert tensors: [B, ...] per expert)."""
    if layout == "model":
        return stored
    return layout_by_name(layout).inverse(np.ascontiguousarray(stored))


def file_offsets(ht: HeaderTensor, info: dict, bcoord: tuple[int, ...]) -> list[int]:
    """Absolute byte offset(s) in the rank file of a model-layout byte (B-coords: last dim in bytes).

    Expert kernel layouts are bit permutations within one expert, so the bytes that hold bits of a
    model-layout byte are found exactly by laying out a one-hot probe (0xFF at that byte)."""
    item = DTYPE_SIZE[info["dtype"]]
    mshape = byte_shape(info["model_shape"], item)
    if info.get("layout", "model") == "model":
        return [ht.start + int(np.ravel_multi_index(bcoord, mshape))]
    e, inner = bcoord[0], bcoord[1:]
    per_expert = int(np.prod(mshape[1:], dtype=np.int64))
    probe = np.zeros((1, *mshape[1:]), np.uint8)
    probe[(0, *inner)] = 0xFF
    hits = np.flatnonzero(layout_by_name(info["layout"]).forward(probe))
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


def regions_in_chunk(info: dict, a: int, b: int, stacked: bool) -> list[tuple[list[int], tuple[slice, ...], int]]:
    """(region, byte slices in the model-layout chunk, dim-0 offset) of each zero region in rows [a, b)."""
    item = DTYPE_SIZE[info["dtype"]]
    mshape = info["model_shape"]
    ndim = len(mshape)
    out = []
    for region in info.get("zero_regions") or []:
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


def check_pads(report: Report, model: np.ndarray, info: dict, ht: HeaderTensor, rf: RankFile, role: str,
               rank: int, name: str, a: int, b: int) -> int:
    """Pad bytes of rows [a, b) (experts when stacked) in model layout; returns how many were checked."""
    stacked = bool(info.get("experts"))
    item = DTYPE_SIZE[info["dtype"]]
    pad_name = info.get("pad", "zero")
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
                "pad", f"byte {hexbytes([got])} at {_idx(tidx)} in its {pad_name} pad region "
                f"[dim {region[0]}, {region[1]}:{region[2]}) (first of {total} bad pad byte(s) here)",
                role, rank, name, rf.rel,
                {"region": region, "tensor_index": tidx, "file_offset": file_offsets(ht, info, bc),
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


def check_scales(report: Report, model: np.ndarray, info: dict, ht: HeaderTensor, rf: RankFile, role: str,
                 rank: int, name: str, a: int) -> None:
    """No E8M0 scale byte may be 0xFF (NaN)."""
    bad = model == 0xFF
    if not bad.any():
        return
    total = int(np.count_nonzero(bad))
    item = DTYPE_SIZE[info["dtype"]]
    found = []
    for pos in first_positions(bad, report.room):
        bc = tuple(int(x) for x in pos)
        bc = (bc[0] + a * (item if model.ndim == 1 else 1), *bc[1:])
        found.append(Problem("scale", f"E8M0 scale byte 0xFF (NaN) at {_idx(element_index(bc, item))} "
                             f"({total} in this chunk)", role, rank, name, rf.rel,
                             {"tensor_index": element_index(bc, item), "file_offset": file_offsets(ht, info, bc)}))
    report.add_many(found, total, Problem("scale", "", role, rank, name, rf.rel))


def is_scale(info: dict) -> bool:
    return info.get("source_dtype") == "F8_E8M0" or info.get("dtype") == "F8_E8M0"


def tensor_chunks(ht: HeaderTensor, limit: int) -> list[tuple[int, int]]:
    shape = ht.shape
    n0 = shape[0] if shape else 1
    total = ht.end - ht.start
    return row_chunks(n0, total // max(1, n0), limit)


# ---------------------------------------------------------------- manifest vs the rule table


def options_of(manifest: dict) -> Options:
    o = manifest.get("options") or {}
    try:
        return Options(**o)
    except TypeError as e:
        raise ValueError(f"manifest options {o!r} are not this tool's ({e})") from None


def expected_entries(cfg: ModelConfig, options: Options) -> tuple[dict, dict[str, list[list[TensorSpec]]]]:
    """What the manifest's tensor entries must say, from the rule table: {role: [{name: entry}]}, specs."""
    plan = make_plan(cfg, options.tp)
    roles = ["target"] + (["draft"] if options.mtp and cfg.num_mtp else [])
    layouts = {t: expert_layout(options.arch, options.expert_layout, options.flashinfer_layout, t)
               for t in EXPERT_TENSORS}
    entries: dict = {}
    specs: dict = {}
    for role in roles:
        specs[role] = build_specs(cfg, plan, role)
        ranks = []
        for rank_specs in specs[role]:
            tensors = {}
            for s in rank_specs:
                if s.expert_tensor:
                    lay = layouts[s.expert_tensor]
                    shape, layout = [s.experts, *lay.kernel_shape(s.matrix_shape)], lay.name
                else:
                    shape, layout = list(s.shape), "model"
                tensors[s.name] = {
                    "dtype": s.dtype, "shape": shape, "model_shape": list(s.shape), "layout": layout,
                    "experts": s.experts, "source_dtype": s.src_dtype,
                    "sources": [{"key": p.source, "dim": p.dim, "src_start": p.src_start, "dst_start": p.dst_start,
                                 "length": p.length, "seg_len": p.seg_len} for p in s.pieces],
                    "zero_regions": [[p.dim, *p.tail] for p in s.pieces if p.tail[1] > p.tail[0]],
                    "pad": "-inf" if s.pad != b"\x00" else "zero",
                }
            ranks.append(tensors)
        entries[role] = ranks
    return {"plan": plan.to_dict(), "roles": entries}, specs


def check_manifest_rules(report: Report, manifest: dict, cfg: ModelConfig) -> dict | None:
    """The manifest's plan and tensor entries against the rule table; returns the expected entries."""
    try:
        options = options_of(manifest)
        want, specs = expected_entries(cfg, options)
    except (LuciferError, ValueError) as e:
        report.add(Problem("manifest", f"cannot rebuild the plan from config.json and the recorded options: {e}"))
        return None
    if manifest.get("tp_size") != options.tp:
        report.add(Problem("manifest", f"tp_size {manifest.get('tp_size')} != options.tp {options.tp}"))
    if manifest.get("arch") != options.arch:
        report.add(Problem("manifest", f"arch {manifest.get('arch')!r} != options.arch {options.arch!r}"))
    if _norm(manifest.get("plan")) != _norm(want["plan"]):
        report.add(Problem("manifest", "the recorded plan is not the virtual-TP plan of config.json at this TP size; "
                                       "re-run convert"))
    roles = manifest.get("roles") or {}
    for role in sorted(set(roles) | set(want["roles"])):
        if role not in want["roles"]:
            report.add(Problem("manifest", f"unexpected role {role!r} for these options", role))
            continue
        if role not in roles:
            report.add(Problem("manifest", f"role {role!r} is missing", role))
            continue
        got_ranks = roles[role].get("ranks") or []
        if len(got_ranks) != options.tp:
            report.add(Problem("manifest", f"{len(got_ranks)} ranks recorded, TP is {options.tp}", role))
        for rank, want_t in enumerate(want["roles"][role]):
            if rank >= len(got_ranks):
                break
            got_t = got_ranks[rank].get("tensors") or {}
            if got_ranks[rank].get("rank") != rank:
                report.add(Problem("manifest", f"rank entry {rank} says rank {got_ranks[rank].get('rank')}",
                                   role, rank))
            for name in sorted(set(got_t) - set(want_t)):
                report.add(Problem("manifest", "tensor not produced by the rule table", role, rank, name))
            for name in sorted(set(want_t) - set(got_t)):
                report.add(Problem("manifest", "tensor missing from the manifest", role, rank, name))
            for name in sorted(set(want_t) & set(got_t)):
                for k, v in want_t[name].items():
                    if _norm(got_t[name].get(k)) != _norm(v):
                        report.add(Problem("manifest", f"entry field {k!r} is {got_t[name].get(k)!r}, the rule "
                                           f"table gives {v!r}; the manifest was edited or written by another "
                                           f"plan", role, rank, name, got_t[name].get("file")))
    return {"entries": want, "specs": specs, "options": options}


def _norm(x):
    return json.loads(json.dumps(x, sort_keys=True)) if x is not None else None


# ---------------------------------------------------------------- shared structural checks


def read_manifest(report: Report, out: Path) -> dict:
    """The manifest (a self-digest failure is a finding, not a stop); OutputError if it cannot be read."""
    if not (out / MANIFEST_NAME).exists() and (out / STATE_DIR).is_dir():
        raise OutputError(f"{out} holds an unfinished conversion (no {MANIFEST_NAME}, no {COMPLETE_NAME}); "
                          f"run the same convert command with --resume")
    manifest = load_manifest(out, check_digest=False)
    try:
        load_manifest(out, check_digest=True)
    except LuciferError as e:
        report.add(Problem("manifest", str(e), file=MANIFEST_NAME))
    complete = out / COMPLETE_NAME
    if not complete.is_file():
        report.add(Problem("manifest", f"no {COMPLETE_NAME} marker: the conversion did not finish (convert --resume)",
                           file=COMPLETE_NAME))
    elif complete.read_text().strip() != manifest.get("conversion_id"):
        report.add(Problem("manifest", f"{COMPLETE_NAME} holds {complete.read_text().strip()[:16]}..., the manifest's "
                           f"conversion id is {str(manifest.get('conversion_id'))[:16]}...: files of two conversions "
                           f"are mixed; re-run convert --force", file=COMPLETE_NAME))
    if manifest.get("tool_version") == __version__ and manifest.get("format_version") == FORMAT_VERSION:
        try:
            cid = conversion_id(manifest["source"]["fingerprint"], options_of(manifest))
        except (KeyError, TypeError, ValueError):
            cid = None
        if cid != manifest.get("conversion_id"):
            report.add(Problem("manifest", "conversion_id does not follow from the recorded source fingerprint and "
                               "options: the manifest was edited", file=MANIFEST_NAME))
    return manifest


def manifest_files(manifest: dict) -> list[tuple[str, int, dict]]:
    """(role, rank, file entry) for every file the manifest lists."""
    out = []
    for role, doc in (manifest.get("roles") or {}).items():
        for rank, entry in enumerate(doc.get("ranks") or []):
            for f in entry.get("files") or []:
                out.append((role, rank, f))
    return out


def open_files(report: Report, out: Path, manifest: dict, check_size: bool = True) -> dict[str, RankFile]:
    """Open every listed rank file and check identity, header (and size) against the manifest.

    `diff` leaves the recorded size to `verify`: a file rewritten by another writer with the same
    tensors has another header size but the same content."""
    files: dict[str, RankFile] = {}
    tp = manifest.get("tp_size")
    cid = manifest.get("conversion_id")
    for role, rank, f in manifest_files(manifest):
        rel = f.get("path", "")
        path = out / rel
        held = sorted(n for n, t in manifest["roles"][role]["ranks"][rank]["tensors"].items() if t.get("file") == rel)
        holds = f"holds {len(held)} tensor(s): {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
        if not path.is_file():
            folder = path.parent
            what = f"rank folder {folder.relative_to(out)} is missing" if not folder.is_dir() else "file is missing"
            report.add(Problem("file", f"{rel}: {what} ({holds}); re-run convert --force", role, rank,
                               held[0] if held else None, rel))
            continue
        try:
            rf = RankFile(rel, path)
        except HeaderError as e:
            report.add(Problem("file", f"{rel}: unreadable safetensors header: {e.reason}; re-run convert --force",
                               role, rank, file=rel))
            continue
        except OSError as e:
            report.add(Problem("file", f"{rel}: cannot read ({e.strerror}); re-run convert --force", role, rank,
                               file=rel))
            continue
        files[rel] = rf
        if check_size and rf.size != f.get("bytes"):
            report.add(Problem("file", f"{rel}: {rf.size} bytes, the manifest records {f.get('bytes')} "
                               f"({'truncated' if rf.size < (f.get('bytes') or 0) else 'grown'}); re-run convert "
                               f"--force", role, rank, file=rel))
        elif rf.trailing:  # diff: safetensors (and so vLLM) refuses a file with bytes after its data
            report.add(Problem("file", f"{rel}: {rf.trailing} bytes follow the last tensor; safetensors "
                               f"refuses such a file, re-run convert --force", role, rank, file=rel))
        want_meta = file_metadata(cid, role, rank, _part_of(rel), tp) if _part_of(rel) is not None else None
        if want_meta is not None:
            for k, v in want_meta.items():
                if rf.meta.get(k) != v:
                    report.add(Problem("file", f"{rel}: __metadata__ {k} is {rf.meta.get(k)!r}, expected {v!r}: "
                                       f"{_identity_hint(k)}", role, rank, file=rel))
        for name in held:
            info = manifest["roles"][role]["ranks"][rank]["tensors"][name]
            ht = rf.tensors.get(name)
            if ht is None:
                report.add(Problem("header", f"not in {rel}, where the manifest puts it", role, rank, name, rel))
                continue
            if ht.dtype != info.get("dtype") or list(ht.shape) != list(info.get("shape") or []):
                report.add(Problem("header", f"{rel} stores {ht.dtype}{list(ht.shape)}, the manifest says "
                                   f"{info.get('dtype')}{info.get('shape')}", role, rank, name, rel))
            if rf.truncated(name):
                report.add(Problem("file", f"{rel} is truncated inside this tensor (it ends at byte {ht.end}, the "
                                   f"file has {rf.size}); re-run convert --force", role, rank, name, rel))
        for name in sorted(set(rf.tensors) - set(held)):
            report.add(Problem("header", f"{rel} holds a tensor the manifest does not list there",
                               role, rank, name, rel))
    return files


def _part_of(rel: str) -> int | None:
    stem = Path(rel).name
    if stem.startswith("part-") and stem.endswith(".safetensors"):
        try:
            return int(stem[5:-12])
        except ValueError:
            return None
    return None


def _identity_hint(key: str) -> str:
    if key == "lucifer.conversion_id":
        return "this file comes from another conversion; re-run convert --force"
    if key in ("lucifer.rank", "lucifer.role", "lucifer.part"):
        return "this file was moved or swapped from another rank/part; re-run convert --force"
    return "this file does not belong to this output; re-run convert --force"


def usable(rf: RankFile | None, name: str, info: dict) -> bool:
    """Whether a tensor can be read and interpreted as the manifest describes it."""
    if rf is None:
        return False
    ht = rf.tensors.get(name)
    return (ht is not None and not rf.truncated(name) and ht.dtype == info.get("dtype")
            and list(ht.shape) == list(info.get("shape") or []))


def is_replicated(manifest: dict, role: str, name: str) -> bool:
    ranks = manifest["roles"][role]["ranks"]
    first = ranks[0]["tensors"][name].get("sources")
    for r in ranks:
        t = r["tensors"].get(name)
        if t is None or t.get("sources") != first:
            return False
        if any(p["src_start"] != 0 or p["length"] != p["seg_len"] for p in t["sources"]):
            return False
    return True


# ---------------------------------------------------------------- verify


def verify(out: Path, max_problems: int = 10, progress: bool = True, chunk_bytes: int = CHUNK_BYTES,
           workers: int | None = None) -> Report:
    """Check OUT without the source; see the module docstring."""
    t0 = time.perf_counter()
    out = Path(out)
    report = Report("verify", max_problems)
    if not out.is_dir():
        raise OutputError(f"{out}: no such output directory")
    manifest = read_manifest(report, out)
    report.info.update({"out": str(out), "conversion_id": manifest.get("conversion_id")})
    cfg = None
    try:
        cfg = load_config(out / "config.json")
    except LuciferError as e:
        report.add(Problem("manifest", f"{e}; cannot check the manifest against the rule table", file="config.json"))
    if cfg is not None:
        check_manifest_rules(report, manifest, cfg)
    for name in (manifest.get("source") or {}).get("side_files") or []:
        if not (out / name).is_file():
            report.add(Problem("file", f"{name}: copied from the source by convert, now missing", file=name))
    _stray_files(report, out, manifest)
    files = open_files(report, out, manifest)
    total = sum(t.end - t.start for rf in files.values() for t in rf.tensors.values())
    bar = byte_bar(total, "verify", progress)
    digests: dict[tuple[str, int, str], str] = {}
    checked_pad = 0
    n_tensors = 0
    jobs = [(role, rank, f, files[f.get("path", "")]) for role, rank, f in manifest_files(manifest)
            if f.get("path", "") in files]
    if workers is None:
        workers = min(os.cpu_count() or 1, len(jobs) or 1, 8)
    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="verify") as pool:
            futs = [pool.submit(_verify_file, max_problems, rf, f, role, rank,
                                manifest["roles"][role]["ranks"][rank]["tensors"], bar, chunk_bytes)
                    for role, rank, f, rf in jobs]
            for fut in futs:  # merged in manifest order: the report does not depend on thread timing
                sub, file_digests, n, pads = fut.result()
                report.merge(sub)
                digests.update(file_digests)
                n_tensors += n
                checked_pad += pads
    finally:
        bar.close()
        for rf in files.values():
            rf.close()
    _check_replicas(report, manifest, digests)
    seconds = time.perf_counter() - t0
    report.stats.update({
        "files": len(manifest_files(manifest)), "tensors": n_tensors, "bytes_hashed": total,
        "pad_bytes_checked": checked_pad, "seconds": round(seconds, 3),
        "bytes_per_s": round(total / seconds) if seconds else 0,
    })
    return report


@functools.lru_cache(maxsize=64)
def _stored_pad_mask(layout: str, matrix: tuple[int, ...],
                     regions: tuple[tuple[int, int, int], ...]) -> tuple[np.ndarray, int]:
    """Per-expert mask in the STORED layout of every bit that holds a zero-region bit in model layout.

    Expert layouts are bit permutations (zero stays zero), so a stored chunk has a non-zero pad bit
    exactly when `chunk & mask` is non-zero: the pads of kernel-layout experts are checked without
    inverting the layout; only a chunk that fails is inverted, to locate the bytes."""
    mask = np.zeros((1, *matrix), np.uint8)
    for dim, lo, hi in regions:
        mask[(0, *chunk_slices(dim, lo, hi, len(matrix), 1))] = 0xFF
    return layout_by_name(layout).forward(mask)[0], int(np.count_nonzero(mask))


def _verify_file(limit: int, rf: RankFile, entry: dict, role: str, rank: int, tensors: dict, bar: tqdm,
                 chunk_bytes: int) -> tuple[Report, dict, int, int]:
    """One streaming pass over a file: tensor digests, file digest, pad regions and scale bytes."""
    report = Report("verify", limit)
    digests: dict[tuple[str, int, str], str] = {}
    ordered = sorted(rf.tensors.items(), key=lambda kv: kv[1].start)
    tensor_digests = []
    pads = 0
    complete = True
    for name, ht in ordered:
        if rf.truncated(name):
            complete = False
            break
        info = tensors.get(name)
        check = info is not None and usable(rf, name, info) and info.get("file") == rf.rel
        regions = check and bool(info.get("zero_regions"))
        scale = check and is_scale(info)
        kernel = check and bool(info.get("experts")) and info.get("layout", "model") != "model"
        mask, mask_pads = None, 0
        if kernel and regions and info.get("pad") == "zero":
            mask, mask_pads = _stored_pad_mask(info["layout"], byte_shape(info["model_shape"][1:], ht.item),
                                    tuple(tuple(r) for r in info["zero_regions"]))
        h = blake3(max_threads=blake3.AUTO)
        for a, b in tensor_chunks(ht, chunk_bytes):
            stored = read_rows(rf.fd(), ht.start, ht.shape, ht.item, a, b,
                               scratch("read", (b - a) * ((ht.end - ht.start) // max(1, ht.shape[0]))))
            h.update(stored)
            bar.update(stored.nbytes)
            if not (regions or scale):
                continue
            if not kernel:
                if regions:
                    pads += check_pads(report, stored, info, ht, rf, role, rank, name, a, b)
                if scale:
                    check_scales(report, stored, info, ht, rf, role, rank, name, a)
                continue
            bad_pad = regions and (mask is None or _any_and(stored, mask))
            bad_scale = scale and bool((stored == 0xFF).any())  # scale layouts move whole bytes
            if regions and mask is not None:
                pads += mask_pads * (b - a)
            if bad_pad or bad_scale:
                model = to_model(stored, info["layout"]).reshape(b - a, *byte_shape(info["model_shape"][1:], ht.item))
                if bad_pad:
                    n = check_pads(report, model, info, ht, rf, role, rank, name, a, b)
                    pads += 0 if mask is not None else n
                if bad_scale:
                    check_scales(report, model, info, ht, rf, role, rank, name, a)
        d = h.hexdigest()
        tensor_digests.append(d)
        digests[(role, rank, name)] = d
        if info is not None and info.get("digest") != "blake3:" + d:
            report.add(Problem("data", f"digest {d[:16]}... differs from the manifest's "
                               f"{str(info.get('digest'))[7:23]}...: the bytes changed after conversion",
                               role, rank, name, rf.rel))
    if complete:
        fd = file_digest(rf.header, tensor_digests)
        if entry.get("digest") != "blake3:" + fd:
            report.add(Problem("file", f"{rf.rel}: file digest {fd[:16]}... differs from the manifest's "
                               f"{str(entry.get('digest'))[7:23]}...", role, rank, file=rf.rel))
    return report, digests, len(ordered), pads


def _any_and(stored: np.ndarray, mask: np.ndarray) -> bool:
    out = scratch("and", stored.nbytes).reshape(stored.shape)
    np.bitwise_and(stored, mask, out=out)
    return bool(out.any())


def _check_replicas(report: Report, manifest: dict, digests: dict) -> None:
    for role, doc in (manifest.get("roles") or {}).items():
        ranks = doc.get("ranks") or []
        if len(ranks) < 2:
            continue
        for name, info in sorted(ranks[0].get("tensors", {}).items()):
            if not is_replicated(manifest, role, name):
                continue
            recorded = {r: ranks[r]["tensors"][name].get("digest") for r in range(len(ranks))}
            if len(set(recorded.values())) > 1:
                report.add(Problem("replica", f"replicated tensor has different manifest digests across ranks "
                                   f"({', '.join(f'rank {r}: {str(d)[7:19]}' for r, d in recorded.items())})",
                                   role, None, name))
            got = {r: digests.get((role, r, name)) for r in range(len(ranks))}
            seen = {d for d in got.values() if d is not None}
            if len(seen) > 1:
                ref = got[0] or next(iter(seen))
                bad = [r for r, d in got.items() if d is not None and d != ref]
                report.add(Problem("replica", f"replicated tensor differs between ranks: rank(s) "
                                   f"{', '.join(map(str, bad))} differ from rank 0", role, bad[0], name,
                                   ranks[bad[0]]["tensors"][name].get("file")))


def _stray_files(report: Report, out: Path, manifest: dict) -> None:
    listed = {f.get("path") for _, _, f in manifest_files(manifest)}
    roles = manifest.get("roles") or {}
    tp = manifest.get("tp_size") or 0
    for role in ("target", "draft"):
        folder = out / role
        if not folder.is_dir():
            continue
        if role not in roles:
            report.add(Problem("file", f"{role}/: folder of a role this conversion did not write; remove it",
                               file=role))
            continue
        for child in sorted(folder.iterdir()):
            rel = str(child.relative_to(out))
            ok_rank = child.is_dir() and child.name.startswith("rank-") and child.name[5:].isdigit() \
                and int(child.name[5:]) < tp
            if not ok_rank:
                report.add(Problem("file", f"{rel}: unexpected entry in {role}/ (TP is {tp}); remove it", file=rel))
                continue
            for p in sorted(child.iterdir()):
                prel = str(p.relative_to(out))
                if prel not in listed:
                    report.add(Problem("file", f"{prel}: unexpected file in a rank folder (not in the manifest); "
                                       f"remove it", role, int(child.name[5:]), file=prel))


def verify_lines(report: Report) -> list[str]:
    s = report.stats
    lines = [f"verify {report.info.get('out')}  conversion {str(report.info.get('conversion_id'))[:16]}...", ""]
    lines += [
        f"  files checked      {s.get('files', 0)}",
        f"  tensors checked    {s.get('tensors', 0)}",
        f"  bytes hashed       {size(s.get('bytes_hashed', 0))}",
        f"  pad bytes checked  {size(s.get('pad_bytes_checked', 0))}",
        f"  time               {duration(s.get('seconds', 0))}",
        f"  throughput         {rate(s.get('bytes_per_s', 0))}",
        "",
    ]
    return lines + report.outcome_lines("manifest, files, digests, zero regions, scales and replicas all check out",
                                        "problem(s)")
