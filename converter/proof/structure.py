"""The structure of an output, checked by `diff` and `verify` alike: the manifest (self-digest,
COMPLETE, conversion id) and its entries against the rule table; every listed rank file present,
with its identity stamp, header and size as the manifest records them."""
from __future__ import annotations

import logging
from pathlib import Path

from .. import __version__
from ..errors import LuciferError, OutputError, fault
from ..guarded_io import Refused, Tree
from ..outnames import strays
from ..spec.config import ModelConfig
from ..spec.layouts import EXPERT_TENSORS, expert_layout
from ..spec.manifest import (COMPLETE_NAME, FORMAT_VERSION, MANIFEST_NAME, STATE_DIR, Options, complete_problem,
                             conversion_id, file_metadata, read_manifest_bytes)
from ..spec.manifest_types import Manifest, TensorRecord
from ..spec.plan import Plan, make_plan
from ..spec.rules import TensorSpec, build_specs
from ..spec.share import SHARE_NAME, read_share, share_repair
from ..spec.stheader import HeaderError
from .rankfile import RankFile
from .report import REPAIR, Problem, Report

logger = logging.getLogger("lucifer_shard.structure")  # -v: a line per rank file, -vv: per tensor


# ---------------------------------------------------------------- manifest vs the rule table


def expected_entries(cfg: ModelConfig, options: Options) -> tuple[Plan, dict[str, list[list[TensorSpec]]],
                                                                   dict[str, list[dict[str, TensorRecord]]]]:
    """What the manifest must say, from the rule table: the plan, the specs and {role: [{name: record}]}."""
    plan = make_plan(cfg, options.tp, options.moe_backend)
    roles = ["target"] + (["draft"] if options.mtp and cfg.num_mtp else [])
    layouts = {t: expert_layout(options.arch, options.expert_layout, options.flashinfer_layout, t)
               for t in EXPERT_TENSORS}
    entries: dict = {}
    specs: dict = {}
    for role in roles:
        specs[role] = build_specs(cfg, plan, role)
        ranks = []
        for rank_specs in specs[role]:
            tensors = {}
            for s in rank_specs:
                if s.expert_tensor:
                    lay = layouts[s.expert_tensor]
                    shape, layout = (s.experts, *lay.kernel_shape(s.matrix_shape)), lay.name
                else:
                    shape, layout = s.shape, "model"
                tensors[s.name] = TensorRecord.planned(s, shape, layout)
            ranks.append(tensors)
        entries[role] = ranks
    return plan, specs, entries


def check_manifest_rules(report: Report, manifest: Manifest, cfg: ModelConfig) -> dict | None:
    """The manifest's plan and tensor entries against the rule table; returns the expected entries."""
    options = manifest.options
    try:
        plan, specs, want = expected_entries(cfg, options)
    except (LuciferError, ValueError) as e:
        report.add(Problem("manifest", f"cannot rebuild the plan from config.json and the recorded options: {e}"))
        return None
    if manifest.tp_size != options.tp:
        report.add(Problem("manifest", f"tp_size {manifest.tp_size} != options.tp {options.tp}"))
    if manifest.arch != options.arch:
        report.add(Problem("manifest", f"arch {manifest.arch!r} != options.arch {options.arch!r}"))
    if manifest.plan.to_dict() != plan.to_dict():
        report.add(Problem("manifest", "the recorded plan is not the virtual-TP plan of config.json at this TP size; "
                                       "re-run convert"))
    roles = manifest.roles
    for role in sorted(set(roles) | set(want)):
        if role not in want:
            report.add(Problem("manifest", f"unexpected role {role!r} for these options", role))
            continue
        if role not in roles:
            report.add(Problem("manifest", f"role {role!r} is missing", role))
            continue
        got_ranks = roles[role]
        if len(got_ranks) != options.tp:
            report.add(Problem("manifest", f"{len(got_ranks)} ranks recorded, TP is {options.tp}", role))
        for rank, want_t in enumerate(want[role]):
            entry = manifest.rank(role, rank)
            if entry is None:
                break
            got_t = entry.tensors
            for name in sorted(set(got_t) - set(want_t)):
                report.add(Problem("manifest", "tensor not produced by the rule table", role, rank, name))
            for name in sorted(set(want_t) - set(got_t)):
                report.add(Problem("manifest", "tensor missing from the manifest", role, rank, name))
            for name in sorted(set(want_t) & set(got_t)):
                got, wanted = got_t[name].to_dict(), want_t[name].to_dict()
                for k in TensorRecord.PLANNED:
                    if got[k] != wanted[k]:
                        report.add(Problem("manifest", f"entry field {k!r} is {got[k]!r}, the rule "
                                           f"table gives {wanted[k]!r}; the manifest was edited or written by another "
                                           f"plan", role, rank, name, got_t[name].file))
    return {"entries": want, "specs": specs, "options": options}


# ---------------------------------------------------------------- shared structural checks


