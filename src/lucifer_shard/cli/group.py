"""The `lucifer-shard` command line (one click group). Every command follows console.py's conventions."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import click

from .. import __version__
from ..engine.fills import DEFAULT_FILL, FILLS
from ..errors import NoRoom, UsageRefused
from ..model.arches import ARCH, ARCHES, B12X, FAMILIES, FORK_KERNEL_ARCHES, GENERATION_ARCHES, MOE_VARIANT, family
from ..model.footprint import DEFAULT_LINK
from ..model.options import MAX_ALIGN, Options
from ..model.plan import DEFAULT_ROUTE, MOE_ROUTES
from ..model.runtimes import FLASHINFER_VERSIONS
from ..units import RATE_SYNTAX, SIZE_SYNTAX
from .argorder import is_checkpoint, refuse_swapped
from .console import Console, Group, conventions, exit_code_lines
from .shareopts import node_options

MAX_FILE_BYTES = 1 << 50
# The smallest --max-file-size: a tensor larger than the limit gets a file of its own anyway, so a
# smaller limit only splits the small tensors into more files (at 1 byte, one file per tensor:
# about 4,600 for Flash at TP3), each with its own header, open and fsync.
MIN_FILE_BYTES = 1 << 20
TP = click.option("--tp", "-tp", "--tensor-parallel-size", "tp", type=int, required=True,
                  help="Tensor-parallel size, 1..8: the GPUs that serve the model together, one rank file set each "
                       "(3: DeepSeek-V4-Flash's 64 heads, 2048-wide experts and vocabulary do not divide by it, so "
                       "the rank files are padded); -tp and --tensor-parallel-size as in vLLM.")
REVISION = click.option("--revision", default=None,
                        help="With a Hugging Face repo id: the branch, tag or commit to use (as `hf download "
                             "--revision`); the manifest records the commit, so `diff OUT` finds it again.")


def _flashinfer_help() -> str:
    gens = ", ".join(f"{g} = FlashInfer {v}" for g, v in FLASHINFER_VERSIONS.items())
    return (f"Only with --arch {'|'.join(GENERATION_ARCHES)} and kernel layout: FlashInfer's layout generation, "
            f"{gens}  [default: folded]")


_ROUTES = [r for r in MOE_ROUTES if r != DEFAULT_ROUTE]


def _route_help() -> str:
    b12x = MOE_ROUTES[B12X]
    return (f"b12x: the routed experts at their exact per-rank width (704 at TP3, a multiple of "
            f"{b12x.kernel_align}) for stock vLLM's b12x MoE (vllm[b12x], {'/'.join(b12x.arches)} GPUs: RTX PRO 6000 "
            f"class, DGX Spark), model layout; serve passes --moe-backend b12x. Default: the width the CUTLASS, "
            f"Marlin and TRT-LLM backends round to ({MOE_ROUTES[DEFAULT_ROUTE].kernel_align}: 768 at TP3), which "
            f"every GPU family serves")


def _arch_help() -> str:
    """Each MoE variant's --arch values and kernel-layout steps, and which --arch takes another's files."""
    variants = {v: [a for a in ARCHES if MOE_VARIANT[a] == v] for v in MOE_VARIANT.values()}
    kinds = " or ".join(f"{'/'.join(names)} ({v}: {' + '.join(_steps(names[0]))})" for v, names in variants.items())
    members = "".join(f"; {a} is {ARCH[a].gpus}, the {family(a)} family's layout" for a in ARCHES if family(a) != a)
    return kinds + members


def _steps(arch: str) -> list[str]:
    """The kernel-layout steps of `arch` (of FlashInfer's folded generation), each once."""
    return list(dict.fromkeys(s for steps in ARCH[arch].kernel_steps["folded"].values() for s in steps))


def _link(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from .planview import link_rate

    try:
        link_rate(value)  # a bad rate is a usage error as the command line is read, whatever plan then shows
    except UsageRefused as e:
        raise click.BadParameter(str(e).removeprefix("--link ")) from None
    return value


LINK = click.option("--link", default=DEFAULT_LINK, show_default=True, metavar="RATE", callback=_link,
                    help=f"The link to the Hub each route downloads over, for plan's route times: {RATE_SYNTAX}.")


def conversion_options(f):
    """The options that decide what a conversion writes (shared by plan and convert)."""
    for option in reversed((
        click.option("--arch", type=click.Choice(ARCHES, case_sensitive=False), default=None,
                     help=f"The serving GPU family: {_arch_help()}. Required by convert with "
                          "--expert-layout kernel: the experts' kernel layout follows it and the loader refuses "
                          "other GPUs. Optional with --expert-layout model, whose files are the same for every "
                          "arch: without it the output serves on any GPU family (the manifest's arch is null)."),
        click.option("--expert-layout", type=click.Choice(["kernel", "model"]), default=None,
                     help="kernel: routed experts pre-laid-out for the FlashInfer-CUTLASS kernel of --arch, loaded "
                          "verbatim (the plugin's re-layout wrapper on a vetted stock vLLM, which lucifer-shard doctor names; "
                          "run on a GPU: sm90, vLLM 0.33.0); model: as vLLM holds "
                          "them before post-load processing (vLLM lays them out at load, for any MoE backend)  "
                          "[default: kernel with --arch, model without]"),
        click.option("--flashinfer-layout", type=click.Choice(["folded", "legacy"]), default=None,
                     help=_flashinfer_help()),
        click.option("--moe-backend", type=click.Choice(_ROUTES, case_sensitive=False), default=None,
                     help=_route_help()),
        click.option("--max-file-size", default="4G", show_default=True,
                     help=f"Largest rank file part, at least 1M (a larger tensor gets a file of its own); {SIZE_SYNTAX}."),
        click.option("--align", type=int, default=8, show_default=True,
                     help="Start the data section and every tensor whose size is a multiple of ALIGN at a "
                          "multiple of ALIGN bytes (e.g. 4096 for O_DIRECT loaders); a power of two >= 8."),
        click.option("--no-mtp", is_flag=True, help="Leave the draft model (draft/: the MTP layer, or "
                                                    "DeepSeek-V4-Flash-0731's DSpark drafter) out."),
        REVISION,
    )):
        f = option(f)
    return f


def target_options(f):
    """What convert may do to an existing OUT (plan takes them too: it runs convert's refusals of OUT)."""
    for option in reversed((
        click.option("--workers", type=click.IntRange(1), default=1, show_default=True,
                     help="Threads for layout, hashing and writing (one per rank is the useful maximum)."),
        click.option("--resume", is_flag=True,
                     help="Finish an interrupted conversion, keeping verified files; on a finished output, re-check "
                          "every file against the manifest and rewrite only the damaged or missing ones from MODEL "
                          "(the converted source, same options)."),
        click.option("--force", is_flag=True, help="Replace an existing lucifer-shard output in OUT."),
    )):
        f = option(f)
    return f


def download_options(f):
    """Where a repo id's shards go (plan checks the room convert will check)."""
    for option in reversed((
        click.option("--download-dir", type=click.Path(path_type=Path), default=None,
                     help="With a repo id: where shards are streamed through (each downloaded before the first part "
                          "that reads it, removed after the last; a few shards at a time). Default "
                          "OUT/.lucifer/download; an empty folder or one of this download's, on a disk with the room "
                          "plan shows."),
        click.option("--keep-source", is_flag=True,
                     help="With a repo id: download the whole checkpoint into the Hugging Face cache first (HF_HOME, "
                          "HF_HUB_CACHE) and keep it there, instead of streaming it."),
    )):
        f = option(f)
    return f


def refuse_download_options(model: str, download_dir: Path | None, keep_source: bool) -> None:
    from ..source.checkpoint import is_repo_id

    if (download_dir is not None or keep_source) and not is_repo_id(model):
        raise UsageRefused(f"--download-dir and --keep-source apply to a Hugging Face repo id, and {model} is a local "
                           f"path (read in place); drop them")
    if download_dir is not None and keep_source:
        raise UsageRefused("--keep-source downloads into the Hugging Face cache, --download-dir streams through a "
                           "folder of its own; pass one")
    if download_dir is not None:
        from ..source.hub import refuse_download_dir

        refuse_download_dir(download_dir)


def options_from(tp: int, arch: str | None, expert_layout: str | None, flashinfer_layout: str | None, max_file_size: str,
                 align: int, no_mtp: bool, moe_backend: str | None = None) -> Options:
    """The Options a command line asks for (plan's and convert's alike: plan refuses what convert
    refuses): options that do not apply are refused, a combination no vetted runtime loads is warned
    about with the reason. The expert layout defaults to kernel with --arch and model without; kernel
    layout without --arch is refused; model layout without --arch is Options.arch None: the same files
    serve every GPU family."""
    from ..model.plan import local_gpu
    from ..units import parse_size, size

    if moe_backend is not None:  # click's Choice gives the table's spelling, whatever case was typed
        route = MOE_ROUTES[moe_backend]
        if arch is not None and arch not in route.arches:
            raise UsageRefused(f"--moe-backend {moe_backend} runs on {'/'.join(route.arches)} GPUs only (vLLM's "
                               f"B12xExperts asks for the SM120 family); drop --arch {arch}, or drop --moe-backend for "
                               f"the width every GPU family serves")
        if expert_layout is not None and expert_layout not in route.layouts:
            raise UsageRefused(f"--moe-backend {moe_backend} takes model layout only (its load path lays the experts "
                               f"out itself); drop --expert-layout {expert_layout}")
        expert_layout = route.layouts[0]
    expert_layout = expert_layout or ("kernel" if arch else "model")
    generations = arch in GENERATION_ARCHES and expert_layout == "kernel"
    if flashinfer_layout is not None and not generations:
        one = " and ".join(f for f in FAMILIES if f not in GENERATION_ARCHES)
        raise UsageRefused(f"--flashinfer-layout applies only to --arch {'|'.join(GENERATION_ARCHES)} with "
                           f"--expert-layout kernel ({one} have one layout generation); drop it")
    if align < 8 or align > MAX_ALIGN or align & (align - 1):
        raise UsageRefused(f"--align {align} is not a power of two from 8 to {MAX_ALIGN} (2 MiB, a huge page)")
    try:
        max_bytes = parse_size(max_file_size)
    except (ValueError, OverflowError):
        raise UsageRefused(f"--max-file-size {max_file_size[:40]!r}: expected a size like 4G, 500M, 4GiB or "
                           f"1048576 ({SIZE_SYNTAX})") from None
    if max_bytes < MIN_FILE_BYTES:
        raise UsageRefused(f"--max-file-size {max_file_size[:40]!r} is below the floor of {size(MIN_FILE_BYTES)}: a "
                           f"tensor larger than the limit gets a file of its own anyway, so a smaller limit only "
                           f"splits the small tensors into more files (at 1 byte one file per tensor, about 4,600 "
                           f"for Flash at TP3); choose 1M or more (default 4G)")
    if max_bytes > MAX_FILE_BYTES:
        raise UsageRefused(f"--max-file-size {max_file_size[:40]!r}: choose 1M to 1024T (1 PiB)")
    if arch is None and expert_layout == "kernel":
        gpu = local_gpu()
        here = f" (this machine has {gpu})" if gpu else ""
        raise UsageRefused(f"--arch is required with --expert-layout kernel: the routed experts are laid out for one "
                           f"GPU family and the loader refuses other GPUs; pass the serving GPU's, --arch "
                           f"{'|'.join(ARCHES)}{here}, or --expert-layout model (any GPU family)")
    if generations and flashinfer_layout == "legacy":
        forks = "/".join(f for f in FAMILIES if f in FORK_KERNEL_ARCHES)
        Console.of().warn(f"no vetted vLLM build serves {arch} kernel layout of FlashInfer's legacy generation (vLLM "
                          f"0.33.0 pins FlashInfer 0.7.2.post1, the folded one; the mlow/vllm builds serve only "
                          f"{forks}); these files serve FlashInfer-level tests. Drop --flashinfer-layout to serve")
    elif generations:
        Console.of().note(f"{arch} kernel layout serves with FlashInfer's SM90 CUTLASS MoE module, which FlashInfer "
                          "0.7.2.post1 builds on the serving host at first use (an hour or more; cached after) "
                          "unless a prebuilt one is installed; --expert-layout model serves with Marlin, no build")
    return Options(tp=tp, arch=arch, expert_layout=expert_layout,
                   flashinfer_layout=flashinfer_layout or "folded", mtp=not no_mtp, max_file_bytes=max_bytes,
                   align=align, moe_backend=moe_backend)


class Writes(click.Command):
    """A command that writes (convert, stage): `--dry-run`, the `hf` habit, is answered with the command
    that is its dry run, `plan`, which writes nothing."""

    dry_run = {"convert": "lucifer-shard plan takes convert's arguments and options, makes its checks and "
                          "writes nothing",
               "stage": "lucifer-shard plan MODEL OUT --tp N shows the bytes each node's share holds, and stage "
                        "run again keeps every file already in DEST that checks out"}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            if e.option_name != "--dry-run":
                raise
            raise click.UsageError(f"No such option: --dry-run ({self.dry_run[self.name]})", ctx) from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog="\b\nExit codes (every command; --json's error.kind in brackets):\n"
                    + "\n".join(exit_code_lines()))
@click.version_option(__version__, prog_name="lucifer-shard")
def cli() -> None:
    """Shard DeepSeek-V4-Flash for tensor-parallel size 3 (or any 1..8) offline, and prove it.

    \b
    From a checkpoint to a running server:
      lucifer-shard plan --tp 3 deepseek-ai/DeepSeek-V4-Flash-0731 out/     # bytes, files, room, time
      lucifer-shard convert --tp 3 deepseek-ai/DeepSeek-V4-Flash-0731 out/  # per-rank files, every GPU family
      lucifer-shard diff out/                                               # byte-exact proof (MODEL from the manifest)
      lucifer-shard doctor out/                                             # in the serving image
      lucifer-shard serve out/ --draft --dry-run                            # the exact vllm serve command
      lucifer-shard serve out/ --draft -- --max-model-len 65536             # start vLLM with the draft (MTP or DSpark)
      lucifer-shard smoke http://127.0.0.1:8000                             # check the running server

    MODEL is a local directory or a Hugging Face repo id owner/name (--revision picks a branch,
    tag or commit; huggingface_hub's cache and HF_HUB_OFFLINE are honoured); a path that
    exists here, ends in .json or starts with ./ / or ~ is never taken for a repo id. plan also
    takes a config.json file, or a shipped config by name from anywhere:
    deepseek-v4-flash, deepseek-v4-flash-0731, deepseek-v4.1-flash (plan --tp 3
    deepseek-v4-flash-0731). Every command takes -q/-v and --json. Try it on a synthetic
    checkpoint: `make demo`.
    """


@cli.command()
@TP
@click.argument("model")
@click.argument("out", required=False, type=click.Path(path_type=Path))
@conversion_options
@target_options
@node_options
@download_options
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.05, 1.0), default=None, metavar="F",
              help="The share of each box's GPU memory vLLM takes, for the per-box table  [default: 0.92, vLLM's "
                   "default where it does not size its KV cache from measured memory; a DGX Spark is also shown at "
                   "0.80, the host guide's value on unified memory]")
