"""The options that name a node's ranks, one wording for `stage`, `fetch`, `convert` and `plan` (their rules
are output/share.py's: `refuse_node_flags`, `NodeShare`)."""
from __future__ import annotations

import click


def node_options(f):
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
