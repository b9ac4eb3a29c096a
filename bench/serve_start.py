"""How long `lucifer-shard serve OUT` takes from its start to the exec of vLLM (issues 34 and 43: at most 2 s),
measured where users run it: inside a vLLM environment.

A stand-in `vllm` command is put first on PATH: it writes the time it was started and exits. Everything
else is the environment's own: run from a vLLM venv (`make bench-serve` runs it in the shim suite's,
tools/vllm-env.sh), serve's preflight sees that venv's vLLM, torch and FlashInfer, and would import
them if it imported vLLM before exec (issue 43: it did, through `find_spec("vllm._version")`). Run
where no vLLM is installed, it adds vllm 0.34.0's package metadata (a vetted stock build, no code) so
that the preflight passes, and says so. The figure is the wall time from just before the `lucifer-shard
serve` process is created to the stand-in's first line: python's start, the CLI's imports, the
preflight and the exec.

    python bench/serve_start.py [--out OUT] [--reps 5] [--json FILE]

Without --out it writes a synthetic checkpoint and its TP3 output into a temporary folder.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
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
STANDIN_VERSION = "0.34.0"  # the package metadata added where no vLLM is installed
# A stand-in nvidia-smi: serve refuses to start vLLM's CUDA build where no GPU is visible, and its users run it on
# a GPU host (serve asks nvidia-smi, as there)
STANDIN_GPU = """#!/bin/sh
echo "NVIDIA H200, 9.0"
"""


def installed_vllm() -> str | None:
    """The vLLM release installed beside this interpreter (None: none)."""
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


def standin(root: Path) -> dict[str, str]:
    """A stand-in `vllm` command (and `nvidia-smi`) under `root` and the environment that puts it first on PATH
    (and, where no vLLM is installed, PYTHONPATH for its package metadata)."""
    bin_dir, site = root / "bin", root / "site"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("vllm", STANDIN), ("nvidia-smi", STANDIN_GPU)):
        exe = bin_dir / name
        exe.write_text(text)
        exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    if installed_vllm() is None:
        info = site / f"vllm-{STANDIN_VERSION}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {STANDIN_VERSION}\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env.pop("LUCIFER_SHARD_SERVE", None)
    return env


def time_serve_start(out: Path, root: Path, *serve_args: str, python_flags: tuple[str, ...] = ()
                     ) -> tuple[float, list[str], str]:
    """Seconds from the start of `lucifer-shard serve OUT` (this interpreter, with `python_flags`) to the
    exec of the stand-in vLLM under `root`, the argv the stand-in got, and serve's stderr."""
    env = standin(root)
    stamp = root / "stamp"
    env["LUCIFER_BENCH_STAMP"] = str(stamp)
    stamp.unlink(missing_ok=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, *python_flags, "-m", "lucifer_shard.cli", "serve", str(out), *serve_args],
                       env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not stamp.exists():
        raise RuntimeError(f"serve did not exec the stand-in (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    return float(stamp.read_text()) - t0, (root / "stamp.argv").read_text().splitlines(), r.stderr


def imported_before_exec(out: Path, root: Path, *serve_args: str) -> list[str]:
    """The top-level packages among vllm, torch and flashinfer that serve imports before it execs vLLM
    (`python -X importtime`, whose lines end with the module's dotted name)."""
    stderr = time_serve_start(out, root, *serve_args, python_flags=("-X", "importtime"))[2]
    names = {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}
    return sorted(n for n in ("vllm", "torch", "flashinfer") if n in names)


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
        imported = imported_before_exec(out, root / "standin")
        manifest = (out / "lucifer-manifest.json").stat().st_size
    finally:
        shutil.rmtree(root, ignore_errors=True)
    vllm = installed_vllm()
    where = f"in a vLLM {vllm} environment" if vllm else \
        f"without vLLM (vllm {STANDIN_VERSION}'s package metadata only: run it in a vLLM venv, make bench-serve)"
    result = {"reps": args.reps, "median_s": statistics.median(times), "max_s": max(times), "min_s": min(times),
              "times_s": times, "vllm": vllm, "python": sys.version.split()[0], "environment": where,
              "imported_before_exec": imported, "manifest_bytes": manifest, "target_s": 2.0}
    print(f"lucifer-shard serve, start to exec of vllm {where}: median {result['median_s']:.2f} s, max "
          f"{result['max_s']:.2f} s over {args.reps} runs (target <= 2 s); imported before exec: "
          f"{', '.join(imported) or 'none of vllm, torch, flashinfer'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
