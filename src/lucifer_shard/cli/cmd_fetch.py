"""`lucifer-shard fetch`: one node's share of a published output, from the Hub or a directory (engine/fetch.py)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from .console import Console, conventions
from .shareopts import node_options

if TYPE_CHECKING:  # the engine and spec load inside the command, as every command's do
    from ..engine.stage import Want
    from ..model.config import ModelConfig
    from ..output.manifest_types import Manifest


@click.command()
@click.argument("source")
@click.argument("dest", type=click.Path(path_type=Path))
@node_options
@click.option("--revision", default=None,
              help="With a repo id: the branch, tag or commit to fetch; resolved once, every file comes from that "
                   "commit.")
@click.option("--dry-run", is_flag=True,
              help="Print the node's files and bytes and the equivalent `hf download` line; read only the manifest.")
@click.option("--kernel-cache", is_flag=True,
              help="Also bring the output's recorded kernel cache (kernel-cache/, lucifer-shard cache record) into "
                   "DEST, each file checked against its record.")
@conventions(interrupted="interrupted: files already checked are kept; run the same fetch again to finish the share "
                         "(a download resumes)")
def fetch(source: str, dest: Path, ranks: str | None, nnodes: int | None, node_rank: int | None,
          revision: str | None, dry_run: bool, kernel_cache: bool) -> None:
    """Bring one node's share of a published output into DEST: the manifest, config.json, the
    tokenizer files, the model card and the rank files of the ranks it runs (target and draft), then
    lucifer-share.json and COMPLETE, as `stage` writes them from the whole output.

    \b
    SOURCE   a repo id (with --revision) holding an output uploaded without .lucifer/,
             or a directory holding one (a mount, a copy)
    --ranks K[,K...] or --nnodes N --node-rank R, as stage takes them.
    The manifest is read first and checked; every file is checked against it (and, from the Hub,
    against the SHA-256 the Hub publishes) before it gets its name in DEST. Downloads land in
    DEST/.lucifer-fetch/ and resume; a fetch stopped part-way is finished by running it again. e.g.
      lucifer-shard fetch owner/flash-tp3 node1/ --nnodes 3 --node-rank 1
    """
    from ..engine.fetch import fetch as run, load_manifest, locate
    from ..engine.stage import share_files
    from ..outnames import MANIFEST_NAME
    from ..output.share import NodeShare, refuse_node_flags, serve_command

    refuse_node_flags(ranks, nnodes, node_rank, required=True)
    pub = locate(source, revision)
    manifest, data = load_manifest(pub)
    _refuse_findings(pub.name(MANIFEST_NAME), manifest, None)
    share = NodeShare.of(manifest.tp_size, ranks, nnodes, node_rank)
    chosen = list(share.ranks)
    con = Console.of()
    if dry_run:
        wants = share_files(manifest, chosen, data)
        hf = pub.hf_download(wants, dest) if pub.repo else None
        total = sum(w.bytes for w in wants)
        con.emit({"source": pub.shown, "dest": str(dest), "ranks": chosen, "bytes": total, "hf_download": hf,
                  "files": [{"path": w.rel, "bytes": w.bytes} for w in wants]}, _dry_lines(pub.shown, wants, hf))
        return

    def check_config(at: Path) -> None:
        from ..model.config import load_config

        cfg = load_config(at / "config.json", follow=False)
        _refuse_findings(pub.name(MANIFEST_NAME), manifest, cfg)

    summary = run(pub, dest, manifest, data, chosen, nnodes, node_rank, con.progress, check_config, kernel_cache)
    con.emit(summary.to_dict(), [*summary.lines(), f"next: lucifer-shard verify {dest}; "
                                                   f"{serve_command(dest, share)}"])


def _refuse_findings(where: str, manifest: Manifest, cfg: ModelConfig | None) -> None:
    """OutputError naming the first finding of the output check's part that needs no file of the output
    (`output.output_check.check_manifest`; with config.json: against the rule table)."""
    from ..engine.fetch import REPUBLISH
    from ..errors import OutputError
    from ..output.output_check import OutputCheck, check_manifest

    check = OutputCheck(Path(where), manifest)
    check.repair = REPUBLISH
    check_manifest(check, cfg)
    if check.findings:
        raise OutputError(f"{where}: {' '.join(check.findings[0].message.split())}")


def _dry_lines(shown: str, wants: list[Want], hf: str | None) -> list[str]:
    from ..units import size

    width, total = max(len(w.rel) for w in wants), sum(w.bytes for w in wants)
    lines = [f"fetch {shown}: {len(wants)} files, {size(total)} ({total} bytes), plus lucifer-share.json and COMPLETE"]
    lines += [f"  {w.rel:<{width}}  {size(w.bytes):>10}" for w in wants]
    same = "the same files with huggingface_hub's CLI (no checks against the manifest, no share record)"
    return lines + ([f"{same}: {hf}"] if hf else [])
