"""A conversion from the Hub, streamed, against download-then-convert (issue 51): wall time, the most
source bytes on disk at once, and the rank files byte-identical, from the Hub stand-in on 127.0.0.1
(tests/hubserver.py: huggingface_hub's own client downloads, as from the Hub).

Routes, each on the same synthetic checkpoint and options, one after the other (the rank files of each
compared byte for byte with the conversion from disk):

    disk      the checkpoint already on disk (the conversion alone: the floor of the others)
    snapshot  the download alone: huggingface_hub's snapshot_download of the repo (its 8 workers) into a
              fresh HF cache, no conversion
    keep      convert --keep-source: the whole checkpoint downloaded into a fresh HF cache, then converted
    stream    convert (default): each shard downloaded just before the first part that reads it, removed
              after the last, the next part's download running while a part is written

Each route runs with the server paced to each of --rate (the link, a network slower than the disk, where
streaming overlaps the download with the conversion; 0: the loopback's own speed), every connection capped
at a --conn-share'th of it (as a CDN caps each connection). A sampler reads the bytes under the download
folder (stream) or the HF cache (keep, snapshot) every 50 ms: the peak source bytes on disk. `source_rate`:
the shards' bytes over the time from their first byte sent to their last, as the server saw them.

    python bench/hub_stream.py [--dir DIR] [--layers 1] [--rate 200M,1G] [--conn-share 4]
                               [--routes snapshot,stream] [--json bench/hub_stream.json]
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hubserver import HubServer  # noqa: E402  (the Hub stand-in the tests use)

from lucifer_shard.units import parse_size, size  # noqa: E402

REPO = "bench/flash-layer"


def cli(*args: object, env: dict | None = None) -> None:
    r = subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *map(str, args)], env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(f"{args[0]} failed: {r.stderr[-2000:]}")


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class Sampler:
    """The peak of `tree_bytes(path)`, read every 50 ms on a thread while a route runs."""

    def __init__(self, path: Path):
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, tree_bytes(self.path))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def rank_files_equal(a: Path, b: Path) -> bool:
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*.safetensors"))
    return names == sorted(str(p.relative_to(b)) for p in b.rglob("*.safetensors")) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def snapshot(env: dict) -> None:
    """huggingface_hub's own download of the whole repo, in a fresh interpreter (HF_ENDPOINT read at import)."""
    code = f"from huggingface_hub import snapshot_download; snapshot_download({REPO!r})"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"snapshot_download failed: {r.stderr[-2000:]}")


def run_route(route: str, hub: HubServer, work: Path, model: Path, options: list[str]) -> dict:
    out, home = work / f"out-{route}", work / f"hf-{route}"
    for p in (out, home):
        shutil.rmtree(p, ignore_errors=True)
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    source = {"disk": model, "keep": REPO, "stream": REPO}.get(route)
    extra = ["--keep-source"] if route == "keep" else []
    watched = {"disk": model, "keep": home, "snapshot": home, "stream": out / ".lucifer" / "download"}[route]
    sent, first = hub.bytes_sent(".safetensors"), len(hub.requests)
    t0 = time.perf_counter()
    with Sampler(watched) as sampler:
        if route == "snapshot":
            snapshot(env)
        else:
            cli("convert", "--tp", "3", source, out, *options, *extra, "-q", env=env)
    wall = time.perf_counter() - t0
    rate = hub.rate_since(first, ".safetensors", beyond=1 << 18)
    return {"route": route, "wall_s": round(wall, 2), "peak_source_bytes": sampler.peak if route != "disk" else None,
            "downloaded_bytes": hub.bytes_sent(".safetensors") - sent,
            "source_rate_bytes_per_s": round(rate) if rate else None, "out": out, "home": home}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/lucifer-hub-bench"))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--rate", default="200M,1G", help="the paced runs' link rates, bytes per second (0: loopback)")
    ap.add_argument("--conn-share", type=int, default=4, help="each connection capped at the link rate over this")
    ap.add_argument("--routes", default="snapshot,stream", help="of snapshot, keep, stream, at each rate")
    ap.add_argument("--max-file-size", default="1G")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = work / "model"
    cli("synth", "flash-layer", model, "--layers", args.layers, "--shards", args.shards, "-q")
    source_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    options = ["--max-file-size", args.max_file_size]
    rates = [parse_size(r) or None for r in args.rate.split(",")]
    rows = []
    with HubServer({REPO: model}) as hub:
        reference = run_route("disk", hub, work, model, options)  # the one from disk, kept to compare with
        rows.append({**{k: v for k, v in reference.items() if k not in ("out", "home")}, "rate_bytes_per_s": None,
                     "conn_rate_bytes_per_s": None, "rank_files_identical": True})
        for rate in rates:
            hub.rate = rate
            hub.conn_rate = rate / args.conn_share if rate else None
            for route in args.routes.split(","):
                res = run_route(route, hub, work, model, options)
                same = rank_files_equal(res["out"], reference["out"]) if route != "snapshot" else None
                rows.append({**{k: v for k, v in res.items() if k not in ("out", "home")}, "rate_bytes_per_s": rate,
                             "conn_rate_bytes_per_s": hub.conn_rate, "rank_files_identical": same})
                shutil.rmtree(res["out"], ignore_errors=True)  # one route's files at a time: the disk is shared
                shutil.rmtree(res["home"], ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    import huggingface_hub

    doc = {"machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}, "
                      f"huggingface_hub {huggingface_hub.__version__}",
           "date": time.strftime("%Y-%m-%d"), "checkpoint": f"synth flash-layer --layers {args.layers} "
           f"--shards {args.shards}: {source_bytes:,} bytes in shards", "options": options, "rows": rows}
    for row in rows:
        pace = (f"{size(row['rate_bytes_per_s'])}/s" if row["rate_bytes_per_s"] else
                "-" if row["route"] == "disk" else "loopback")
        peak = size(row["peak_source_bytes"]) if row["peak_source_bytes"] is not None else "-"
        got = f"{size(row['source_rate_bytes_per_s'])}/s" if row.get("source_rate_bytes_per_s") else "-"
        print(f"{pace:>12} {row['route']:<8} wall {row['wall_s']:>7.1f} s  peak source on disk {peak:>10}  "
              f"downloaded {size(row['downloaded_bytes'])} at {got}  identical {row['rank_files_identical']}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
