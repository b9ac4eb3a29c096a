"""The checking commands: `diff OUT [MODEL]`, `verify OUT`, `inspect OUT`.

Register them on the `lucifer-shard` group with `cli.add_command(diff)` etc. Findings make the
command raise MismatchError (exit 1) after the report is printed; an OUT or MODEL that cannot be
opened at all raises OutputError / SourceError (exit 2), like `diff(1)`'s "trouble". The same rule
for every command that reads OUT: no output at all (missing, not a directory, no manifest) is kind
output, exit 2; an output that is there but damaged or edited is kind mismatch, exit 1 (`structure`
checks it for the commands that do not read every byte: inspect, check-numerics).
"""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import MismatchError, OutputError
from ..model.drafts import DRAFT_KINDS
from ..model.plan import serving_arch
from ..outnames import MANIFEST_NAME
from ..output.manifest import complete_problem, read_manifest_bytes
from ..output.manifest_types import Manifest
from ..output.outwatch import ReadWatch
from ..output.share import ShareRecord, describe, identity_line, read_share
from ..proof.report import Report
from ..proof.structure import open_files, read_manifest
from ..units import size
from .argorder import refuse_swapped
from .console import Console, conventions

MAX_MISMATCHES = click.option("--max-mismatches", type=click.IntRange(1), default=10, show_default=True,
                              help="How many findings to report in full (all are counted).")
CHECK_INTERRUPTED = "interrupted: {} stopped before checking everything (it writes nothing); run it again"


def _fail(report, noun: str, fix: str) -> None:
    first = report.first().replace(f"; {report.repair}", "")  # the fix is said once, at the end
    p = report.problems[0] if report.problems else None
    where = ""
    if p is not None and p.file and p.file not in first:
        offs = p.detail.get("file_offset")
        where = f" [{p.file}" + (f" byte {offs[0]}" if offs else "") + "]"
    raise MismatchError(f"{report.command}: {report.count} {noun}; first: {first}{where}; "
                        f"{fix.format(repair=report.repair)}")


# `{repair}`: the report's fix (a node's share is staged again, a whole output repaired by convert)
DAMAGED = "OUT is damaged or mixed: {repair} (verify OUT names every problem)"


def out_dir(out: Path) -> Path:
    """OUT as a directory; OutputError (no output at all) when it is missing or not a directory."""
    out = Path(out)
    if not out.is_dir():
        what = "is not a directory" if out.exists() else "no such output directory"
        raise OutputError(f"{out}: {what}; pass the OUT of a lucifer-shard convert")
    return out


def structure(out: Path, command: str) -> Report:
    """OUT as diff and verify see it before reading tensor data: the one output check (output/output_check),
    every listed rank file present with its identity stamp and header. Findings are the report's (damage:
    exit 1); OutputError when OUT holds no output at all (exit 2)."""
    report = Report(command)
    checked = read_manifest(report, out_dir(out))
    for rf in open_files(report, out, checked.manifest, checked.held).values():
        rf.close()
    return report


def watched(out: Path, command: str, run):
    """`run()` between two looks at OUT (`ReadWatch`): an OUT that a `convert` is writing, or that one
    rewrote while `run` read it, is refused with that reason instead of a report on a mix of two
    outputs (or an error the mix caused)."""
    watch = ReadWatch.start(out)
    watch.check(command)
    try:
        result = run()
    except Exception:
        watch.check(command)
        raise
    watch.check(command)
    return result


def _report(out: Path, run, lines, noun: str, fix: str) -> None:
    """Run a check (`watched`), emit its report (text or the JSON envelope), and fail with one line
    when it found anything."""
    report = watched(out, click.get_current_context().info_name, run)
    share = report.info.get("share")
    Console.of().emit(report.to_dict(), [*([share_line(share)] if share else []), *lines(report)])
    if not report.ok:
        _fail(report, noun, fix)