def read_manifest(report: Report, out: Path) -> tuple[Manifest, list[int] | None]:
    """The manifest (a self-digest failure is a finding, not a stop), and the ranks OUT holds when it is
    a node's share (`read_share_of`), else None; OutputError if it cannot be read."""
    if not (out / MANIFEST_NAME).exists() and (out / STATE_DIR).is_dir():
        raise OutputError(f"{out} holds an unfinished conversion (no {MANIFEST_NAME}, no {COMPLETE_NAME}); "
                          f"run the same convert command with --resume")
    manifest = Manifest.parse(read_manifest_bytes(out), out / MANIFEST_NAME)
    if Tree(out).lstat(SHARE_NAME) is not None:
        report.repair = share_repair(out)  # before any finding: stage's share is staged again, a node's convert resumed
    if not manifest.sealed:
        report.add(Problem("manifest", f"{out / MANIFEST_NAME}: manifest_digest does not match its content: the "
                           f"manifest was edited after conversion; {report.repair}", file=MANIFEST_NAME))
    problem = complete_problem(out, manifest.conversion_id)
    if problem:
        report.add(Problem("manifest", problem, file=COMPLETE_NAME))
    _check_identity(report, manifest)
    return manifest, read_share_of(report, out, manifest)


def _check_identity(report: Report, manifest: Manifest) -> None:
    """The conversion id follows from the recorded source fingerprint and options (for this tool's version)."""
    if manifest.tool_version == __version__ and manifest.format_version == FORMAT_VERSION:
        if conversion_id(manifest.source.fingerprint, manifest.options) != manifest.conversion_id:
            report.add(Problem("manifest", "conversion_id does not follow from the recorded source fingerprint and "
                               "options: the manifest was edited", file=MANIFEST_NAME))


def manifest_findings(manifest: Manifest, cfg: ModelConfig | None) -> list[str]:
    """What verify's structure finds in a manifest before its output's files are read (fetch): a conversion
    id that does not follow from it and, given the output's config.json, entries the rule table does not give."""
    report = Report("fetch")
    _check_identity(report, manifest)
    if cfg is not None:
        check_manifest_rules(report, manifest, cfg)
    return [p.line() for p in report.problems]


def read_share_of(report: Report, out: Path, manifest: Manifest) -> list[int] | None:
    """The TP ranks OUT holds when it is a node's share (spec/share.py), so that exactly those are
    checked (`Manifest.files`) and every fix says to stage it again; None for a whole output. A share
    record that is not valid, or not this output's, is a finding (none of its ranks counts)."""
    try:
        share = read_share(out, manifest.conversion_id, manifest.tp_size)
    except (OutputError, Refused) as e:
        report.add(Problem("manifest", str(e), file=SHARE_NAME))
        return []
    if share is None:
        return None
    report.info["share"] = share
    return share["ranks"]


def check_strays(report: Report, out: Path, manifest: Manifest, held: list[int] | None) -> None:
    """Entries of the role and rank folders the manifest does not list (`outnames`: the rule convert
    --resume and stage apply too); of a share, every file of a rank it does not hold is one."""
    listed = [f.path for _, _, f in manifest.files(held)]
    for s in strays(Tree(out), listed, manifest.roles, manifest.tp_size):
        report.add(Problem("file", s.line, s.role if s.rank is not None else None, s.rank, file=s.rel))


def open_files(report: Report, out: Path, manifest: Manifest, held: list[int] | None,
               check_size: bool = True) -> dict[str, RankFile]:
    """Open every listed rank file and check identity, header (and size) against the manifest.

    `diff` leaves the recorded size to `verify`: a file rewritten by another writer with the same
    tensors has another header size but the same content."""
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
            report.add(Problem("file", f"{e}; {report.repair if report.repair != REPAIR else 're-run convert --force'}",
                               role, rank, file=rel))
            continue
        except HeaderError as e:
            report.add(Problem("file", f"{rel}: unreadable safetensors header: {e.reason}; {report.repair}",
                               role, rank, file=rel))
            continue
        except OSError as e:  # the machine's fault (EIO, EACCES, EMFILE...), not a finding about OUT
            raise fault(OSError(e.errno, e.strerror, str(path)), command=report.command,
                        then=f"run {report.command} again") or e from None
        files[rel] = rf
        logger.info("%s rank %d %s: header of %d tensor(s), %d bytes", role, rank, rel, len(rf.tensors), rf.size)
        if check_size and rf.size != f.bytes:
            report.add(Problem("file", f"{rel}: {rf.size} bytes, the manifest records {f.bytes} "
                               f"({'truncated' if rf.size < f.bytes else 'grown'}); {report.repair}",
                               role, rank, file=rel))
        elif rf.trailing:  # diff: safetensors (and so vLLM) refuses a file with bytes after its data
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
            if rf.truncated(name):
                report.add(Problem("file", f"{rel} is truncated inside this tensor (it ends at byte {ht.end}, the "
                                   f"file has {rf.size}); {report.repair}", role, rank, name, rel))
        for name in sorted(set(rf.tensors) - set(names)):
            report.add(Problem("header", f"{rel} holds a tensor the manifest does not list there",
                               role, rank, name, rel))
    return files


def _part_of(rel: str) -> int | None:
    stem = Path(rel).name
    if stem.startswith("part-") and stem.endswith(".safetensors"):
        try:
            return int(stem[5:-12])
        except ValueError:
            return None
    return None


def _identity_hint(key: str, repair: str) -> str:
    if key == "lucifer.conversion_id":
        return f"this file comes from another conversion; {repair}"
    if key == "lucifer.content":
        return f"this file was made from other source weights (another checkpoint or revision); {repair}"
    if key in ("lucifer.rank", "lucifer.role", "lucifer.part"):
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
