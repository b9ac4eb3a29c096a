"""The structure of an output, checked by `diff` and `verify` alike: the one output check of the
manifest (output/output_check: self-digest, COMPLETE, conversion id, entries against the rule table,
sizes, copies) as report findings; every listed rank file present, with its identity stamp and header
as the manifest records them."""
from __future__ import annotations

import logging
from pathlib import Path

from ..errors import COMMAND_AGAIN, CONVERT_FORCE, CONVERT_RESUME, OutputError, fault
from ..formats.stheader import META_CONTENT, META_CONVERSION_ID, META_PART, META_RANK, META_ROLE, HeaderError
from ..guarded_io import Refused, Tree
from ..outnames import strays, MANIFEST_NAME, STATE_DIR
from ..output.manifest import COMPLETE_NAME, file_metadata
from ..output.manifest_types import Manifest, TensorRecord
from ..output.output_check import OutputCheck, check_output
from .rankfile import RankFile
from .report import REPAIR, Problem, Report

logger = logging.getLogger("lucifer_shard.structure")  # -v: a line per rank file, -vv: per tensor


# ---------------------------------------------------------------- shared structural checks


def read_manifest(report: Report, out: Path) -> OutputCheck:
    """OUT's manifest and the one output check (output/output_check: every finding is the report's, the
    share's fix named first); OutputError when OUT holds no readable manifest."""
    if not (out / MANIFEST_NAME).exists() and (out / STATE_DIR).is_dir():
        raise OutputError(f"{out} holds an unfinished conversion (no {MANIFEST_NAME}, no {COMPLETE_NAME})",
                          remedy=CONVERT_RESUME)
    checked = check_output(out)
    report.repair = checked.repair
    if checked.share is not None:
        report.info["share"] = checked.share
    for f in checked.findings:
        report.add(Problem(f.kind, f.message, f.role, f.rank, f.tensor, f.file))
        if f.kind == "file" and f.rank is not None:
            report.reported_files.add(f.file)
    return checked


def check_strays(report: Report, out: Path, manifest: Manifest, held: list[int] | None) -> None:
    """Entries of the role and rank folders the manifest does not list (`outnames`: the rule convert
    --resume and stage apply too); of a share, every file of a rank it does not hold is one."""
    listed = [f.path for _, _, f in manifest.files(held)]
    for s in strays(Tree(out), listed, manifest.roles, manifest.tp_size):
        report.add(Problem("file", s.line, s.role if s.rank is not None else None, s.rank, file=s.rel))