def next_check(out: Path, diff: str = "") -> str:
    """The check a finished OUT gets next: `diff` (with `diff`'s words after it) where the source is on disk;
    after a streamed convert `verify`, and what a diff costs (the source downloaded again) with its flag."""
    from ..proof.diff_source import download_bytes

    again = download_bytes(out)
    if not again:
        return f"lucifer-shard diff {out}{diff}"
    return (f"lucifer-shard verify {out} (a diff downloads the source again, {size(again)} from the Hub: "
            f"lucifer-shard diff {out} --download-source)")


@click.command("diff")
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("model", required=False)
@MAX_MISMATCHES
@click.option("--workers", type=click.IntRange(1), default=None,
              help="Threads for reading, layout inversion and comparison  [default: min(max(CPUs, 2 x TP), 16)]")
@click.option("--keep-going", is_flag=True,
              help="Compare byte for byte even when MODEL is not the checkpoint OUT was converted from (its "
                   "fingerprint or content differs): to see where it differs.")
@click.option("--download-dir", type=click.Path(path_type=Path), default=None,
              help="A repo id not in the Hugging Face cache streams its shards through this folder (each removed "
                   "once compared)  [default: a folder in the system's temporary directory]")
@click.option("--download-source", is_flag=True,
              help="Download the source's shards from the Hub when MODEL (or the recorded source) is a repo id not "
                   "in the Hugging Face cache: the whole checkpoint again (without it diff refuses, naming the bytes; "
                   "verify checks OUT without the source).")
@conventions(interrupted=CHECK_INTERRUPTED.format("diff"))
def diff(out: Path, model: str | None, max_mismatches: int, workers: int | None, keep_going: bool,
         download_dir: Path | None, download_source: bool) -> None:
    """Prove, byte for byte, that the rank files in OUT are the checkpoint MODEL.

    MODEL defaults to the source the manifest records. First the source fingerprint (config.json,
    every shard's header and size) must equal the manifest's; then, for every tensor of every
    role and rank: apply the inverse of its declared layout, check every pad byte, re-assemble
    its logical slices (fused parameters un-fused) and compare them with the source tensors;
    check every source tensor is accounted for exactly once (or dropped for a stated reason).
    The source bytes read are hashed as they stream: once all of a shard's tensors are read,
    its content digest must equal the one convert recorded. A source that is not the converted
    one stops diff with one line (--keep-going compares anyway). Streams with bounded memory.
    Exit 0 only if everything matches; mismatches are reported with the source tensor and
    logical index, the rank tensor, and the byte offset in the rank file. MODEL (or the recorded
    source) may be a repo id: its config.json and shard headers come first (the fingerprint is
    compared before any weight is downloaded); a repo not in the Hugging Face cache (after a
    streamed convert) is the whole source downloaded again, so diff refuses it, naming the bytes,
    unless --download-source is passed: then its shards stream through --download-dir.
    """
    from ..proof.diff import diff as run, diff_lines

    refuse_swapped("diff", model, out, model_first=False)
    progress = Console.of().progress
    _report(out, lambda: run(out, model, max_mismatches=max_mismatches, progress=progress, workers=workers,
                             keep_going=keep_going, download_dir=download_dir, download_source=download_source),
            diff_lines, "difference(s)",
            "OUT is not MODEL: {repair} (or pass the MODEL it was converted from)")


@click.command("verify")
@click.argument("out", type=click.Path(path_type=Path))
@MAX_MISMATCHES
@conventions(interrupted=CHECK_INTERRUPTED.format("verify"))
def verify(out: Path, max_mismatches: int) -> None:
    """Check OUT without the source: manifest, files, digests, zero regions, replicas.

    \b
    - manifest self-digest, COMPLETE equal to the conversion id, entries equal to the rule table
    - every file: present, recorded size and BLAKE3 digest, __metadata__ identity, header
    - zero regions zero (-inf for attn_sink) after the inverse layout; no E8M0 scale byte 0xFF
    - replicated tensors identical on every rank; no stray files in rank folders
    Exit 1 on any problem; 2 when OUT is no lucifer-shard output at all (no manifest).
    """
    from ..proof.verify import verify as run, verify_lines

    progress = Console.of().progress
    _report(out, lambda: run(out, max_problems=max_mismatches, progress=progress), verify_lines, "problem(s)",
            "OUT is damaged or mixed: {repair} (diff OUT MODEL locates every byte)")


