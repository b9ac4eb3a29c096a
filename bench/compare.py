"""Race the engine of another git revision against the working tree's, interleaved, same source.

    python3 bench/compare.py REV MODEL [--reps 3] [--workers 1 3] [--dir /work/bench-tmp]

REV's package (`src/lucifer_shard/`, or before the move to src/ its `converter/` and `configs/`) is unpacked
with `git archive` into a temporary directory and run through PYTHONPATH (so the installed editable package is shadowed only for those runs); the page
cache is dropped before every run, as in bench.py. Prints one JSON line per run and a median table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import drop_caches  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def unpack(rev: str, into: Path) -> Path:
    """REV's package under `into`, importable as lucifer_shard with `into` on PYTHONPATH."""
    def archive(*paths: str) -> bytes | None:
        r = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *paths], capture_output=True)
        return r.stdout if r.returncode == 0 else None

    if (tar := archive("src/lucifer_shard")) is not None:  # folders are import names
        subprocess.run(["tar", "-x", "-C", str(into), "--strip-components=1"], input=tar, check=True)
        return into
    tar = archive("converter", "configs")  # the layout before src/: converter/ was lucifer_shard (package-dir)
    if tar is None:
        raise SystemExit(f"compare: {rev} has neither src/lucifer_shard/ nor converter/")
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    (into / "lucifer_shard").symlink_to("converter")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev")
    ap.add_argument("model", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("BENCH_DIR", "/work/bench-tmp")))
    args = ap.parse_args()
    out = args.dir / "compare-out"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        old = unpack(args.rev, Path(tmp))
        engines = {args.rev: {"PYTHONPATH": str(old)}, "working tree": {}}
        for _ in range(args.reps):
            for w in args.workers:
                for label, env in engines.items():
                    shutil.rmtree(out, ignore_errors=True)
                    drop_caches([args.model])
                    cmd = [sys.executable, "-m", "lucifer_shard.cli", "convert", "--tp", str(args.tp), "--arch", "sm120",
                           "--quiet", "--workers", str(w), str(args.model), str(out)]
                    t0 = time.perf_counter()
                    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, **env}, cwd=str(args.dir))
                    _, status, ru = os.wait4(proc.pid, 0)
                    if os.waitstatus_to_exitcode(status):
                        raise SystemExit(f"{label}: convert failed")
                    r = {"engine": label, "workers": w, "wall": round(time.perf_counter() - t0, 2),
                         "rss_gib": round(ru.ru_maxrss / 2**20, 2), "cpu": round(ru.ru_utime + ru.ru_stime, 1)}
                    runs.append(r)
                    print(json.dumps(r), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    print("\n| engine | --workers | walls (s) | median wall (s) | peak RSS (GiB) | CPU (s) |\n|---|---|---|---|---|---|")
    for label in engines:
        for w in args.workers:
            rs = [r for r in runs if r["engine"] == label and r["workers"] == w]
            print(f"| {label} | {w} | {', '.join(str(r['wall']) for r in rs)} | "
                  f"{statistics.median(r['wall'] for r in rs):.1f} | {max(r['rss_gib'] for r in rs):.2f} | "
                  f"{statistics.median(r['cpu'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
