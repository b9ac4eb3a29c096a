"""The structure of an output, checked by `diff` and `verify` alike: the manifest (self-digest,
COMPLETE, conversion id) and its entries against the rule table; every listed rank file present,
with its identity stamp, header and size as the manifest records them."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from .. import __version__
from ..errors import LuciferError, OutputError, fault
from ..guarded_io import Refused, Tree
from ..outnames import strays
from ..spec.config import ModelConfig
from ..spec.layouts import EXPERT_TENSORS, expert_layout
from ..spec.manifest import (COMPLETE_NAME, FORMAT_VERSION, MANIFEST_NAME, STATE_DIR, Options, complete_problem,
                             conversion_id, digest_ok, file_metadata, parse_manifest, read_manifest_bytes)
from ..spec.plan import make_plan
from ..spec.rules import TensorSpec, build_specs
from ..spec.share import SHARE_NAME, SHARE_REPAIR, read_share
from ..spec.stheader import HeaderError
from .rankfile import RankFile
from .report import REPAIR, Problem, Report

logger = logging.getLogger("lucifer_shard.structure")  # -v: a line per rank file, -vv: per tensor


# ---------------------------------------------------------------- manifest vs the rule table


def options_of(manifest: dict) -> Options:
    o = manifest.get("options") or {}
    try:
        return Options(**o)
    except TypeError as e:
        raise ValueError(f"manifest options {o!r} are not this tool's ({e})") from None


def expected_entries(cfg: ModelConfig, options: Options) -> tuple[dict, dict[str, list[list[TensorSpec]]]]:
    """What the manifest's tensor entries must say, from the rule table: {role: [{name: entry}]}, specs."""
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
                    shape, layout = [s.experts, *lay.kernel_shape(s.matrix_shape)], lay.name
                else:
                    shape, layout = list(s.shape), "model"
                tensors[s.name] = {
                    "dtype": s.dtype, "shape": shape, "model_shape": list(s.shape), "layout": layout,
                    "experts": s.experts, "source_dtype": s.src_dtype,
                    "sources": [{"key": p.source, "dim": p.dim, "src_start": p.src_start, "dst_start": p.dst_start,
                                 "length": p.length, "seg_len": p.seg_len} for p in s.pieces],
                    "zero_regions": [[p.dim, *p.tail] for p in s.pieces if p.tail[1] > p.tail[0]],
                    "pad": "-inf" if s.pad != b"\x00" else "zero",
                }
            ranks.append(tensors)
        entries[role] = ranks
    return {"plan": plan.to_dict(), "roles": entries}, specs


def check_manifest_rules(report: Report, manifest: dict, cfg: ModelConfig) -> dict | None:
    """The manifest's plan and tensor entries against the rule table; returns the expected entries."""
    try:
        options = options_of(manifest)
        want, specs = expected_entries(cfg, options)
    except (LuciferError, ValueError) as e:
        report.add(Problem("manifest", f"cannot rebuild the plan from config.json and the recorded options: {e}"))
        return None
    if manifest.get("tp_size") != options.tp:
        report.add(Problem("manifest", f"tp_size {manifest.get('tp_size')} != options.tp {options.tp}"))
    if manifest.get("arch") != options.arch:
        report.add(Problem("manifest", f"arch {manifest.get('arch')!r} != options.arch {options.arch!r}"))
    if _norm(manifest.get("plan")) != _norm(want["plan"]):
        report.add(Problem("manifest", "the recorded plan is not the virtual-TP plan of config.json at this TP size; "
                                       "re-run convert"))
    roles = manifest.get("roles") or {}
    for role in sorted(set(roles) | set(want["roles"])):
        if role not in want["roles"]:
            report.add(Problem("manifest", f"unexpected role {role!r} for these options", role))
            continue
        if role not in roles:
            report.add(Problem("manifest", f"role {role!r} is missing", role))
            continue
        got_ranks = roles[role].get("ranks") or []
        if len(got_ranks) != options.tp:
            report.add(Problem("manifest", f"{len(got_ranks)} ranks recorded, TP is {options.tp}", role))
        for rank, want_t in enumerate(want["roles"][role]):
            if rank >= len(got_ranks):
                break
            got_t = got_ranks[rank].get("tensors") or {}
            if got_ranks[rank].get("rank") != rank:
                report.add(Problem("manifest", f"rank entry {rank} says rank {got_ranks[rank].get('rank')}",
                                   role, rank))
            for name in sorted(set(got_t) - set(want_t)):
                report.add(Problem("manifest", "tensor not produced by the rule table", role, rank, name))
            for name in sorted(set(want_t) - set(got_t)):
                report.add(Problem("manifest", "tensor missing from the manifest", role, rank, name))
            for name in sorted(set(want_t) & set(got_t)):
                for k, v in want_t[name].items():
                    if _norm(got_t[name].get(k)) != _norm(v):
                        report.add(Problem("manifest", f"entry field {k!r} is {got_t[name].get(k)!r}, the rule "
                                           f"table gives {v!r}; the manifest was edited or written by another "
                                           f"plan", role, rank, name, got_t[name].get("file")))
    return {"entries": want, "specs": specs, "options": options}