@click.command("inspect")
@click.argument("out", type=click.Path(path_type=Path))
@conventions(interrupted="interrupted: inspect writes nothing")
def inspect(out: Path) -> None:
    """Summarize OUT's manifest: source, plan, arch and layouts, files and bytes per rank.

    Exit 1 (after the summary) when the output is damaged or edited: the manifest's self-digest,
    COMPLETE, a rank file missing or not of its recorded identity, header or size (verify reads
    every byte); 2 when OUT holds no lucifer-shard output.
    """
    def run() -> tuple[dict, Report]:
        report = structure(out, "inspect")
        return {**summarize(out), "problem_count": report.count,
                "problems": [p.to_dict() for p in report.problems]}, report

    doc, report = watched(out, "inspect", run)
    Console.of().emit(doc, summary_lines(doc))
    if not report.ok:
        _fail(report, "problem(s)", DAMAGED)


def share_line(share: ShareRecord) -> str:
    """What a node's share holds, said before its report: the other ranks are absent by design."""
    others = [r for r in range(share.tp_size) if r not in share.ranks]
    return (f"share of {describe(share)}: only its ranks are here and checked"
            + (f" (rank(s) {', '.join(map(str, others))} are on other nodes)" if others else ""))


def summarize(out: Path) -> dict:
    out = out_dir(out)
    m = Manifest.parse(read_manifest_bytes(out), out / MANIFEST_NAME)
    try:
        share = read_share(out, m.conversion_id, m.tp_size)
        held = share.ranks if share is not None else None
    except OutputError:  # structure's finding (exit 1 after the summary): no rank counts as the share's
        share, held = None, []
    roles = {role: [{"rank": e.rank, "files": len(e.files), "bytes": sum(f.bytes for f in e.files),
                     "tensors": len(e.tensors), "tensor_bytes": sum(t.model_bytes for t in e.tensors.values()),
                     "padding_bytes": sum(t.padding_bytes for t in e.tensors.values()),
                     "paths": [f.path for f in e.files]}
                    for e in ranks if held is None or e.rank in held]
             for role, ranks in m.roles.items()}
    src = m.source
    return {
        "out": str(out),
        "share": share.to_dict() if share is not None else None,
        "complete": complete_problem(out, m.conversion_id) is None,
        "manifest_digest_ok": m.sealed,
        "conversion_id": m.conversion_id,
        "tool_version": m.tool_version,
        "format_version": m.format_version,
        "source": {"path": src.path, "hub": f"{src.repo}@{src.revision}" if src.repo else None,
                   "fingerprint": src.fingerprint, "content": src.content.digest,
                   "content_tensors": src.content.tensors, "files": len(src.files), "bytes": sum(src.files.values())},
        "identity": identity_line(m.conversion_id, m.content_identity),
        "drafter": None if m.draft is None else {"label": DRAFT_KINDS[m.draft.kind].label, "stage_count": m.draft.stages,
                                                 "tokens_per_step": m.draft.tokens},
        "tp_size": m.tp_size,
        "plan": m.plan.to_dict(),
        "options": m.options.to_dict(),
        "arch": m.arch,
        "moe_variant": m.moe_variant,
        "expert_layout": m.expert_layout,
        "flashinfer_layout": m.flashinfer_layout,
        "layouts": {t: v.name for t, v in m.layouts.items()},
        "layout_version": m.layout_version,
        "runtime": m.runtime,
        "dropped": len(m.dropped),
        "roles": roles,
    }


# plan's order of axes and roles, so that plan and inspect print their tables alike
AXIS_ORDER = ("heads", "groups", "routed", "shared", "vocab")
ROLE_ORDER = ("target", "draft")


