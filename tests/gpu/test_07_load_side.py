"""The load side of pre-sharding on hardware, for one Flash MoE layer's routed experts (256) of one
rank: kernel-ready tensors on the GPU

  * from the rank file: safetensors read -> .cuda(), nothing else (they are in kernel layout);
  * from the original checkpoint, as a runtime without pre-sharding prepares them
    (gpu_harness.runtime_prepare: read the source tensors, narrow, pad, swap the halves, FlashInfer's
    own SM90 interleave helpers on the GPU).

Both must give the same bytes, on every rank. Timed on LOAD_RANK, REPS times each with the page
cache dropped before every read ("cold") and then, after one untimed read of both, with both
inputs cached ("warm"), alternating the two paths; medians, bytes of the tensors read, and the
process's storage reads are recorded.
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

import gpu_harness as H

pytestmark = pytest.mark.gpu

LOAD_RANK = 0
REPS = 3
RANK_FILE, RUNTIME = "rank file -> cuda()", "source -> runtime preparation"


def test_rank_file_equals_runtime_preparation_and_loads_faster(fi, checkpoints):
    _, fmoe = fi
    ck = checkpoints(H.FLASH)
    man = H.manifest(ck.out)

    def from_rank_file(rank: int) -> tuple[dict[str, torch.Tensor], int]:
        t = H.load_rank_stored(ck.out, rank, H.DEVICE, man=man)
        H.sync()
        return t, sum(v.numel() for v in t.values())

    paths = {RANK_FILE: from_rank_file, RUNTIME: lambda rank: H.runtime_prepare(ck.src, rank, fmoe, H.DEVICE)}

    equal = {}
    for r in range(H.TP):  # also warms FlashInfer's modules and the allocator
        a, _ = from_rank_file(r)
        b, _ = paths[RUNTIME](r)
        equal[r] = {n: bool(torch.equal(a[n], b[n])) for n in H.NAMES}
        del a, b

    files = sorted({ck.out / t["file"] for t in man["roles"][H.ROLE]["ranks"][LOAD_RANK]["tensors"].values()}
                   | set(ck.src.glob("*.safetensors")))
    runs = {p: {"cold": [], "warm": []} for p in paths}      # wall seconds
    storage = {p: {"cold": [], "warm": []} for p in paths}   # /proc/self/io read_bytes
    nbytes, cache_drop = {}, ""
    for cache in ("cold", "warm"):
        if cache == "warm":  # the cold runs dropped one another's files: read both once, untimed
            for fn in paths.values():
                fn(LOAD_RANK)
        for _ in range(REPS):
            for p, fn in paths.items():
                if cache == "cold":
                    cache_drop = H.drop_page_cache(files)
                io0 = H.io_counters()
                t0 = time.perf_counter()
                tensors, nbytes[p] = fn(LOAD_RANK)
                runs[p][cache].append(round(time.perf_counter() - t0, 4))
                io1 = H.io_counters()
                storage[p][cache].append(io1["read_bytes"] - io0["read_bytes"] if io0 and io1 else None)
                del tensors
    med = {p: {c: statistics.median(v) for c, v in d.items()} for p, d in runs.items()}
    H.record("load_side", preset=ck.preset, experts=ck.experts, rank=LOAD_RANK, reps=REPS, cache_drop=cache_drop,
             bytes_read=nbytes, storage_read_bytes=storage, times_s=runs, median_s=med,
             speedup={c: med[RUNTIME][c] / med[RANK_FILE][c] for c in ("cold", "warm")},
             equal_by_rank=equal, kernel_bytes=nbytes[RANK_FILE])
    bad = {r: [n for n, ok in e.items() if not ok] for r, e in equal.items() if not all(e.values())}
    assert not bad, f"runtime preparation differs from the rank files: {bad}"
