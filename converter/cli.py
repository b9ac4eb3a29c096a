"""The `lucifer-shard` command line (one click group)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from . import __version__
from .errors import LuciferError
from .manifest import Options
from .plan import ARCHES, check_arch

ARCH = click.option("--arch", type=click.Choice(ARCHES), default="sm120", show_default=True,
                    help="GPU the experts are laid out for: sm120/sm100 (MXFP4 x MXFP8 CUTLASS: swap + 128x4 "
                         "scale swizzle) or sm90 (MXFP4 x BF16: swap + nibble and scale interleave).")
TP = click.option("--tp", type=int, required=True, help="Tensor-parallel size, 1..8 (3 is the mission).")


INTERNAL_ERROR = 70  # EX_SOFTWARE: a bug, not bad input


class Group(click.Group):
    """Turns LuciferError into one `error:` line and its exit code, and any other exception into one
    `error: internal error:` line (exit 70) with the traceback in a log file: never a traceback."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, cmd, rest = super().resolve_command(ctx, args)
        ctx.meta["lucifer.invoked"] = (name, cmd, list(rest))  # to find OUT if the command fails
        return name, cmd, rest

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LuciferError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted: finished files are kept; run the same command with --resume to continue", err=True)
            sys.exit(130)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - the one place an unexpected exception is reported
            log = _internal_error_log(_out_dir(ctx))
            message = " ".join(str(e).split())
            click.echo(f"error: internal error: {type(e).__name__}: {message}; details in {log}", err=True)
            sys.exit(INTERNAL_ERROR)


def _out_dir(ctx: click.Context) -> Path | None:
    """The failed command's OUT argument, parsed again from its arguments (None if it has none)."""
    name, cmd, args = ctx.meta.get("lucifer.invoked", (None, None, None))
    if cmd is None:
        return None
    try:
        out = cmd.make_context(name, list(args), resilient_parsing=True).params.get("out")
    except Exception:  # noqa: BLE001 - no OUT then; the log goes to a temporary file
        return None
    return Path(out) if out else None


def _internal_error_log(out: Path | None) -> str:
    """Write the current exception's traceback, with the command line and versions, to
    OUT/.lucifer/ when that folder exists and is writable, else to a temporary file."""
    import datetime
    import platform
    import tempfile
    import traceback

    from .manifest import STATE_DIR

    now = datetime.datetime.now().astimezone()
    text = (f"lucifer-shard {__version__} internal error at {now.isoformat(timespec='seconds')}\n"
            f"command: {' '.join(sys.argv)}\npython {platform.python_version()} on {platform.platform()}\n\n"
            + traceback.format_exc())
    name = f"internal-error-{now:%Y%m%d-%H%M%S}-{os.getpid()}.log"
    state = out / STATE_DIR if out is not None else None
    if state is not None and state.is_dir() and os.access(state, os.W_OK):
        try:
            (state / name).write_text(text)
            return str(state / name)
        except OSError:
            pass  # a full disk, say: try the temporary folder
    try:
        fd, path = tempfile.mkstemp(prefix="lucifer-shard-", suffix=f"-{name}")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    except OSError as e:
        return f"no log file (writing one failed: {e.strerror})"


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="lucifer-shard")
def cli() -> None:
    """Shard DeepSeek-V4-Flash for tensor-parallel size 3 (or any 1..8) offline, and prove it.

    \b
    Typical flow:
      lucifer-shard plan --tp 3 deepseek-ai/DeepSeek-V4-Flash     # what will be written
      lucifer-shard convert --tp 3 MODEL out/                      # per-rank rank files
      lucifer-shard diff out/ MODEL                                # byte-exact proof
      lucifer-shard verify out/                                    # integrity, no source needed
      lucifer-shard serve out/                                     # vLLM with the lucifer_tp3 loader

    MODEL is a local directory or a Hugging Face repo id (huggingface_hub cache and
    HF_HUB_OFFLINE are honoured). Try it on a synthetic checkpoint: `make demo`.
    """


@cli.command()
@TP
@click.argument("model")
@ARCH
@click.option("--expert-layout", type=click.Choice(["kernel", "model"]), default="kernel", show_default=True)
@click.option("--flashinfer-layout", type=click.Choice(["folded", "legacy"]), default="folded", show_default=True)
@click.option("--no-mtp", is_flag=True, help="Leave the MTP draft layer out.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable plan: every output tensor and its source slices.")
def plan(tp: int, model: str, arch: str, expert_layout: str, flashinfer_layout: str, no_mtp: bool, as_json: bool) -> None:
    """Dry run: the virtual-TP plan and what each rank file will hold. Writes nothing.

    Needs only config.json, so a Hugging Face repo id is planned before any weight is
    downloaded. Prints the axis table (original, padded, per rank, kernel-local), per tensor
    family the source range of each rank in stored units with its zero tail, and bytes per rank.
    """
    from .config import load_config
    from .plan import make_plan
    from .planview import plan_json, plan_lines
    from .source import resolve_model

    cfg = load_config(resolve_model(model, weights=False) / "config.json")
    options = Options(tp=tp, arch=check_arch(arch), expert_layout=expert_layout,
                      flashinfer_layout=flashinfer_layout, mtp=not no_mtp)
    p = make_plan(cfg, tp)
    if as_json:
        click.echo(json.dumps(plan_json(cfg, p, options), indent=1))
    else:
        click.echo("\n".join(plan_lines(cfg, p, options)))


