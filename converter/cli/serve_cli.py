"""`lucifer-shard doctor` and `lucifer-shard serve`: thin click commands over lucifer_shard.runtime_shim.doctor.

The runtime shim (and with it vLLM) is imported inside the command bodies only: the converter never
imports vLLM at import time.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import click

from ..errors import CheckFailed, PreflightFailed, UsageRefused
from .console import Console, conventions

SERVE_EXAMPLE = "lucifer-shard serve OUT [OPTIONS] -- --max-model-len 65536"


class ServeCommand(click.Command):
    """`serve OUT [OPTIONS] [-- VLLM_ARGS...]`: serve's own options anywhere before `--`, vLLM's after it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own, vllm_args = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
        try:
            rest = super().parse_args(ctx, own)
        except click.UsageError as e:
            if not (isinstance(e, click.NoSuchOption) or "extra argument" in e.message):
                raise
            raise click.UsageError(f"{e.message.rstrip('.')}; vLLM's own arguments go after `--`: {SERVE_EXAMPLE}",
                                   ctx) from None
        ctx.params["vllm_args"] = tuple(vllm_args)
        return rest

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- VLLM_ARGS]..."]


def _failed(checks) -> list:
    from ..runtime_shim.doctor import FAIL

    return [c for c in checks if c.status == FAIL]


@click.command("doctor")
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--mtp", is_flag=True, help="Also check that OUT can be served with its MTP draft (serve --mtp).")
@conventions(interrupted="interrupted: doctor changes nothing")
def doctor(out: Path | None, mtp: bool) -> None:
    """Check this environment for serving lucifer-shard outputs (and OUT, if given) with vLLM.

    Prints each check with its fix: lucifer-shard's install and dependencies, the vLLM version and
    commit, each symbol the shim needs with its source hash, virtual-TP support, the plugin
    registration, the GPU and, given OUT, its TP size, arch, layout and roles. Then which vLLM
    builds serve which outputs (--arch, expert layout, MTP draft), where they come from, and how
    to put lucifer-shard into that image. Runs with or without vLLM. Exit 1 if a check fails.
    """
    from ..runtime_shim.doctor import builds, doctor_report, format_report, guide_lines

    if mtp and out is None:
        raise UsageRefused("--mtp checks an output's MTP draft: pass OUT")
    checks = doctor_report(out, mtp)
    Console.of().emit({"checks": [c.to_dict() for c in checks], "builds": builds()},
                      [format_report(checks), "", *guide_lines()])
    failed = _failed(checks)
    if failed:
        raise CheckFailed(f"doctor: {len(failed)} check(s) failed; first: {failed[0]}")


@click.command("serve", cls=ServeCommand)
@click.argument("out", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--dry-run", is_flag=True,
              help="Print the preflight report and the exact vllm command, run nothing; exit 0 only if the "
                   "preflight passes (it runs without vLLM too: the command is then for the serving image).")
@click.option("--mtp", is_flag=True,
              help="Serve with the MTP draft in OUT/draft (speculative decoding): adds --speculative-config "
                   "'{\"method\":\"mtp\",\"num_speculative_tokens\":K}'.")
@click.option("--mtp-tokens", type=click.IntRange(1), default=None,
              help="With --mtp: draft tokens per step (K; more than 1 reruns the one MTP layer)  [default: 1]")
@conventions(interrupted="interrupted: serve started nothing")
def serve(out: Path, dry_run: bool, mtp: bool, mtp_tokens: int | None, vllm_args: tuple[str, ...]) -> None:
    """Preflight OUT against the installed vLLM, then exec `vllm serve OUT` with the flags it needs.

    \b
    The command is
      vllm serve OUT --tensor-parallel-size <from the manifest> --load-format lucifer_tp3
        --attention-backend A --moe-backend M
        [--speculative-config '{"method":"mtp","num_speculative_tokens":K}'  with --mtp]
        [VLLM_ARGS: everything after `--`]
    with A, M for the output's --arch on stock vLLM (virtual TP supplied by the plugin):
      sm120, sm100: FLASHINFER_MLA_SPARSE_DSV4, flashinfer_cutlass
      sm90:         FLASHMLA_SPARSE_DSV4, marlin
    and FLASHINFER_MLA_SPARSE_DSV4, flashinfer_cutlass on a vetted mlow/vllm build.
    e.g. lucifer-shard serve out/ --mtp -- --max-model-len 65536 --port 8000
    The preflight is `lucifer-shard doctor OUT`; a failed check stops serve with exit 1.
    """
    from ..runtime_shim.doctor import doctor_report, exec_vllm, format_report, serve_argv, serve_backends
    from ..runtime_shim.errors import ShimError
    from ..runtime_shim.manifest import load_manifest

    con = Console.of()
    if mtp_tokens is not None and not mtp:
        raise UsageRefused("--mtp-tokens applies only with --mtp")
    if con.json and not dry_run:
        raise UsageRefused("--json applies only with --dry-run (serve otherwise becomes vLLM)")
    try:
        manifest = load_manifest(out)
        tp, arch = manifest.tp_size, manifest.arch
    except ShimError:
        tp, arch = None, None  # the preflight's output check says why
    try:
        argv = serve_argv(out, tp, vllm_args, (mtp_tokens or 1) if mtp else None, backends=serve_backends(arch))
    except ShimError as e:
        raise UsageRefused(str(e)) from None
    checks = doctor_report(out, mtp)
    failed = _failed(checks)
    line = shlex.join(argv)
    if dry_run:
        con.emit({"preflight_ok": not failed, "checks": [c.to_dict() for c in checks], "argv": argv,
                  "command": line}, [format_report(checks), "", line])
    elif failed:
        click.echo("\n".join(str(c) for c in failed), err=True)
    else:
        con.note(f"preflight passed ({len(checks)} checks); exec {line}")
    if failed:
        raise PreflightFailed(f"serve: preflight failed ({len(failed)} check(s)); first: {failed[0]}; "
                            f"lucifer-shard doctor OUT shows every check")
    if not dry_run:
        exec_vllm(argv)