def _norm(x):
    return json.loads(json.dumps(x, sort_keys=True)) if x is not None else None


# ---------------------------------------------------------------- shared structural checks


def read_manifest(report: Report, out: Path) -> dict:
    """The manifest (a self-digest failure is a finding, not a stop); OutputError if it cannot be read."""
    if not (out / MANIFEST_NAME).exists() and (out / STATE_DIR).is_dir():
        raise OutputError(f"{out} holds an unfinished conversion (no {MANIFEST_NAME}, no {COMPLETE_NAME}); "
                          f"run the same convert command with --resume")
    manifest = parse_manifest(read_manifest_bytes(out), out / MANIFEST_NAME)
    if Tree(out).lstat(SHARE_NAME) is not None:
        report.repair = SHARE_REPAIR  # before any finding: a share is never repaired by convert
    if not digest_ok(manifest):
        report.add(Problem("manifest", f"{out / MANIFEST_NAME}: manifest_digest does not match its content: the "
                           f"manifest was edited after conversion; {report.repair}", file=MANIFEST_NAME))
    problem = complete_problem(out, manifest["conversion_id"])
    if problem:
        report.add(Problem("manifest", problem, file=COMPLETE_NAME))
    if manifest.get("tool_version") == __version__ and manifest.get("format_version") == FORMAT_VERSION:
        try:
            cid = conversion_id(manifest["source"]["fingerprint"], options_of(manifest))
        except (KeyError, TypeError, ValueError):
            cid = None
        if cid != manifest.get("conversion_id"):
            report.add(Problem("manifest", "conversion_id does not follow from the recorded source fingerprint and "
                               "options: the manifest was edited", file=MANIFEST_NAME))
    return read_share_of(report, out, manifest)


def read_share_of(report: Report, out: Path, manifest: dict) -> dict:
    """The manifest as a reader of OUT sees it: on a node's share (spec/share.py), with the ranks it
    holds, so that exactly those are checked (`manifest_files`) and every fix says to stage it again.
    A share record that is not valid, or not this output's, is a finding (none of its ranks counts)."""
    try:
        share = read_share(out, manifest.get("conversion_id"), manifest.get("tp_size"))
    except (OutputError, Refused) as e:
        report.add(Problem("manifest", str(e), file=SHARE_NAME))
        return {**manifest, SHARE_KEY: []}
    if share is None:
        return manifest
    report.info["share"] = share
    return {**manifest, SHARE_KEY: share["ranks"]}


# Set by read_manifest on a node's share (spec/share.py): the TP ranks it holds.
SHARE_KEY = "lucifer.share_ranks"


def manifest_files(manifest: dict) -> list[tuple[str, int, dict]]:
    """(role, rank, file entry) for every file the manifest lists (of a share: of the ranks it holds)."""
    out = []
    held = manifest.get(SHARE_KEY)
    for role, doc in (manifest.get("roles") or {}).items():
        for rank, entry in enumerate(doc.get("ranks") or []):
            if held is not None and rank not in held:
                continue
            for f in entry.get("files") or []:
                out.append((role, rank, f))
    return out