@LINK
@conventions(interrupted="interrupted: plan writes nothing")
def plan(tp: int, model: str, out: Path | None, arch: str | None, expert_layout: str | None, flashinfer_layout: str | None,
         max_file_size: str, align: int, no_mtp: bool, revision: str | None, workers: int, resume: bool,
         force: bool, moe_backend: str | None, ranks: str | None, nnodes: int | None, node_rank: int | None,
         download_dir: Path | None, keep_source: bool, gpu_memory_utilization: float | None, link: str) -> None:
    """Dry run of convert: the virtual-TP plan and the conversion's disk footprint. Writes nothing.

    MODEL is a checkpoint directory, a repo id, a config.json file or a shipped config by name
    (deepseek-v4-flash, deepseek-v4-flash-0731, deepseek-v4.1-flash): plan needs only
    config.json, so a Hugging Face repo id is planned before any weight is downloaded. Prints
    the axis table (original, padded, per rank, kernel-local), per tensor family the source
    range of each rank in stored units with its zero tail, per rank its tensors, files and
    bytes, and ranks that hold only padding; what fits per box, one rank a box (DGX Spark, RTX
    PRO 6000, H100, H200): weights, what vLLM keeps besides, the KV-cache room and the
    --max-model-len it allows; then the bytes to read and write, the free space
    of OUT's filesystem (with OUT given; exit 1 when it is short) and a time estimate. Takes
    convert's options and makes convert's refusals of MODEL and OUT (a file, a non-empty
    directory, a finished output, --resume/--force that do not apply), with the same words, so
    the same command line with `plan` for `convert` shows what convert will do; with --ranks or
    --nnodes/--node-rank, what that node's convert writes (its rank files only) and its room.
    --json: every output tensor with its source slices, and the footprint in bytes.
    """
    # --workers changes no number plan shows: it is taken so that plan's command line is convert's.
    report = plan_report(tp, model, out, arch, expert_layout, flashinfer_layout, max_file_size, align, no_mtp,
                         revision, resume, force, moe_backend, ranks, nnodes, node_rank, download_dir, keep_source,
                         gpu_memory_utilization, link)
    Console.of().emit(report.doc, report.lines)
    report.refuse_short()


