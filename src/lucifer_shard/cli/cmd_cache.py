"""`lucifer-shard cache`: record, verify and show the kernel cache a share carries (runtime_shim/serving/kernel_cache.py)."""
from __future__ import annotations

from pathlib import Path

import click

from .console import Console, conventions


@click.command("cache")
@click.argument("action", type=click.Choice(("record", "verify", "show")))
@click.argument("out", type=click.Path(path_type=Path))
@conventions(interrupted="interrupted: a record is written last (record.json), so none or the old one stands; run it "
                         "again")
def cache(action: str, out: Path) -> None:
    """The compilers' caches vLLM's start fills, carried with OUT (a share) in OUT/kernel-cache/.

    \b
    record   record what the last `lucifer-shard serve OUT` compiled into OUT/kernel-cache/run/: a
             BLAKE3 of every file and the key of that start (GPU and capability, driver, CUDA, the
             vLLM, torch, FlashInfer and Triton releases, the model's geometry, the serve options
             that change kernels), written last, on the host that ran the start
    verify   the record is this tool's, every file is the one it lists (none added or missing), and
             it was recorded on this host's GPU, driver and releases; exit 1 naming what is not
    show     the record's key and files, nothing read but the record
    serve uses a record only when its key is the start's and every file verifies; `stage` and
    `fetch` carry it with --kernel-cache. e.g.
      lucifer-shard serve out/ -- --max-model-len 65536   (cold: compiles into out/kernel-cache/run/)
      lucifer-shard cache record out/                     (once vLLM is up)
    """
    from ..runtime_shim.serving.kernel_cache import cache_command
    from .serve_cli import _output_dir

    doc, lines = cache_command(action, _output_dir(out))
    Console.of().emit(doc, lines)
