"""A node's share of an output (`lucifer-shard stage`): the files of the TP ranks one node runs, plus
what every rank needs (manifest, config.json, tokenizer files, COMPLETE), and `lucifer-share.json`
naming those ranks. The manifest is the output's own, byte for byte (it lists every rank); readers of
a share check exactly the ranks `lucifer-share.json` names.

Which ranks a node runs is vLLM's rule for `--nnodes N --node-rank R` with the mp executor
(vllm/engine/arg_utils.py, 0.33.0): the world size must divide by N, and node R runs the global ranks
R*W/N .. (R+1)*W/N - 1. With TP only (PP = DP = 1, as lucifer_tp3 requires) the global rank is the
TP rank.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import NODE_CONVERT_RESUME, STAGE_AGAIN, OutputError, UsageRefused
from ..formats.records import fld, from_doc, schema_of, to_doc
from ..formats.schema import Int, ListOf, Null, SchemaError, Str, check
from ..guarded_io import Tree
from ..model.plan import MAX_TP
from ..outnames import rank_of
from .manifest import RECORD_REL

SHARE_NAME = "lucifer-share.json"
SHARE_FORMAT = "lucifer-shard-share"
SHARE_VERSION = 1
SHORT_DIGEST = 12  # hex digits of a digest shown where nodes' lines are compared by eye


def node_ranks(tp: int, nnodes: int, node_rank: int) -> list[int]:
    """The TP ranks node `node_rank` of `nnodes` runs (vLLM's rule); UsageRefused where vLLM refuses."""
    if nnodes < 1 or tp % nnodes:
        raise UsageRefused(f"--nnodes {nnodes}: vLLM needs the world size (tp {tp}) to divide by the number of nodes; "
                           f"choose one of {', '.join(str(n) for n in range(1, tp + 1) if tp % n == 0)}")
    if not 0 <= node_rank < nnodes:
        raise UsageRefused(f"--node-rank {node_rank}: nodes are numbered 0..{nnodes - 1}")
    per = tp // nnodes
    return list(range(node_rank * per, (node_rank + 1) * per))


# The fix of a share that is damaged, edited or mixed: stage it again from the whole output (stage
# re-checks every file against the manifest and replaces only those that fail); never convert into it.
SHARE_REPAIR = (f"stage the share again from the whole output: "
                f"{STAGE_AGAIN.at(ranks='with the same --ranks or --nnodes/--node-rank')}; never convert into a share")
# A share a node's convert wrote (`convert --ranks`, its conversion record in .lucifer/) is repaired by that convert.
CONVERT_REPAIR = str(NODE_CONVERT_RESUME)


def share_repair(out: Path | str) -> str:
    """The fix of a damaged share in OUT: the convert that wrote it, or stage (output/manifest.RECORD_REL tells)."""
    return CONVERT_REPAIR if Tree(out).lstat(RECORD_REL) is not None else SHARE_REPAIR


def parse_ranks(text: str, tp: int) -> list[int]:
    """`--ranks 0,2` as a sorted list of distinct TP ranks below `tp`; a rank named twice is refused (a slip
    for another rank, which the node would then lack)."""
    try:
        named = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageRefused(f"--ranks {text[:40]!r}: expected TP ranks separated by commas, e.g. --ranks 1") from None
    ranks = sorted(set(named))
    twice = [r for r in ranks if named.count(r) > 1]
    if twice:
        raise UsageRefused(f"--ranks {text[:40]!r}: rank {twice[0]} is named twice; name each rank the node runs "
                           f"once, e.g. --ranks 0,1")
    bad = [r for r in ranks if not 0 <= r < tp]
    if not ranks or bad:
        raise UsageRefused(f"--ranks {text[:40]!r}: the output has TP ranks 0..{tp - 1}")
    return ranks


def refuse_node_flags(ranks: str | None, nnodes: int | None, node_rank: int | None, required: bool) -> None:
    """The rules of --ranks / --nnodes / --node-rank that need no TP size (stage: one of them is required;
    convert without them converts every rank)."""
    if (nnodes is None) != (node_rank is None):
        raise UsageRefused("--nnodes and --node-rank go together; pass both, or --ranks")
    if (ranks is not None and nnodes is not None) or (required and ranks is None and nnodes is None):
        raise UsageRefused("pass the ranks the node runs: --ranks K[,K...] or --nnodes N --node-rank R (one of them)")


@dataclass(frozen=True)
class NodeShare:
    """The TP ranks one node runs, as --ranks or --nnodes/--node-rank chose them (`ShareRecord`'s fields)."""

    ranks: tuple[int, ...]
    nnodes: int | None = None
    node_rank: int | None = None

    @classmethod
    def of(cls, tp: int, ranks: str | None, nnodes: int | None, node_rank: int | None) -> NodeShare:
        """The share a command line names (`refuse_node_flags` passed, one of --ranks or --nnodes given)."""
        chosen = parse_ranks(ranks, tp) if ranks is not None else node_ranks(tp, nnodes, node_rank)
        return cls(tuple(chosen), nnodes, node_rank)

    def doc(self, conversion_id: str, tp: int) -> ShareRecord:
        return share_doc(conversion_id, tp, list(self.ranks), self.nnodes, self.node_rank)

    def holds(self, rel: str) -> bool:
        """Whether rank file `rel` is one of this share's."""
        return rank_of(rel) in self.ranks


def chosen_share(tp: int, ranks: str | None, nnodes: int | None, node_rank: int | None) -> NodeShare | None:
    """convert's and plan's node flags: the share they name, or None without them (every rank)."""
    refuse_node_flags(ranks, nnodes, node_rank, required=False)
    return NodeShare.of(tp, ranks, nnodes, node_rank) if ranks is not None or nnodes is not None else None


def serve_command(out: Path | str, share: NodeShare) -> str:
    """How a node serves its share: across nodes with its --nnodes/--node-rank, else a dry run first."""
    if share.nnodes is None:
        return f"lucifer-shard serve {out} --dry-run"
    return f"lucifer-shard serve {out} --nnodes {share.nnodes} --node-rank {share.node_rank} --master-addr HOST"


@dataclass(frozen=True)
class ShareRecord:
    """`lucifer-share.json` (and a node's conversion record's `share`): the ranks a share holds. Read only
    through `ShareRecord.parse`, which `read_share` and convert's record check call."""

    format: str = fld(Str())
    format_version: int = fld(Int())
    conversion_id: str = fld(Str())
    tp_size: int = fld(Int(1, MAX_TP))
    ranks: tuple[int, ...] = fld(ListOf(Int(0, MAX_TP - 1), 1, MAX_TP))
    nnodes: int | None = fld(Null(Int(1, MAX_TP)))
    node_rank: int | None = fld(Null(Int(0, MAX_TP - 1)))

    @classmethod
    def parse(cls, doc: object, tp: int | None = None) -> ShareRecord:
        """The record of `doc`; ValueError saying why (`record_problem`) when it is not one stage writes."""
        problem = record_problem(doc, tp)
        if problem:
            raise ValueError(problem)
        return from_doc(cls, doc)

    def to_dict(self) -> dict:
        return to_doc(self)


def share_doc(conversion_id: str, tp: int, ranks: list[int], nnodes: int | None, node_rank: int | None
              ) -> ShareRecord:
    return ShareRecord(SHARE_FORMAT, SHARE_VERSION, conversion_id, tp, tuple(sorted(ranks)), nnodes, node_rank)


def share_text(record: ShareRecord) -> str:
    return json.dumps(record.to_dict(), indent=1, sort_keys=True) + "\n"


def read_share(out: Path | str, conversion_id: str | None = None, tp: int | None = None) -> ShareRecord | None:
    """OUT's share record (None: OUT is a whole output). OutputError when it is not a valid one
    (`record_problem`), or is another conversion's (or another TP size's, given `tp`)."""
    tree = Tree(out)
    if tree.lstat(SHARE_NAME) is None:
        return None
    try:
        doc = json.loads(tree.read(SHARE_NAME))
    except (ValueError, UnicodeDecodeError, RecursionError):
        doc = None
    try:
        share = ShareRecord.parse(doc, tp)
    except ValueError as e:
        raise OutputError(f"{tree.path(SHARE_NAME)}: {e}; {share_repair(out)}") from None
    if conversion_id is not None and share.conversion_id != conversion_id:
        raise OutputError(f"{tree.path(SHARE_NAME)}: a share of conversion {share.conversion_id[:12]}, the "
                          f"manifest's is {conversion_id[:12]}: files of two conversions; {share_repair(out)}")
    return share


def record_problem(doc: object, tp: int | None = None) -> str | None:
    """Why `doc` is not a share record stage writes (`ShareRecord`'s fields, and the rules of `parse_ranks`
    and `node_ranks`), or None. `tp`: the manifest's TP size, which the record must repeat."""
    if not isinstance(doc, dict) or doc.get("format") != SHARE_FORMAT:
        return "not a lucifer-shard share record"
    if doc.get("format_version") != SHARE_VERSION:
        return f"share record format_version {str(doc.get('format_version'))[:20]}, this tool writes {SHARE_VERSION}"
    try:
        check(schema_of(ShareRecord), doc)
    except SchemaError as e:
        return f"field {e}"
    share = from_doc(ShareRecord, doc)
    size, ranks, nnodes, node = share.tp_size, list(share.ranks), share.nnodes, share.node_rank
    if tp is not None and size != tp:
        return f"tp_size {size} is not the output's TP size ({tp})"
    if any(r >= size for r in ranks) or ranks != sorted(set(ranks)):
        return f"ranks {str(ranks)[:40]} are not distinct TP ranks 0..{size - 1} in order (a share holds at least one)"
    if (nnodes is None) != (node is None):
        return "nnodes and node_rank go together"
    if nnodes is not None and (size % nnodes or node >= nnodes or node_ranks(size, nnodes, node) != ranks):
        return f"node {node} of {nnodes} does not run ranks {ranks} (vLLM's rule)"
    return None


def identity_line(conversion_id: str, content: str) -> str:
    """'conversion 40e5d952756d, content 1f0c2a9b3d4e': an output's identity as serve, doctor, inspect and the
    loader's cross-node check print it, so that every node's line compares by eye. The conversion id covers
    config, headers, sizes and options; `content`, the weights: `Manifest.content_identity`, the digest of
    the rank files' content stamps, which verify checks against the files (never `source.content`, a claim
    a re-sealed manifest could copy from another output)."""
    return f"conversion {conversion_id[:SHORT_DIGEST]}, content {content.rpartition(':')[2][:SHORT_DIGEST]}"


def describe(share: ShareRecord) -> str:
    """'ranks 1 of tp 3 (node 1 of 3)'."""
    node = f" (node {share.node_rank} of {share.nnodes})" if share.nnodes else ""
    return f"rank(s) {', '.join(map(str, share.ranks))} of tp {share.tp_size}{node}"


def missing_rank(doc: ShareRecord, rank: int, where: Path | str) -> str:
    """The one line for a worker whose TP rank is not in the share it was given: node, rank and fix."""
    return ": ".join(missing_rank_parts(doc, rank, where))


def missing_rank_parts(doc: ShareRecord, rank: int, where: Path | str) -> tuple[str, str]:
    """missing_rank's line as (what is wrong, the fix), for a report that shows the fix apart."""
    nnodes = doc.nnodes
    node = rank // (doc.tp_size // nnodes) if nnodes else None
    here = f"node {doc.node_rank}'s share" if doc.node_rank is not None else "a share"
    stage = STAGE_AGAIN.at(ranks=f"--nnodes {nnodes} --node-rank {node}" if nnodes else f"--ranks {rank}").command
    return (f"{where} is {here} ({describe(doc)}) but this worker runs TP rank {rank}"
            + (f", node {node}'s" if node is not None else ""),
            f"start this node with the --node-rank its share was staged for, or stage its rank here ({stage})")


def share_problem(out: Path | str, conversion_id: str, rank: int, tp: int | None = None) -> str | None:
    """Why a worker of TP rank `rank` cannot load from OUT (a share without that rank, or a share
    record that is not this output's, of TP size `tp`), None when it can (a whole output, or a share holding it)."""
    try:
        doc = read_share(out, conversion_id, tp)
    except OutputError as e:
        return str(e)
    return missing_rank(doc, rank, out) if doc is not None and rank not in doc.ranks else None


def node_problem(out: Path | str, conversion_id: str, ranks: list[int], tp: int | None = None
                 ) -> tuple[str, str] | None:
    """Why OUT (of TP size `tp`) cannot serve a node that runs `ranks` (a share lacking some), and the fix;
    None when it can."""
    try:
        doc = read_share(out, conversion_id, tp)
    except OutputError as e:
        return str(e), share_repair(out)
    lacking = [r for r in ranks if doc is not None and r not in doc.ranks]
    return missing_rank_parts(doc, lacking[0], out) if lacking else None