def plan_report(tp: int, model: str, out: Path | None, arch: str | None, expert_layout: str | None,
                flashinfer_layout: str | None, max_file_size: str, align: int, no_mtp: bool, revision: str | None,
                resume: bool, force: bool, moe_backend: str | None, ranks: str | None, nnodes: int | None,
                node_rank: int | None, download_dir: Path | None, keep_source: bool,
                utilization: float | None, link: str) -> PlanReport:
    """plan up to its rendering, in convert's order: the refusals of its options, MODEL and OUT (convert's
    own words), then the plan, the footprint, what fits per box and the room (`planview`)."""
    from ..engine.job import layout_of, prepare
    from ..engine.outstate import refuse_download_dir, refuse_target
    from ..engine.repair import reference
    from ..guarded_io import Tree
    from ..model.config import parse_config, read_config
    from ..model.drafts import draft_record
    from ..model.v41 import is_v41
    from ..output.share import chosen_share
    from ..source.checkpoint import config_root, resolve_config
    from .planview import (box_fits, box_lines, boxes_json, download_lines, footprint_json, footprint_lines,
                           judged_rooms, node_footprint, node_lines, per_node, plan_footprint_of, plan_json, plan_lines,
                           room_of, route_lines, route_saving, routes_lines, routes_of, source_layout, streamed_lines,
                           v41_report)
    from dataclasses import replace

    refuse_swapped("plan", model, out, model_first=True)
    _refuse_resume_force(resume, force)
    refuse_download_options(model, download_dir, keep_source)
    if out is not None:
        refuse_download_dir(out, download_dir)
    node = chosen_share(tp, ranks, nnodes, node_rank)
    config = resolve_config(model, revision)
    raw = read_config(config)
    if is_v41(raw):  # another model: its bytes per rank, then convert's one-line refusal names what is missing
        lines, doc = v41_report(raw, tp, str(config), utilization)
        return PlanReport(doc, lines)
    cfg = parse_config(raw, str(config))
    options = options_from(tp, arch, expert_layout, flashinfer_layout, max_file_size, align, no_mtp, moe_backend)
    layout = source_layout(model, config, cfg)  # its shards group the parts (`job.plan_parts`)
    planned = layout_of(cfg, options, shard_of=layout.shard_of)
    p, specs = planned.plan, planned.specs
    if out is not None:
        root = config_root(model, config)
        # --resume trusts an earlier run only for the same source: with a local checkpoint, its
        # headers are read (as convert reads them) so that a changed source is refused here too.
        job = prepare(model, options) if resume and root is not None and is_checkpoint(Path(model)) else None
        # convert's rule: a finished output of this job is repaired against its manifest (engine/convert.py)
        repair = job is not None and out.is_dir() and reference(Tree(out), job) is not None
        refuse_target(out, root, resume, force, job and replace(job, node=node), options,
                      planned.paths, repair, node)
    fp = plan_footprint_of(cfg, specs, p, options, layout.shard_of)
    mine = node_footprint(fp, node)  # what this node's convert writes (the whole conversion's without flags)
    room = room_of(mine, out, force)
    nodes = per_node(fp, p.tp)
    saving = route_saving(cfg, p, options, fp, layout.shard_of)
    routes = routes_of(specs, options, fp, layout, link) if p.tp > 1 else None
    room, download, streamed, route = judged_rooms(model, layout, specs, options, out, download_dir, keep_source,
                                                   room, node)
    fits, pool = box_fits(cfg, specs, fp, utilization)
    doc = {**plan_json(specs, p, options), "footprint": footprint_json(mine, room), "per_node": nodes,
           "draft": draft_record(cfg) if "draft" in specs else None, "route_saving": saving, "routes": routes,
           "download_room": download.to_dict() if download else None, "room_route": route or None,
           "streamed_room": streamed.to_dict() if streamed else None, "fit": boxes_json(fits, pool)}
    lines = (plan_lines(specs, p, options, fp, cfg) + node_lines(nodes, sum(n["bytes"] for n in nodes))
             + box_lines(fits, pool, p.tp, "the largest rank's files, target" + (" and draft" if "draft" in specs else ""))
             + (routes_lines(routes) if routes else []) + route_lines(saving)
             + footprint_lines(mine, room, node, route) + download_lines(download) + streamed_lines(streamed))
    return PlanReport(doc, lines, ((room, "OUT"), (download, "--download-dir" if not keep_source else "HF_HUB_CACHE"),
                                   (streamed, "OUT or --download-dir for the streamed route")))


