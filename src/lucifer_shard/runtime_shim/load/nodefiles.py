"""OUT on this node, checked before a start: which ranks a share holds against the ranks this node runs,
and this node's rank files, each present, of its recorded size and header and stamped with this
conversion's identity (`__metadata__`), as `inspect` checks them (proof/structure.open_files), hashing
no byte. A partial or swapped copy of 170 GiB is the likeliest mistake on a serving host; found here, it
stops serve before a multi-GPU start (verify reads every byte)."""
from __future__ import annotations

from lucifer_shard.errors import LuciferError
from lucifer_shard.output.share import ShareRecord, describe, node_problem, read_share, share_repair
from lucifer_shard.proof.report import REPAIR, Report
from lucifer_shard.proof.structure import open_files

from ..checks import FAIL, INFO, OK, Check, out_check
from ..manifest import Output


def share_record(output: Output) -> ShareRecord | None:
    """OUT's share record, None for a whole output or one that is not valid (share_checks says why)."""
    m = output.manifest
    try:
        return read_share(output.path, m.conversion_id, m.tp_size)
    except LuciferError:  # share_checks says why
        return None


def share_checks(output: Output, node_ranks: list[int] | None) -> list[Check]:
    """A node's share (lucifer-shard stage): which ranks it holds and lacks; with `node_ranks` (serve:
    the ranks this node runs), whether it holds them."""
    out, m = output.path, output.manifest
    try:
        share = read_share(out, m.conversion_id, m.tp_size)
    except LuciferError as e:
        return [out_check("output share", FAIL, str(e), share_repair(out))]
    if share is None:
        return []
    lacking = [r for r in range(m.tp_size) if r not in share.ranks]
    checks = [out_check("output share", INFO, f"a node's share: {describe(share)}; lacks rank(s) "
                        f"{', '.join(map(str, lacking)) or 'none'} (on other nodes)")]
    if node_ranks is None:
        return checks
    if lacking and len(node_ranks) == m.tp_size:  # one node running every rank: --nnodes left out
        held = ", ".join(map(str, share.ranks))
        how = (f"add --nnodes {share.nnodes} --node-rank {share.node_rank} --master-addr H (node 0's address)"
               if share.nnodes else "serve it as one node of several (--nnodes N --node-rank R --master-addr "
               "H), staged for that node (lucifer-shard stage OUT DEST --nnodes N --node-rank R)")
        return checks + [out_check("output node ranks", FAIL, f"this share holds rank(s) {held} only: {how}")]
    problem = node_problem(out, m.conversion_id, node_ranks, m.tp_size)
    if problem:
        return checks + [out_check("output node ranks", FAIL, *problem)]
    return checks + [out_check("output node ranks", OK, f"holds this node's TP rank(s) {', '.join(map(str, node_ranks))}")]


def rank_files_check(output: Output, node_ranks: list[int] | None) -> Check:
    """This node's rank files (of `node_ranks`, all without; those a share holds): present, sized, headed
    and stamped as the manifest records. An I/O error reading one is the machine's fault (kind
    environment), raised as every reader of OUT raises it."""
    out, m = output.path, output.manifest
    share = share_record(output)
    ranks = [r for r in (range(m.tp_size) if node_ranks is None else node_ranks)
             if share is None or r in share.ranks]
    report = Report("doctor")
    files = open_files(report, out, m, ranks)
    for rf in files.values():
        rf.close()
    where = f"rank(s) {', '.join(map(str, ranks))}"
    if report.ok:
        return out_check("output rank files", OK, f"{len(files)} file(s) of {where}: present, with their recorded "
                         f"size, header and identity (not hashed: lucifer-shard verify OUT reads every byte)")
    first = report.problems[0]
    fix = share_repair(out) if share is not None else "copy OUT's rank files again from the conversion box"
    return out_check("output rank files", FAIL, f"{report.count} finding(s) in the files of {where}; first: "
                     f"{first.where() + ': ' if first.where() else ''}{first.message.removesuffix('; ' + REPAIR)}",
                     f"{fix}, then lucifer-shard verify OUT", damage=True)
