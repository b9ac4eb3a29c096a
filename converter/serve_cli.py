"""`lucifer-shard doctor` and `lucifer-shard serve`: thin click commands over lucifer_shard.runtime_shim.doctor.

The runtime shim (and with it vLLM) is imported inside the command bodies only: the converter never
imports vLLM at import time.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("doctor")
@click.argument("out", required=False, type=click.Path(path_type=Path))
def doctor(out: Path | None) -> None:
    """Check the installed vLLM/FlashInfer for `--load-format lucifer_tp3` (and OUT, if given).

    Prints vLLM version and commit, each symbol the shim needs with its source hash, virtual-TP
    support, the plugin registration, and what will and will not work. Exit 1 if a check fails.
    """
    from .runtime_shim.doctor import FAIL, doctor_report, format_report

    checks = doctor_report(out)
    click.echo(format_report(checks))
    sys.exit(1 if any(c.status == FAIL for c in checks) else 0)


@click.command("serve", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("out", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--dry-run", is_flag=True, help="Print the preflight and the vllm command instead of running it.")
def serve(out: Path, vllm_args: tuple[str, ...], dry_run: bool) -> None:
    """Preflight OUT against the installed vLLM, then exec `vllm serve OUT` with the flags it needs.

    Adds --tensor-parallel-size (from the manifest), --load-format lucifer_tp3,
    --attention-backend FLASHINFER_MLA_SPARSE_DSV4 and --moe-backend flashinfer_cutlass; further
    vLLM arguments go after `--`, e.g. `lucifer-shard serve out/ -- --max-model-len 65536`.
    """
    from .runtime_shim.doctor import FAIL, serve as run_serve, serve_argv
    from .runtime_shim.errors import ShimError

    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    try:
        if dry_run:
            argv, checks = serve_argv(out, args, dry_run=True)
            failed = [c for c in checks if c.status == FAIL]
            for c in failed:
                click.echo(f"preflight: {c}", err=True)
            if failed:
                click.echo(f"preflight: {len(failed)} check(s) failed; serve would refuse to start here", err=True)
            import shlex

            click.echo(shlex.join(argv))
            return
        run_serve(out, args, dry_run=False)
    except ShimError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