def summary_lines(d: dict) -> list[str]:
    src = d["source"]
    lines = [
        *([share_line(ShareRecord.parse(d["share"]))] if d.get("share") else []),
        f"output         {d['out']}",
        f"conversion     {d['conversion_id']}  "
        f"({'complete' if d['complete'] else 'NOT complete'}, manifest digest "
        f"{'ok' if d['manifest_digest_ok'] else 'MISMATCH'})",
        f"tool           lucifer-shard {d['tool_version']}, manifest format v{d['format_version']}",
        f"source         {src['path']}" + (f"  (hf://{src['hub']})" if src["hub"] and not src["path"].startswith("hf://")
                                               else ""),
        f"fingerprint    {src['fingerprint']}  (config.json, headers and sizes of {src['files']} file(s), "
        f"{size(src['bytes'])})",
        f"content        {src['content'] or 'not recorded'}  (BLAKE3 of {src['content_tensors'] or 0} converted "
        f"tensors' bytes)",
        f"identity       {d['identity']}  (every node's serve, doctor and inspect print this line: equal lines, "
        f"one conversion of the same weights)",
        *([f"drafting       {dr['label']}: {dr['stage_count']} stage(s), {dr['tokens_per_step']} draft token(s) per "
           f"step by default (serve --draft)"] if (dr := d.get("drafter")) else []),
        f"tp             {d['tp_size']}",
        f"arch           {serving_arch(d['arch'], (d.get('options') or {}).get('moe_backend')).removeprefix('arch ')}  "
        f"MoE variant {d['moe_variant'] or _variant_any((d.get('options') or {}).get('moe_backend'))}",
        f"experts        {d['expert_layout']} layout"
        + (f", FlashInfer {d['flashinfer_layout']} generation" if d.get("flashinfer_layout") else "")
        + (f", routed width for vLLM's {moe} MoE" if (moe := (d.get("options") or {}).get("moe_backend")) else "")
        + f" (layout version {d['layout_version']})",
    ]
    for t, name in (d.get("layouts") or {}).items():
        lines.append(f"  {t:<18} {name}")
    rt = d.get("runtime") or {}
    if rt:
        lines.append(f"runtime        {rt.get('vllm_line')}; load format {rt.get('load_format')}, attention "
                     f"{rt.get('attention_backend')}, MoE {rt.get('moe_backend')}, FlashInfer {rt.get('flashinfer')}")
    axes = ((d.get("plan") or {}).get("axes") or {})
    if axes:
        lines += ["", f"{'axis':<8} {'original':>9} {'padded':>9} {'per rank':>9} {'kernel-local':>13}"]
        for a in sorted(axes.values(), key=lambda a: AXIS_ORDER.index(a["name"]) if a["name"] in AXIS_ORDER else 99):
            lines.append(f"{a['name']:<8} {a['original']:>9} {a['padded']:>9} {a['local']:>9} {a['kernel_local']:>13}")
    lines += ["", f"{'role':<7} {'rank':>4} {'files':>5} {'tensors':>7} {'bytes':>14} {'padding':>14} {'pad %':>6}"]
    for role, ranks in sorted(d["roles"].items(), key=lambda kv: ROLE_ORDER.index(kv[0]) if kv[0] in ROLE_ORDER else 9):
        for r in ranks:
            pct = 100.0 * r["padding_bytes"] / r["tensor_bytes"] if r["tensor_bytes"] else 0.0
            lines.append(f"{role:<7} {r['rank']:>4} {r['files']:>5} {r['tensors']:>7} {r['bytes']:>14,} "
                         f"{r['padding_bytes']:>14,} {pct:>5.2f}%")
    if d["dropped"]:
        lines.append(f"dropped        {d['dropped']} source tensor(s) (see the manifest's \"dropped\" for reasons)")
    return lines


def _variant_any(moe_backend: str | None) -> str:
    """inspect's MoE variant of an output that records none: any, unless its route's width binds one backend."""
    return f"{moe_backend} only (its routed width)" if moe_backend else "any (vLLM picks it for the GPU)"
