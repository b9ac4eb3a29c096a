"""`verify OUT`: the integrity of a converted output without the source checkpoint.

Checks, collected into one report (nothing stops at the first problem unless the manifest itself
cannot be read): the manifest's self-digest; `COMPLETE` equal to the conversion id; the manifest's
tensor entries equal to what the rule table gives for OUT/config.json and the recorded options;
every listed file present with the recorded size, digest and `__metadata__` identity; header
names, shapes and dtypes as recorded; every zero region zero (or -inf) after the inverse layout;
no E8M0 scale byte 0xFF; replicated tensors byte-equal on every rank; no stray files in rank
folders. Each file is read once: the digest and the content checks share one streaming pass.

The checks `diff` shares live beside this module: the problem report (`report`), the rank-file
reader (`rankfile`), the pad and scale checks of a chunk (`pads`) and the manifest and file
structure (`structure`).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from blake3 import blake3
from tqdm import tqdm

from .. import stops
from ..errors import OutputError
from ..guarded_io import naming
from ..model.layouts import layout_by_name
from ..output.manifest import file_digest
from ..output.manifest_types import FileRecord, Manifest, TensorRecord
from ..output.output_check import Expected
from ..units import byte_bar, duration, rate, size
from .pads import check_pads, check_scales, chunk_slices, is_scale, to_model
from .rankfile import CHUNK_BYTES, HeaderTensor, RankFile, byte_shape, read_rows, row_chunks, scratch
from .report import Problem, Report
from .structure import check_strays, is_replicated, open_files, read_manifest, usable

logger = logging.getLogger("lucifer_shard.verify")  # -v: a line per rank file, -vv: per tensor


def tensor_chunks(ht: HeaderTensor, limit: int) -> list[tuple[int, int]]:
    shape = ht.shape
    n0 = shape[0] if shape else 1
    total = ht.end - ht.start
    return row_chunks(n0, total // max(1, n0), limit)


def verify(out: Path, max_problems: int = 10, progress: bool = True, chunk_bytes: int = CHUNK_BYTES,
           workers: int | None = None) -> Report:
    """Check OUT without the source; see the module docstring."""
    t0 = time.perf_counter()
    out = Path(out)
    report = Report("verify", max_problems)
    if not out.is_dir():
        raise OutputError(f"{out}: no such output directory")
    checked = read_manifest(report, out)
    manifest, held, expected = checked.manifest, checked.held, checked.expected
    report.info.update({"out": str(out), "conversion_id": manifest.conversion_id})
    check_strays(report, out, manifest, held)
    files = open_files(report, out, manifest, held)
    total = sum(t.end - t.start for rf in files.values() for t in rf.tensors.values())
    bar = byte_bar(total, "verify", progress)
    digests: dict[tuple[str, int, str], str] = {}
    checked_pad = 0
    n_tensors = 0
    jobs = [(role, rank, f, files[f.path]) for role, rank, f in manifest.files(held) if f.path in files]
    if workers is None:
        workers = min(os.cpu_count() or 1, len(jobs) or 1, 8)
    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="verify") as pool:
            futs = [pool.submit(_verify_file, max_problems, rf, f, role, rank,
                                _as_planned(manifest.rank(role, rank).tensors, expected, role, rank), bar, chunk_bytes)
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
        "files": len(jobs), "tensors": n_tensors, "bytes_hashed": total,
        "pad_bytes_checked": checked_pad, "seconds": round(seconds, 3),
        "bytes_per_s": round(total / seconds) if seconds else 0,
    })
    return report


def _as_planned(got: dict[str, TensorRecord], expected: Expected | None, role: str,
                rank: int) -> dict[str, TensorRecord]:
    """The rank's records with the rule table's planned fields (the output check's entries): pads and
    scales are read as the rule table lays them out, whatever an edited record says (that record is a
    finding already); digests stay as recorded."""
    ranks = expected.entries.get(role, []) if expected else []
    want = ranks[rank] if rank < len(ranks) else {}
    return {name: replace(r, **{k: getattr(want[name], k) for k in TensorRecord.PLANNED}) if name in want else r
            for name, r in got.items()}


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


def _verify_file(limit: int, rf: RankFile, entry: FileRecord, role: str, rank: int, tensors: dict[str, TensorRecord],
                 bar: tqdm,
                 chunk_bytes: int) -> tuple[Report, dict, int, int]:
    """One streaming pass over a file: tensor digests, file digest, pad regions and scale bytes."""
    try:
        with naming(rf.path):  # a read the disk refuses names the file
            return _verify_open_file(limit, rf, entry, role, rank, tensors, bar, chunk_bytes)
    finally:
        rf.close()  # one descriptor per worker at a time, however many files OUT has


def _verify_open_file(limit: int, rf: RankFile, entry: FileRecord, role: str, rank: int,
                      tensors: dict[str, TensorRecord], bar: tqdm,
                      chunk_bytes: int) -> tuple[Report, dict, int, int]:
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
        check = info is not None and usable(rf, name, info) and info.file == rf.rel
        regions = check and bool(info.zero_regions)
        scale = check and is_scale(info)
        kernel = check and info.stacked and info.kernel
        mask, mask_pads = None, 0
        if kernel and regions and info.pad == "zero":
            mask, mask_pads = _stored_pad_mask(info.layout, byte_shape(info.model_shape[1:], ht.item),
                                               info.zero_regions)
        h = blake3(max_threads=blake3.AUTO)
        for a, b in tensor_chunks(ht, chunk_bytes):
            stops.check()  # on a worker: the stop reaches the main thread through the file's future
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
                model = to_model(stored, info.layout).reshape(b - a, *byte_shape(info.model_shape[1:], ht.item))
                if bad_pad:
                    n = check_pads(report, model, info, ht, rf, role, rank, name, a, b)
                    pads += 0 if mask is not None else n
                if bad_scale:
                    check_scales(report, model, info, ht, rf, role, rank, name, a)
        d = h.hexdigest()
        logger.debug("%s %s: blake3 %s...", rf.rel, name, d[:16])
        tensor_digests.append(d)
        digests[(role, rank, name)] = d
        if info is not None and info.digest != "blake3:" + d:
            report.add(Problem("data", f"digest {d[:16]}... differs from the manifest's "
                               f"{info.digest[7:23]}...: the bytes changed after conversion",
                               role, rank, name, rf.rel))
    if complete:
        fd = file_digest(rf.header, tensor_digests)
        if entry.digest != "blake3:" + fd:
            report.add(Problem("file", f"{rf.rel}: file digest {fd[:16]}... differs from the manifest's "
                               f"{entry.digest[7:23]}...", role, rank, file=rf.rel))
    logger.info("%s rank %d %s: %d tensor(s) hashed and checked, %d finding(s)", role, rank, rf.rel, len(ordered),
                report.count)
    return report, digests, len(ordered), pads


def _any_and(stored: np.ndarray, mask: np.ndarray) -> bool:
    out = scratch("and", stored.nbytes).reshape(stored.shape)
    np.bitwise_and(stored, mask, out=out)
    return bool(out.any())


def _check_replicas(report: Report, manifest: Manifest, digests: dict) -> None:
    for role, ranks in manifest.roles.items():
        if len(ranks) < 2:
            continue
        for name in sorted(ranks[0].tensors):
            if not is_replicated(manifest, role, name):
                continue
            recorded = {e.rank: e.tensors[name].digest for e in ranks}
            if len(set(recorded.values())) > 1:
                report.add(Problem("replica", f"replicated tensor has different manifest digests across ranks "
                                   f"({', '.join(f'rank {r}: {str(d)[7:19]}' for r, d in recorded.items())})",
                                   role, None, name))
            got = {e.rank: digests.get((role, e.rank, name)) for e in ranks}
            seen = {d for d in got.values() if d is not None}
            if len(seen) > 1:
                ref = got[0] or next(iter(seen))
                bad = [r for r, d in got.items() if d is not None and d != ref]
                report.add(Problem("replica", f"replicated tensor differs between ranks: rank(s) "
                                   f"{', '.join(map(str, bad))} differ from rank 0", role, bad[0], name,
                                   manifest.rank(role, bad[0]).tensors[name].file))


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
