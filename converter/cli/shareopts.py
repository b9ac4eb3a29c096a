"""The options that name a node's ranks, shared by `stage` and `fetch` (one wording, one rule: spec/share.py)."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import UsageRefused


def share_options(f):
    """--ranks, or --nnodes with --node-rank."""
    for option in reversed((
        click.option("--ranks", default=None, metavar="K[,K...]", help="The TP ranks the node runs, e.g. --ranks 1."),
        click.option("--nnodes", type=click.IntRange(1), default=None,
                     help="With --node-rank: the node count vLLM is started with; the ranks follow vLLM's rule."),
        click.option("--node-rank", type=click.IntRange(0), default=None,
                     help="With --nnodes: this node's number, 0..N-1."),
    )):
        f = option(f)
    return f


def refuse_choice(ranks: str | None, nnodes: int | None, node_rank: int | None) -> None:
    """One way of naming the ranks, whole (before anything is read)."""
    if (nnodes is None) != (node_rank is None):
        raise UsageRefused("--nnodes and --node-rank go together; pass both, or --ranks")
    if (ranks is None) == (nnodes is None):
        raise UsageRefused("pass the ranks the node runs: --ranks K[,K...] or --nnodes N --node-rank R (one of them)")


def chosen_ranks(ranks: str | None, nnodes: int | None, node_rank: int | None, tp: int) -> list[int]:
    """The TP ranks of an output of TP size `tp` the options name."""
    from ..spec.share import node_ranks, parse_ranks

    return parse_ranks(ranks, tp) if ranks is not None else node_ranks(tp, nnodes, node_rank)


def serve_line(dest: Path, nnodes: int | None, node_rank: int | None) -> str:
    """How the node serves its share."""
    return (f"lucifer-shard serve {dest} --nnodes {nnodes} --node-rank {node_rank} --master-addr HOST"
            if nnodes else f"lucifer-shard serve {dest} --dry-run")