@dataclass(frozen=True)
class PlanReport:
    """What plan shows, and the rooms it checks (OUT's, the download folder's): exit 1 where one is short."""

    doc: dict
    lines: list[str]
    rooms: tuple = ()  # (Room or None, what to choose instead)

    def refuse_short(self) -> None:
        from ..units import size

        for r, what in self.rooms:
            if r is not None and r.short:
                raise NoRoom(f"{r.out}: not enough room: {size(r.needed)} to write, {size(r.free)} free on "
                             f"{r.filesystem}; free {size(r.short)} more or choose another {what}", exit_code=1)


def _refuse_resume_force(resume: bool, force: bool) -> None:
    if resume and force:
        raise UsageRefused("--resume keeps the finished files of OUT and --force deletes them; pass one")


@cli.command(cls=Writes)
@TP
@click.argument("model")
@click.argument("out", type=click.Path(path_type=Path))
@conversion_options
@target_options
@node_options
@download_options
@conventions(interrupted="interrupted: finished files are kept; run the same command with --resume to continue")
def convert(tp: int, model: str, out: Path, arch: str | None, expert_layout: str | None, flashinfer_layout: str | None,
            max_file_size: str, align: int, no_mtp: bool, revision: str | None, workers: int, resume: bool,
            force: bool, moe_backend: str | None, ranks: str | None, nnodes: int | None, node_rank: int | None,
            download_dir: Path | None, keep_source: bool) -> None:
    """Write per-rank safetensors of MODEL into OUT: sliced, zero-padded, experts laid out.

    \b
    OUT/config.json (+ tokenizer files)   copied byte-identical
    OUT/README.md                          the Hub model card (to publish OUT: docs/output-format.md)
    OUT/target/rank-<r>/part-*.safetensors main model, vLLM parameter names
    OUT/draft/rank-<r>/part-*.safetensors  the draft: MTP layer or DSpark drafter (unless --no-mtp)
    OUT/lucifer-manifest.json              plan, layouts, source fingerprint and content digests
    OUT/COMPLETE                           written last

    Streams: each source tensor is read once (and hashed: the content fingerprint that diff
    checks) and fanned out to every rank; memory does not grow with the model. MODEL may be a
    Hugging Face repo id: config.json, the file list and the shard headers come first (every
    refusal, and the room, before any weight is downloaded); then each shard is downloaded just
    before the first part that reads it, checked against the Hub's SHA-256 and removed after the
    last (--download-dir; --keep-source keeps the checkpoint in the HF cache instead; a repo
    already in the cache is read in place). Refuses to start
    when OUT's filesystem lacks the room (`plan ... MODEL OUT` shows the numbers first). Every
    file is written under a temporary name and renamed when complete; after a crash or Ctrl-C,
    run the same command with --resume. One convert at a time writes OUT (a lock in
    OUT/.lucifer/; a second writer is refused, naming the first).

    \b
    Each node converts its own share (no conversion box, no copy):
    --ranks K[,K...]            the TP ranks the node runs
    --nnodes N --node-rank R    as vLLM computes them: node R of N runs ranks R*TP/N .. (R+1)*TP/N - 1
    OUT is then exactly what `stage` of the whole conversion writes for those ranks: their rank
    files, the full manifest (every rank's digests: each source tensor is still read whole and the
    other ranks are hashed, not written), lucifer-share.json and COMPLETE; OUT/.lucifer/ keeps the
    record for --resume. On the second of three DGX Sparks (the others pass --node-rank 0 and 2):
      lucifer-shard convert --tp 3 --nnodes 3 --node-rank 1 deepseek-ai/DeepSeek-V4-Flash-0731 /data/share
      lucifer-shard serve /data/share --nnodes 3 --node-rank 1 --master-addr HOST
    """
    from ..engine.convert import convert as run
    from ..output.share import chosen_share

    refuse_swapped("convert", model, out, model_first=True)
    _refuse_resume_force(resume, force)
    node = chosen_share(tp, ranks, nnodes, node_rank)
    options = options_from(tp, arch, expert_layout, flashinfer_layout, max_file_size, align, no_mtp, moe_backend)
    con = Console.of()
    refuse_download_options(model, download_dir, keep_source)
    summary = run(model, out, options, resume=resume, force=force, workers=workers, progress=con.progress,
                  revision=revision, warn=con.warn, download_dir=download_dir, keep_source=keep_source, node=node)
    con.emit(summary.to_dict(), [*summary.lines(), next_steps(out) if node is None else node_next_steps(out, node)])


