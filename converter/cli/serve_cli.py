"""`lucifer-shard doctor` and `lucifer-shard serve`: thin click commands over lucifer_shard.runtime_shim.doctor.

The runtime shim (and with it vLLM) is imported inside the command bodies only: the converter never
imports vLLM at import time.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import click

from ..errors import CheckFailed, OutputError, PreflightFailed, UsageRefused
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


def _output_dir(out: Path) -> Path:
    """OUT as an absolute path (vLLM gets it so); OutputError, like every command, when it is no directory."""
    if not out.is_dir():
        raise OutputError(f"{out}: no such output directory")
    return out.resolve()


@click.command("doctor")
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--mtp", is_flag=True, help="Also check that OUT can be served with its MTP draft (serve --mtp).")
@conventions(interrupted="interrupted: doctor changes nothing")
def doctor(out: Path | None, mtp: bool) -> None:
    """Check this environment for serving lucifer-shard outputs (and OUT, if given) with vLLM.

    Prints each check with its fix: given OUT, its TP size, arch, layout and roles first; then
    lucifer-shard's install and dependencies, the vLLM version and commit, each symbol the shim
    needs with its source hash, virtual-TP support, the plugin registration and the GPU. Then which
    vLLM builds serve which outputs (--arch, expert layout, MTP draft), where to get one, and how to
    put lucifer-shard into it. Runs with or without vLLM. Exit 1 if a check fails.
    """
    from ..runtime_shim.doctor import builds, doctor_report, format_report, guide_lines, routes

    if mtp and out is None:
        raise UsageRefused("--mtp checks an output's MTP draft: pass OUT")
    checks = doctor_report(None if out is None else _output_dir(out), mtp)
    Console.of().emit({"checks": [c.to_dict() for c in checks], "builds": builds(),
                       "routes": [{"route": r, "how": h} for r, h in routes()]},
                      [format_report(checks), "", *guide_lines()])
    failed = _failed(checks)
    if failed:
        raise CheckFailed(f"doctor: {len(failed)} check(s) failed; first: {failed[0]}")


@click.command("serve", cls=ServeCommand)
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True,
              help="Print the preflight report and the exact vllm command, run nothing. Exit 0 when the "
                   "preflight passes, and on a machine without vLLM (the conversion box) when OUT's own checks "
                   "pass: the environment's are then skipped, to be run on the serving host.")
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
      vllm serve /abs/OUT --tensor-parallel-size <from the manifest> --load-format lucifer_tp3
        --attention-backend A --moe-backend M
        [--speculative-config '{"method":"mtp","num_speculative_tokens":K}'  with --mtp]
        [VLLM_ARGS: everything after `--`]
    with A, M for the output's --arch on stock vLLM (virtual TP supplied by the plugin):
      sm120, sm100: FLASHINFER_MLA_SPARSE_DSV4, flashinfer_cutlass
      sm90:         FLASHMLA_SPARSE_DSV4, marlin (model layout) or flashinfer_cutlass (kernel layout)
    (a model-layout output may take another --moe-backend among VLLM_ARGS: vLLM lays its experts out);
    for an output converted without --arch, those of the serving host's GPU (left out where no GPU
    is visible); FLASHINFER_MLA_SPARSE_DSV4, flashinfer_cutlass on a vetted mlow/vllm build.
    VLLM_ARGS the plugin refuses at load are refused here, before vLLM starts: a pipeline, data or
    prefill-context parallel size above 1, --enable-expert-parallel, --enable-eplb, --enable-lora,
    a --model-loader-extra-config that is not an object of the loader's keys (verify, role).
    e.g. lucifer-shard serve out/ --mtp -- --max-model-len 65536 --port 8000
    The preflight is `lucifer-shard doctor OUT`; a failed check stops serve with exit 1.
    """
    from ..runtime_shim.doctor import (backends_remark, doctor_report, exec_vllm, format_report, preflight,
                                       serve_argv, serve_backends)
    from ..runtime_shim.errors import ShimError
    from ..runtime_shim.manifest import load_manifest

    con = Console.of()
    if mtp_tokens is not None and not mtp:
        raise UsageRefused("--mtp-tokens applies only with --mtp")
    if con.json and not dry_run:
        raise UsageRefused("--json applies only with --dry-run (serve otherwise becomes vLLM)")
    out = _output_dir(out)
    try:
        manifest = load_manifest(out)
        tp, arch, readable = manifest.tp_size, manifest.arch, True
    except ShimError:
        tp, arch, readable = None, None, False  # the preflight's output check says why
    backends = serve_backends(arch, manifest.expert_layout if readable else "model")
    try:
        argv = serve_argv(out, tp, vllm_args, (mtp_tokens or 1) if mtp else None, backends=backends,
                          expert_layout=manifest.expert_layout if readable else "kernel")
    except ShimError as e:
        raise UsageRefused(str(e)) from None
    checks = doctor_report(out, mtp)
    verdict = preflight(checks)
    notes = [n for n in (verdict.note(), backends_remark() if backends is None and readable else None) if n]
    line = shlex.join(argv)
    if dry_run:
        con.emit({"preflight_ok": not verdict.failed, "output_ok": verdict.output_ok,
                  "environment_checked": verdict.environment_checked, "notes": notes,
                  "checks": [c.to_dict() for c in checks], "argv": argv, "command": line},
                 [format_report(checks), "", *notes, line])
    elif verdict.failed:
        click.echo("\n".join(str(c) for c in verdict.failed), err=True)
    else:
        con.note("; ".join([f"preflight passed ({len(checks)} checks)", *notes, f"exec {line}"]))
    if verdict.failed and not (dry_run and verdict.dry_run_ok):
        first = verdict.failed[0]
        raise PreflightFailed(f"serve: preflight failed ({len(verdict.failed)} check(s)); first: {first}; "
                              f"lucifer-shard doctor OUT shows every check")
    if not dry_run:
        exec_vllm(argv)