@cli.command()
@TP
@click.argument("model")
@click.argument("out", type=click.Path(path_type=Path))
@ARCH
@click.option("--expert-layout", type=click.Choice(["kernel", "model"]), default="kernel", show_default=True,
              help="kernel: routed experts pre-laid-out for the FlashInfer-CUTLASS kernel of --arch; "
                   "model: as vLLM holds them before post-load processing (the safe fallback).")
@click.option("--flashinfer-layout", type=click.Choice(["folded", "legacy"]), default="folded", show_default=True,
              help="sm90 only: FlashInfer layout generation, legacy = 0.6.10-0.6.15, folded = 0.6.16+/0.7.x.")
@click.option("--workers", type=int, default=1, show_default=True,
              help="Threads for layout, hashing and writing (one per rank is the useful maximum).")
@click.option("--max-file-size", type=str, default="4GiB", show_default=True, help="Largest rank file part.")
@click.option("--align", type=int, default=8, show_default=True,
              help="Start the data section and every tensor whose size is a multiple of ALIGN at a multiple "
                   "of ALIGN bytes (e.g. 4096 for O_DIRECT loaders); a power of two >= 8.")
@click.option("--resume", is_flag=True, help="Finish an interrupted conversion, keeping verified files.")
@click.option("--force", is_flag=True, help="Replace an existing lucifer-shard output in OUT.")
@click.option("--no-mtp", is_flag=True, help="Do not write the MTP draft model (draft/).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def convert(tp: int, model: str, out: Path, arch: str, expert_layout: str, flashinfer_layout: str, workers: int,
            max_file_size: str, align: int, resume: bool, force: bool, no_mtp: bool, quiet: bool) -> None:
    """Write per-rank safetensors of MODEL into OUT: sliced, zero-padded, experts laid out.

    \b
    OUT/config.json (+ tokenizer files)   copied byte-identical
    OUT/target/rank-<r>/part-*.safetensors main model, vLLM parameter names
    OUT/draft/rank-<r>/part-*.safetensors  MTP draft layer (unless --no-mtp)
    OUT/lucifer-manifest.json              plan, layouts, sources, digests
    OUT/COMPLETE                           written last

    Streams: each source tensor is read once and fanned out to every rank; memory does not
    grow with the model. Every file is written under a temporary name and renamed when
    complete; after a crash or Ctrl-C, run the same command with --resume. One convert at a
    time writes OUT (a lock in OUT/.lucifer/), and it checks first that the files fit.
    """
    from .convert import convert as run

    if align < 8 or align & (align - 1):
        raise click.BadParameter(f"{align} is not a power of two >= 8", param_hint="--align")
    options = Options(tp=tp, arch=check_arch(arch), expert_layout=expert_layout, flashinfer_layout=flashinfer_layout,
                      mtp=not no_mtp, max_file_bytes=parse_size(max_file_size), align=align)
    summary = run(model, out, options, resume=resume, force=force, workers=workers, progress=not quiet)
    click.echo("\n".join(summary.lines()))


@cli.command()
@click.argument("preset", type=click.Choice(["tiny", "flash-layer", "flash-moe"]))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layers", type=int, default=None, help="Decoder layers (flash-layer: default 1).")
@click.option("--fill", type=click.Choice(["pattern", "random"]), default="pattern", show_default=True,
              help="pattern: every byte encodes tensor and position; random: valid FP4/E8M0/FP8 values.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-mtp", is_flag=True, help="Leave the MTP layer out.")
@click.option("--quiet", is_flag=True)
def synth(preset: str, out: Path, layers: int | None, fill: str, seed: int, no_mtp: bool, quiet: bool) -> None:
    """Write a synthetic checkpoint with the exact DeepSeek-V4-Flash schema.

    \b
    tiny         every padded axis at its real size (64 heads, 8 groups, routed and shared
                 2048, vocab 1000), hidden 256, 8 experts, 4 layers (hash, SWA, C4, C128) + MTP
    flash-layer  exact Flash dimensions, --layers K (default 1), for benchmarks
    flash-moe    Flash expert geometry (hidden 4096, routed 2048, top-6), 1 layer, small rest
    """
    from .synth import synth as run

    path = run(preset, out, layers=layers, fill=fill, seed=seed, mtp=not no_mtp, progress=not quiet)
    click.echo(f"wrote {preset} checkpoint to {path}")


def parse_size(text: str) -> int:
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if not num or unit not in units:
        raise click.BadParameter(f"{text!r}: expected a size like 4GiB, 500MB or 1048576")
    return int(float(num) * units[unit])


# Commands defined beside their logic (each module imports only click at import time).
from . import cmd_check  # noqa: E402
from .cmd_numerics import check_numerics  # noqa: E402
from .serve_cli import doctor, serve  # noqa: E402  (vLLM is imported inside the commands)

for _command in (cmd_check.diff, cmd_check.verify, cmd_check.inspect, check_numerics, doctor, serve):
    cli.add_command(_command)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
