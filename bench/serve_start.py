"""How long `lucifer-shard serve OUT` takes from its start to the exec of vLLM (issue 34: at most 2 s).

A stand-in vLLM is put in front: a `vllm` command on PATH that writes the time it was started and
exits, and package metadata saying vllm 0.33.0 (so serve's preflight sees a vetted stock build
without vLLM itself, which the preflight before exec must not import anyway). The figure is the wall
time from just before the `lucifer-shard serve` process is created to the stand-in's first line:
python's start, the CLI's imports, the preflight and the exec.

    python bench/serve_start.py [--out OUT] [--reps 5] [--json FILE]

Without --out it writes a synthetic checkpoint and its TP3 output into a temporary folder.
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

STANDIN = """#!/bin/sh
date +%s.%N > "$LUCIFER_BENCH_STAMP"
printf '%s\\n' "$@" > "$LUCIFER_BENCH_STAMP.argv"
"""
METADATA = "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n"


def standin(root: Path) -> dict[str, str]:
    """A stand-in vLLM under `root`: the environment that puts it first (PATH, and PYTHONPATH for its
    package metadata)."""
    bin_dir, site = root / "bin", root / "site"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (site / "vllm-0.33.0.dist-info").mkdir(parents=True, exist_ok=True)
    (site / "vllm-0.33.0.dist-info" / "METADATA").write_text(METADATA)
    exe = bin_dir / "vllm"
    exe.write_text(STANDIN)
    exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    env.pop("LUCIFER_SHARD_SERVE", None)
    return env


def time_serve_start(out: Path, root: Path, *serve_args: str) -> tuple[float, list[str]]:
    """Seconds from the start of `lucifer-shard serve OUT` to the exec of the stand-in vLLM under
    `root`, and the argv the stand-in got."""
    env = standin(root)
    stamp = root / "stamp"
    env["LUCIFER_BENCH_STAMP"] = str(stamp)
    stamp.unlink(missing_ok=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "lucifer_shard.cli", "serve", str(out), *serve_args], env=env,
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not stamp.exists():
        raise RuntimeError(f"serve did not exec the stand-in (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    return float(stamp.read_text()) - t0, (root / "stamp.argv").read_text().splitlines()


def _synthetic_output(root: Path) -> Path:
    model, out = root / "model", root / "out"
    for argv in (["synth", "tiny", str(model), "-q"],
                 ["convert", "--tp", "3", "--expert-layout", "model", str(model), str(out), "-q"]):
        subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *argv], check=True, capture_output=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="an existing output (default: a synthetic TP3 output)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lucifer-serve-start-"))
    try:
        out = args.out or _synthetic_output(root)
        times = [time_serve_start(out, root / "standin")[0] for _ in range(args.reps)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    manifest = (out / "lucifer-manifest.json").stat().st_size if args.out else None
    result = {"reps": args.reps, "median_s": statistics.median(times), "max_s": max(times), "min_s": min(times),
              "times_s": times, "manifest_bytes": manifest, "target_s": 2.0}
    print(f"lucifer-shard serve, start to exec of vllm: median {result['median_s']:.2f} s, max {result['max_s']:.2f} s "
          f"over {args.reps} runs (target <= 2 s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
