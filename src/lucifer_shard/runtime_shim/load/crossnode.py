"""One conversion on every node: each TP rank's share identity, compared with rank 0's as the model loads.

A node's own checks (nodefiles, the loader) prove its share is whole and of the manifest it carries. Two
nodes' shares can still hold different weights under one conversion id: the id covers config, headers,
sizes and options, not the weights (a derivative of 0731 has the base's id). The content identity covers
the weights: the digest of the rank files' content stamps (`Manifest.content_identity`), each bound to its
file's bytes, so a manifest re-sealed with another output's `source.content` does not pass for it. The
loader gathers every rank's `ShareIdentity` over vLLM's CPU process group before it reads a byte;
`identity_problem` is the comparison. Imports neither vLLM nor torch.
"""
from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from lucifer_shard.output.share import identity_line

from ..manifest import Output
from .nodefiles import share_record

FIX = ("every node must serve a share of one output: stage each node's share from the same OUT "
       "(lucifer-shard stage OUT DEST --nnodes N --node-rank R, or fetch it), compare the conversion and content "
       "of `lucifer-shard inspect DEST` on every node, then start again")


@dataclass(frozen=True)
class ShareIdentity:
    """What one TP rank serves: its output's conversion id and content identity, and where it is."""

    tp_rank: int
    host: str
    out: str
    conversion_id: str = ""
    content: str = ""
    node: int | None = None  # the share's node rank (lucifer-share.json); None for a whole output or --ranks
    problem: str | None = None  # this rank could not read its output (its own error says why)

    @classmethod
    def of(cls, output: Output, tp_rank: int) -> ShareIdentity:
        m = output.manifest
        share = share_record(output)  # an invalid one: the loader's share check names it
        return cls(tp_rank, socket.gethostname(), str(output.path), m.conversion_id, m.content_identity,
                   share.node_rank if share else None)

    @classmethod
    def unreadable(cls, tp_rank: int, out: str, problem: str) -> ShareIdentity:
        return cls(tp_rank, socket.gethostname(), out, problem=problem)

    def where(self) -> str:
        node = f"node {self.node}'s share, " if self.node is not None else ""
        return f"TP rank {self.tp_rank} ({node}host {self.host}, {self.out})"

    def key(self) -> tuple[str, str]:
        return self.conversion_id, self.content


def identity_problem(ranks: Sequence[ShareIdentity]) -> str | None:
    """Why these ranks (every TP rank's identity, in rank order) must not serve together, or None."""
    lead = ranks[0]
    unread = [r for r in ranks if r.problem]
    if unread:
        return (f"{unread[0].where()} could not read its output ({unread[0].problem}); every rank stops with it, "
                f"fix that node and start again")
    differ = [r for r in ranks[1:] if r.key() != lead.key()]
    if not differ:
        return None
    d = differ[0]
    more = f" (and {len(differ) - 1} more rank(s))" if len(differ) > 1 else ""
    what = "other source weights" if d.conversion_id == lead.conversion_id else "another conversion"
    return (f"the nodes hold shares of different outputs: {d.where()} has {identity_line(*d.key())}{more}, "
            f"{lead.where()} has {identity_line(*lead.key())}: {what}, whose weights would serve mixed; {FIX}")
