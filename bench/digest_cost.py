"""Where verify=full's warm cost goes (issue 41): the host's memory-copy ceiling, BLAKE3's own rate by
thread count and update size (alone, and beside four threads reading the page cache), and the reader
(src/lucifer_shard/runtime_shim/load/reader.py) warm onto the device with digests off and on under other thread, slot and chunk
settings, and beside a hasher streaming through a large (memory) or a small (cache) buffer.

    python bench/digest_cost.py --json digest-cost.json        # the GPU host, ~1 min, ~4 GB in /tmp
    python bench/digest_cost.py --device cpu --gb 0.02 --tensor-mb 4 --buffer-mib 8 --json x   # the plumbing

Every figure is written to --json as soon as it is measured. The file is one warm "rank file" of
805 MB tensors (`--tensor-mb`: a Flash TP3 rank's w13), written through the page cache and read once
before.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from blake3 import blake3

from lucifer_shard.runtime_shim.load import reader

MiB = 1 << 20
W13_MB = 805  # a Flash TP3 rank's w13, U8[256, 1536, 2048]: 805.3 MB


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--gb", type=float, default=4.0, help="size of the warm file (GB)")
    p.add_argument("--file", type=Path, default=Path("/tmp/digest-cost.bin"), help="the warm file (removed at the end)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--tensor-mb", type=float, default=W13_MB, help="size of each tensor of the file (MB)")
    p.add_argument("--buffer-mib", type=int, default=256,
                   help="the hashed buffer (MiB); the memory-copy and background buffers are 8 times it")
    return p.parse_args(argv)


class Results(dict):
    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __setitem__(self, key: str, value) -> None:
        super().__setitem__(key, value)
        print(key, value, flush=True)
        self.path.write_text(json.dumps(self, indent=1))


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e9 / seconds, 2)


def write_warm_file(path: Path, n: int, tensor: int) -> None:
    g = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(torch.randint(0, 256, (tensor,), dtype=torch.uint8, generator=g).numpy().tobytes())
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


def memcpy_ceiling(res: Results, nbytes: int) -> None:
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros_like(a)
    threads = torch.get_num_threads()
    for k in (1, 4, 8, 16):
        torch.set_num_threads(k)
        b.copy_(a)
        t = time.perf_counter()
        for _ in range(3):
            b.copy_(a)
        res[f"memory copy {nbytes >> 20} MiB, {k} threads"] = gbps(3 * a.numel(), time.perf_counter() - t)
    torch.set_num_threads(threads)


def hash_rate(view: memoryview, max_threads: int, update: int, seconds: float) -> float:
    """GB/s of one hasher fed `update` bytes at a time from VIEW, for about SECONDS."""
    h, n, t = blake3(max_threads=max_threads), 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        for o in range(0, len(view), update):
            h.update(view[o:o + update])
            n += min(update, len(view) - o)
    return gbps(n, time.perf_counter() - t)


def with_background(work: Callable[[threading.Event], None], measure: Callable[[], object]) -> object:
    """MEASURE while WORK runs on its own thread until measured (WORK's error is raised)."""
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(work, stop)
        try:
            got = measure()
        finally:
            stop.set()
        done.result()
    return got


def hashing(res: Results, path: Path, pinned: bool, nbytes: int) -> None:
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    view = memoryview((buf.pin_memory() if pinned else buf).numpy())
    for mt in (1, 4, 8, 12, blake3.AUTO):
        for upd in (16, 64, 256):
            res[f"hash max_threads={mt} update={upd}MiB"] = hash_rate(view, mt, upd * MiB, 0.6)

    size = path.stat().st_size

    piece = min(16 * MiB, size)

    def readers(stop: threading.Event, k: int = 4) -> None:  # four threads reading the warm file, as the reader's
        def one(i: int) -> None:
            b, off = bytearray(piece), i * piece % (size - piece + 1)
            fd = os.open(path, os.O_RDONLY)
            try:
                while not stop.is_set():
                    os.preadv(fd, [b], off)
                    off = (off + piece) % (size - piece + 1)
            finally:
                os.close(fd)
        with ThreadPoolExecutor(k) as pool:
            for f in [pool.submit(one, i) for i in range(k)]:
                f.result()

    for mt in (1, 8, 11, blake3.AUTO):
        res[f"hash max_threads={mt} update=16MiB, 4 readers beside"] = with_background(
            readers, lambda mt=mt: hash_rate(view, mt, 16 * MiB, 1.0))
    for k in (4, 8):
        def hashers(k: int = k) -> float:
            with ThreadPoolExecutor(k) as pool:
                return round(sum(pool.map(lambda _: hash_rate(view, 1, 16 * MiB, 1.0), range(k))), 2)
        res[f"{k} hashers max_threads=1 at once, 4 readers beside"] = with_background(readers, hashers)


def reading(res: Results, path: Path, n: int, tensor: int, device: torch.device, background: int) -> None:
    size = path.stat().st_size
    dst = [torch.empty(tensor, dtype=torch.uint8, device=device) for _ in range(n)]
    reads = [reader.TensorRead(f"t{i}", i * tensor, dst[i]) for i in range(n)]

    def run(digests: bool, reps: int = 3, **kw) -> list[float]:
        reader.read_tensors(path, reads, digests=digests, **kw)  # the pinned ring, allocated once per shape
        out = []
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            reader.read_tensors(path, reads, digests=digests, **kw)
            sync(device)
            out.append(gbps(size, time.perf_counter() - t))
        return out

    for digests in (False, True):
        res[f"reader digests={'on' if digests else 'off'} (defaults)"] = run(digests)
    for threads, slots, chunk in ((4, 16, 16), (4, 32, 16), (3, 16, 16), (6, 16, 16), (8, 16, 16), (4, 8, 32),
                                  (4, 8, 64), (4, 16, 4), (4, 32, 4)):
        for digests in (False, True):
            res[f"reader digests={'on' if digests else 'off'} threads={threads} slots={slots} chunk={chunk}MiB"] = \
                run(digests, threads=threads, slots=slots, chunk=chunk * MiB)

    big = torch.ones(background, dtype=torch.uint8)
    for label, buf in ((f"{background >> 20} MiB (memory)", big), ("8 MiB (cache)", big[:8 * MiB])):
        rate: list[float] = []

        def hasher(stop: threading.Event, view: memoryview = memoryview(buf.numpy())) -> None:
            h, n, t = blake3(max_threads=8), 0, time.perf_counter()
            while not stop.is_set():
                for o in range(0, len(view), 16 * MiB):
                    h.update(view[o:o + 16 * MiB])
                    n += min(16 * MiB, len(view) - o)
            rate.append(gbps(n, time.perf_counter() - t))
        got = with_background(hasher, lambda: run(False))
        res[f"reader digests=off, a max_threads=8 hasher over {label} beside"] = {"reader": got, "hasher": rate[0]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> Results:
    args = parse(argv)
    device = torch.device(args.device)
    res = Results(args.json)
    res["cores"] = len(os.sched_getaffinity(0))
    tensor = int(args.tensor_mb * 1e6)
    n = max(1, round(args.gb * 1e9 / tensor))
    write_warm_file(args.file, n, tensor)
    try:
        memcpy_ceiling(res, 8 * args.buffer_mib * MiB)
        hashing(res, args.file, device.type == "cuda", args.buffer_mib * MiB)
        reading(res, args.file, n, tensor, device, 8 * args.buffer_mib * MiB)
    finally:
        args.file.unlink()
    return res


if __name__ == "__main__":
    main()