def next_steps(out: Path) -> str:
    """What to do with a finished OUT: prove it, copy what the serving host needs, serve it."""
    from ..outnames import STATE_DIR
    from ..units import size

    total = 0
    for root, dirs, files in os.walk(out):  # os.walk follows no link; convert wrote every file here
        dirs[:] = [d for d in dirs if not (Path(root) == out and d == STATE_DIR)]
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return (f"next: {cmd_check.next_check(out)}; copy {out} ({size(total)}, without {STATE_DIR}/) to the serving "
            f"host; lucifer-shard serve {out} --dry-run")


def node_next_steps(out: Path, node) -> str:
    """What to do with a node's share that convert wrote: prove it and serve it, here (nothing to copy)."""
    from ..output.share import serve_command

    return f"next: {cmd_check.next_check(out, ' (its ranks, against MODEL)')}; {serve_command(out, node)}"


class SizedPresets(click.Command):
    """synth: its help names the bytes each preset writes, computed from the preset (engine/presets.py)
    when the help is shown, not at every start of the CLI."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from ..engine.presets import PRESETS, preset_bytes
        from ..units import size

        written = {p.replace("-", "_"): size(preset_bytes(p)) for p in PRESETS}
        written["flash_layer_more"] = size(preset_bytes("flash-layer", 2) - preset_bytes("flash-layer", 1))
        self.help = (self.help or "").format(**written) if "{" in (self.help or "") else self.help
        super().format_help_text(ctx, formatter)


@cli.command(cls=SizedPresets)
@click.argument("preset", type=click.Choice(["tiny", "flash-layer", "flash-moe", "forward", "dspark",
                                                   "flash-0731-layer"]), metavar="PRESET")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layers", type=click.IntRange(1, 64), default=None, help="Decoder layers (flash-layer, flash-0731-layer: default 1).")
@click.option("--fill", type=click.Choice(list(FILLS)), default=DEFAULT_FILL, show_default=True,
              help="; ".join(f"{name}: {what}" for name, what in FILLS.items()) + ".")
@click.option("--seed", type=click.IntRange(0, (1 << 32) - 1), default=0, show_default=True)
@click.option("--no-mtp", is_flag=True, help="Leave the draft (MTP layer, DSpark stages) out.")
@click.option("--shards", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Split a small checkpoint into at least this many shard files (a shard stays at most 1 GiB).")
@conventions(interrupted="interrupted: {out} holds a partial checkpoint; remove it and run synth again")
def synth(preset: str, out: Path, layers: int | None, fill: str, seed: int, no_mtp: bool, shards: int) -> None:
    """Write a synthetic checkpoint with the exact DeepSeek-V4-Flash schema into OUT, which must not
    exist or be an empty directory, after checking that OUT's filesystem has room for it.

    \b
    tiny         every padded axis at its real size (64 heads, 8 groups, routed and shared
                 2048, vocab 1000), hidden 256, 8 experts, 4 layers (hash, SWA, C4, C128) + MTP;
                 writes {tiny}
    flash-layer  exact Flash dimensions, --layers K (default 1), for benchmarks; writes
                 {flash_layer} at --layers 1, {flash_layer_more} more per layer
    flash-moe    Flash expert geometry (hidden 4096, routed 2048, top-6), 1 layer, small rest;
                 writes {flash_moe}
    forward      tiny with what vLLM's DeepSeek-V4 CPU kernels require: head_dim 512,
                 index_topk 512, 64 experts (make test-forward); writes {forward}
    dspark       tiny's target with DeepSeek-V4-Flash-0731's draft: a three-stage DSpark
                 drafter (context projection, Markov rank 64, confidence head) under mtp.*;
                 writes {dspark}
    flash-0731-layer  flash-layer's dimensions with DeepSeek-V4-Flash-0731's config and its
                 three-stage DSpark drafter at Flash size (Markov rank 256), reading the last
                 (up to three) decoder layers; writes {flash_0731_layer} at --layers 1
    (with the draft; --no-mtp writes less)
    """
    from ..engine.synth import synth as run

    con = Console.of()
    path = run(preset, out, layers=layers, fill=fill, seed=seed, mtp=not no_mtp, progress=con.progress,
               shard_count=shards)
    con.emit({"preset": preset, "path": str(path)}, [f"wrote {preset} checkpoint to {path}"])


@cli.command(cls=Writes)
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("dest", type=click.Path(path_type=Path))
@node_options
@click.option("--kernel-cache", is_flag=True,
              help="Also carry OUT's recorded kernel cache (lucifer-shard cache record) into DEST/kernel-cache/, each "
                   "file checked against its record.")
@conventions(interrupted="interrupted: {out} is untouched; run the same stage again to finish the share")
def stage(out: Path, dest: Path, ranks: str | None, nnodes: int | None, node_rank: int | None,
          kernel_cache: bool) -> None:
    """Write one node's share of OUT into DEST: the rank files of the ranks it runs (target and draft),
    the manifest, config.json, the tokenizer files and COMPLETE.

    
    --ranks K[,K...]            the TP ranks the node runs
    --nnodes N --node-rank R    as vLLM computes them: node R of N runs ranks R*TP/N .. (R+1)*TP/N - 1
                                (at TP3 over three nodes, node R runs rank R)
    Files are hard-linked when DEST is on OUT's filesystem, else copied and read back. Nothing outside
    DEST is written; a stage stopped part-way is finished by running it again. verify, inspect,
    doctor, serve and the loader check exactly the ranks the share holds. e.g.
      lucifer-shard stage out/ node1/ --nnodes 3 --node-rank 1
    """
    from ..engine.stage import stage as run
    from ..output.manifest_types import Manifest
    from ..output.share import NodeShare, refuse_node_flags, serve_command

    refuse_node_flags(ranks, nnodes, node_rank, required=True)
    if not out.is_dir():
        from ..errors import OutputError

        raise OutputError(f"{out}: no such output directory")
    share = NodeShare.of(Manifest.load(out).tp_size, ranks, nnodes, node_rank)
    summary = run(out, dest, list(share.ranks), nnodes, node_rank, kernel_cache)
    Console.of().emit(summary.to_dict(), [*summary.lines(), f"next: lucifer-shard verify {dest}; copy {dest} to the "
                                          f"node; {serve_command(dest, share)}"])


# Commands defined beside their logic (each module imports only click at import time).
from . import cmd_check  # noqa: E402
from .cmd_cache import cache  # noqa: E402
from .cmd_fetch import fetch  # noqa: E402
from .cmd_numerics import check_numerics  # noqa: E402
from .cmd_smoke import smoke  # noqa: E402
from .serve_cli import doctor, serve  # noqa: E402  (vLLM is imported inside the commands)

for _command in (cmd_check.diff, cmd_check.verify, cmd_check.inspect, check_numerics, fetch, doctor, serve, smoke,
                 cache):
    cli.add_command(_command)


def main() -> None:
    cli()