def open_files(report: Report, out: Path, manifest: Manifest, held: list[int] | None) -> dict[str, RankFile]:
    """Open every listed rank file and check identity and header against the manifest (its size is
    the output check's, output/output_check)."""
    files: dict[str, RankFile] = {}
    tp = manifest.tp_size
    cid = manifest.conversion_id
    tree = Tree(out)
    for role, rank, f in manifest.files(held):
        rel = f.path
        path = out / rel
        entry = manifest.rank(role, rank)
        names = entry.held(rel)
        holds = f"holds {len(names)} tensor(s): {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        try:
            rf = RankFile(tree, rel)
        except FileNotFoundError:
            folder = path.parent
            what = f"rank folder {folder.relative_to(out)} is missing" if not folder.is_dir() else "file is missing"
            report.add(Problem("file", f"{rel}: {what} ({holds}); {report.repair}", role, rank,
                               names[0] if names else None, rel))
            continue
        except Refused as e:  # a link or not a regular file: never followed out of OUT
            report.add(Problem("file", f"{e}; {report.repair if report.repair != REPAIR else CONVERT_FORCE}",
                               role, rank, file=rel))
            continue
        except HeaderError as e:
            if rel not in report.reported_files:  # a short file's header is part of its one finding
                report.add(Problem("file", f"{rel}: unreadable safetensors header: {e.reason}; {report.repair}",
                                   role, rank, file=rel))
            continue
        except OSError as e:  # the machine's fault (EIO, EACCES, EMFILE...), not a finding about OUT
            raise fault(OSError(e.errno, e.strerror, str(path)), command=report.command,
                        then=COMMAND_AGAIN.at(command=report.command)) or e from None
        files[rel] = rf
        logger.info("%s rank %d %s: header of %d tensor(s), %d bytes", role, rank, rel, len(rf.tensors), rf.size)
        if rf.trailing:  # safetensors (and so vLLM) refuses a file with bytes after its data
            report.add(Problem("file", f"{rel}: {rf.trailing} bytes follow the last tensor; safetensors "
                               f"refuses such a file; {report.repair}", role, rank, file=rel))
        want_meta = file_metadata(cid, role, rank, _part_of(rel), tp, f.content) if _part_of(rel) is not None \
            else None
        if want_meta is not None:
            for k, v in want_meta.items():
                if rf.meta.get(k) != v:
                    report.add(Problem("file", f"{rel}: __metadata__ {k} is {rf.meta.get(k)!r}, expected {v!r}: "
                                       f"{_identity_hint(k, report.repair)}", role, rank, file=rel))
        for name in names:
            info = entry.tensors[name]
            ht = rf.tensors.get(name)
            logger.debug("%s %s: header %s, manifest %s%s", rel, name, ht and f"{ht.dtype}{list(ht.shape)}",
                         info.dtype, list(info.shape))
            if ht is None:
                report.add(Problem("header", f"not in {rel}, where the manifest puts it", role, rank, name, rel))
                continue
            if ht.dtype != info.dtype or tuple(ht.shape) != info.shape:
                report.add(Problem("header", f"{rel} stores {ht.dtype}{list(ht.shape)}, the manifest says "
                                   f"{info.dtype}{list(info.shape)}", role, rank, name, rel))
            if rf.truncated(name) and rel not in report.reported_files:
                report.add(Problem("file", f"{rel} is truncated inside this tensor (it ends at byte {ht.end}, the "
                                   f"file has {rf.size}); {report.repair}", role, rank, name, rel))
        for name in sorted(set(rf.tensors) - set(names)):
            report.add(Problem("header", f"{rel} holds a tensor the manifest does not list there",
                               role, rank, name, rel))
    return files


def check_file_digests(report: Report, manifest: Manifest, files: dict[str, RankFile], held: list[int] | None,
                       chunk_bytes: int) -> None:
    """diff's last check: each rank file's digest against the one the manifest records, for the files whose
    bytes were found equal to the source's (a damaged byte is a finding already): stage, fetch and the loader trust the recorded
    digests, so a re-sealed one is a finding here as in verify. One more read of the rank files (page cache
    warm from the comparison)."""
    for role, rank, f in manifest.files(held):
        rf = files.get(f.path)
        if rf is None or report.concerns(role, rank, f.path, manifest.rank(role, rank).held(f.path)):
            continue
        try:
            got = rf.manifest_digest(chunk_bytes)
        finally:
            rf.close()  # one descriptor at a time, however many files OUT has
        if got is not None and got != f.digest:
            report.add(Problem("file", f"{f.path}: file digest {got[7:23]}... differs from the manifest's "
                               f"{f.digest[7:23]}...: the manifest or the file was changed after conversion; "
                               f"{report.repair}", role, rank, file=f.path))


def _part_of(rel: str) -> int | None:
    stem = Path(rel).name
    if stem.startswith("part-") and stem.endswith(".safetensors"):
        try:
            return int(stem[5:-12])
        except ValueError:
            return None
    return None


def _identity_hint(key: str, repair: str) -> str:
    if key == META_CONVERSION_ID:
        return f"this file comes from another conversion; {repair}"
    if key == META_CONTENT:
        return f"this file was made from other source weights (another checkpoint or revision); {repair}"
    if key in (META_RANK, META_ROLE, META_PART):
        return f"this file was moved or swapped from another rank/part; {repair}"
    return f"this file does not belong to this output; {repair}"


def usable(rf: RankFile | None, name: str, info: TensorRecord) -> bool:
    """Whether a tensor can be read and interpreted as the manifest describes it."""
    if rf is None:
        return False
    ht = rf.tensors.get(name)
    return ht is not None and not rf.truncated(name) and ht.dtype == info.dtype and tuple(ht.shape) == info.shape


def is_replicated(manifest: Manifest, role: str, name: str) -> bool:
    ranks = manifest.roles[role]
    first = ranks[0].tensors[name].sources
    for r in ranks:
        t = r.tensors.get(name)
        if t is None or t.sources != first:
            return False
        if any(p.src_start != 0 or p.length != p.seg_len for p in t.sources):
            return False
    return True