def check_strays(report: Report, out: Path, manifest: dict) -> None:
    """Entries of the role and rank folders the manifest does not list (`outnames`: the rule convert
    --resume and stage apply too); of a share, every file of a rank it does not hold is one."""
    listed = [f.get("path") for _, _, f in manifest_files(manifest)]
    for s in strays(Tree(out), [p for p in listed if isinstance(p, str)], manifest.get("roles") or {},
                    manifest.get("tp_size") or 0):
        report.add(Problem("file", s.line, s.role if s.rank is not None else None, s.rank, file=s.rel))


def open_files(report: Report, out: Path, manifest: dict, check_size: bool = True) -> dict[str, RankFile]:
    """Open every listed rank file and check identity, header (and size) against the manifest.

    `diff` leaves the recorded size to `verify`: a file rewritten by another writer with the same
    tensors has another header size but the same content."""
    files: dict[str, RankFile] = {}
    tp = manifest.get("tp_size")
    cid = manifest.get("conversion_id")
    tree = Tree(out)
    for role, rank, f in manifest_files(manifest):
        rel = f.get("path", "")
        path = out / rel
        held = sorted(n for n, t in manifest["roles"][role]["ranks"][rank]["tensors"].items() if t.get("file") == rel)
        holds = f"holds {len(held)} tensor(s): {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
        try:
            rf = RankFile(tree, rel)
        except FileNotFoundError:
            folder = path.parent
            what = f"rank folder {folder.relative_to(out)} is missing" if not folder.is_dir() else "file is missing"
            report.add(Problem("file", f"{rel}: {what} ({holds}); {report.repair}", role, rank,
                               held[0] if held else None, rel))
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
        if check_size and rf.size != f.get("bytes"):
            report.add(Problem("file", f"{rel}: {rf.size} bytes, the manifest records {f.get('bytes')} "
                               f"({'truncated' if rf.size < (f.get('bytes') or 0) else 'grown'}); {report.repair}",
                               role, rank, file=rel))
        elif rf.trailing:  # diff: safetensors (and so vLLM) refuses a file with bytes after its data
            report.add(Problem("file", f"{rel}: {rf.trailing} bytes follow the last tensor; safetensors "
                               f"refuses such a file; {report.repair}", role, rank, file=rel))
        want_meta = file_metadata(cid, role, rank, _part_of(rel), tp, f["content"]) if _part_of(rel) is not None \
            else None
        if want_meta is not None:
            for k, v in want_meta.items():
                if rf.meta.get(k) != v:
                    report.add(Problem("file", f"{rel}: __metadata__ {k} is {rf.meta.get(k)!r}, expected {v!r}: "
                                       f"{_identity_hint(k, report.repair)}", role, rank, file=rel))
        for name in held:
            info = manifest["roles"][role]["ranks"][rank]["tensors"][name]
            ht = rf.tensors.get(name)
            logger.debug("%s %s: header %s, manifest %s%s", rel, name, ht and f"{ht.dtype}{list(ht.shape)}",
                         info.get("dtype"), info.get("shape"))
            if ht is None:
                report.add(Problem("header", f"not in {rel}, where the manifest puts it", role, rank, name, rel))
                continue
            if ht.dtype != info.get("dtype") or list(ht.shape) != list(info.get("shape") or []):
                report.add(Problem("header", f"{rel} stores {ht.dtype}{list(ht.shape)}, the manifest says "
                                   f"{info.get('dtype')}{info.get('shape')}", role, rank, name, rel))
            if rf.truncated(name):
                report.add(Problem("file", f"{rel} is truncated inside this tensor (it ends at byte {ht.end}, the "
                                   f"file has {rf.size}); {report.repair}", role, rank, name, rel))
        for name in sorted(set(rf.tensors) - set(held)):
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


def usable(rf: RankFile | None, name: str, info: dict) -> bool:
    """Whether a tensor can be read and interpreted as the manifest describes it."""
    if rf is None:
        return False
    ht = rf.tensors.get(name)
    return (ht is not None and not rf.truncated(name) and ht.dtype == info.get("dtype")
            and list(ht.shape) == list(info.get("shape") or []))


def is_replicated(manifest: dict, role: str, name: str) -> bool:
    ranks = manifest["roles"][role]["ranks"]
    first = ranks[0]["tensors"][name].get("sources")
    for r in ranks:
        t = r["tensors"].get(name)
        if t is None or t.get("sources") != first:
            return False
        if any(p["src_start"] != 0 or p["length"] != p["seg_len"] for p in t["sources"]):
            return False
    return True
