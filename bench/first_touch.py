"""Where lucifer_tp3's load time goes on a CPU model: first touch of fresh parameter memory.

    python bench/first_touch.py RANK_DIR SOURCE_DIR [--reps N]

Reads every tensor of RANK_DIR's rank files (one rank of `convert --expert-layout model`) into
freshly allocated tensors with the loader's own reader (src/lucifer_shard/runtime_shim/load/reader.py), page cache evicted
first, with and without its transparent-huge-page advice, each right after one of two predecessors:
another such load (whose freed memory the next reuses) or a buffered read of SOURCE_DIR (what the
floor, DefaultModelLoader and sharded_state leave behind). Prints wall and CPU seconds per case.
No vLLM: the reader is the loader's, the destinations are plain `torch.empty` like vLLM's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "shim")]
from measure import drop_caches  # noqa: E402
from vllm_cpu_model import read_once  # noqa: E402  (the load bench's floor; imports no vLLM)

from lucifer_shard.formats.stheader import read_header  # noqa: E402
from lucifer_shard.formats.torch_dtypes import TORCH_DTYPE  # noqa: E402
from lucifer_shard.runtime_shim.load import reader  # noqa: E402


def page_cache_read(source: Path) -> None:
    read_once(sorted(source.glob("*.safetensors")))
    drop_caches([source], everything=False)


def load(rank_dir: Path, huge_pages: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of reading every rank file into fresh tensors."""
    advise = reader._advise_huge_pages
    if not huge_pages:
        reader._advise_huge_pages = lambda reads: None
    keep = []
    drop_caches([rank_dir], everything=False)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for f in sorted(rank_dir.glob("*.safetensors")):
            h = read_header(f)
            reads = [reader.TensorRead(n, h.data_start + t.start, torch.empty(t.shape, dtype=TORCH_DTYPE[t.dtype]))
                     for n, t in h.tensors.items()]
            keep += reads
            reader.read_tensors(f, reads)
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        reader._advise_huge_pages = advise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rank_dir", type=Path)
    ap.add_argument("source", type=Path)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    for rep in range(args.reps):
        for after in ("page-cache read", "lucifer load"):
            for huge in (True, False):
                if after == "page-cache read":
                    page_cache_read(args.source)
                else:
                    load(args.rank_dir, huge)
                wall, cpu = load(args.rank_dir, huge)
                print(f"rep {rep + 1}  after a {after:<15}  huge pages {'on ' if huge else 'off'}  "
                      f"{wall:5.2f} s  CPU {cpu:5.2f} s", flush=True)


if __name__ == "__main__":
    main()
