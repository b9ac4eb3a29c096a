"""The one check of an output that every reader runs before it trusts the manifest: verify and diff
(as findings of their report), inspect, check-numerics, stage, and the runtime shim's serve, doctor and
loader (as one refusal), so that no command accepts what another refuses.

It checks everything that follows from the manifest, OUT/config.json and the files' sizes, hashing no
rank-file byte: the self-digest, COMPLETE and the conversion id; every role's every rank entry against
the TP size; the plan and every tensor entry against the rule table; the fields derived from the
options (layouts, MoE variant, runtime record), from config.json (the draft record, runtime_owned)
and from the per-shard digests (the source content digest); the dropped source tensors; every held
rank file's size; the config and tokenizer copies. The self-digest is public (`manifest.seal`): what a
re-sealed edit can still change is only what no reader derives (docs/evidence/reliability.md, threat model).
A node's share (lucifer-share.json) is checked on disk for its own ranks only, but every rank's
entry must be in the manifest.
"""
from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import FETCH_SHARE, STAGE_AGAIN, VERIFY, LuciferError, MismatchError, OutputError
from ..guarded_io import Refused, Tree
from ..model.arches import GENERATION_ARCHES, MOE_VARIANT
from ..model.config import ModelConfig, load_config
from ..model.drafts import draft_record
from ..model.layouts import LAYOUT_VERSION, tensor_layouts
from ..model.options import Options
from ..model.plan import Plan, make_plan
from ..model.runtimes import runtime_record
from ..model.tensorspecs import TensorSpec, build_specs
from ..outnames import MANIFEST_NAME
from ..source.content import ALGORITHM, BLOCK, checkpoint_digest
from .manifest import (COMPLETE_NAME, FORMAT_VERSION, RECORD_REL, REPAIR, complete_problem, conversion_id,
                       read_manifest_bytes)
from .manifest_types import copy_problems, Draft, LayoutRecord, Manifest, TensorRecord
from .share import SHARE_NAME, read_share, share_repair

EDITED = "the manifest was edited or written by another plan"


@dataclass(frozen=True)
class Finding:
    """One thing wrong with an output (the fields of proof/report.Problem; `kind` "manifest" or "file")."""

    kind: str
    message: str
    role: str | None = None
    rank: int | None = None
    tensor: str | None = None
    file: str | None = None


@dataclass(frozen=True)
class Expected:
    """What the manifest must say, from the rule table: the plan, the specs and {role: [{name: record}]}."""

    plan: Plan
    specs: dict[str, list[list[TensorSpec]]]
    entries: dict[str, list[dict[str, TensorRecord]]]


@dataclass
class OutputCheck:
    """An output's manifest and what `check_output` found: the ranks a share holds (None: the whole
    output), the share record, the fix every finding names, and the rule table's entries (None when
    config.json or the options give none)."""

    out: Path
    manifest: Manifest
    held: list[int] | None = None
    share: dict | None = None
    repair: str = REPAIR
    findings: list[Finding] = field(default_factory=list)
    expected: Expected | None = None

    def add(self, kind: str, message: str, role: str | None = None, rank: int | None = None,
            tensor: str | None = None, file: str | None = None, fix: bool = True) -> None:
        """A finding; `fix`: add the repair (False: the message names its own)."""
        self.findings.append(Finding(kind, f"{message}; {self.repair}" if fix else message, role, rank, tensor, file))

    def refuse(self) -> Manifest:
        """The manifest when nothing was found, else MismatchError: one line, the first finding and the count."""
        if not self.findings:
            return self.manifest
        f = self.findings[0]
        where = " ".join(p for p in (f.role, f"rank {f.rank}" if f.rank is not None else None,
                                     f.tensor and f"tensor {f.tensor[:80]}") if p)
        raise MismatchError(f"{self.out}: {where + ': ' if where else ''}{f.message} ({len(self.findings)} "
                            f"finding(s))", remedy=VERIFY.at(out=str(self.out)))


def check_output(out: Path, manifest: Manifest | None = None, seal: bool = True,
                 finishing: bool = False) -> OutputCheck:
    """OUT's manifest (read here unless given) and every finding of the module docstring's checks;
    OutputError when OUT holds no readable manifest. `seal=False`: the self-digest is not asked for
    (the loader's verify=none). `finishing`: a writer's own check just before it writes COMPLETE (fetch),
    so COMPLETE is not asked for yet."""
    out = Path(out)
    m = manifest if manifest is not None else Manifest.parse(read_manifest_bytes(out), out / MANIFEST_NAME)
    check = OutputCheck(out, m)
    _share(check)  # first: a share's findings name its own fix
    if seal and not m.sealed:
        check.add("manifest", f"{out / MANIFEST_NAME}: manifest_digest does not match its content: the manifest was "
                  f"edited after conversion", file=MANIFEST_NAME)
    problem = None if finishing else complete_problem(out, m.conversion_id)
    if problem:
        check.add("manifest", problem, file=COMPLETE_NAME, fix=False)
    cfg = None
    try:
        cfg = load_config(out / "config.json", follow=False)
    except LuciferError as e:
        check.add("manifest", f"{e}; cannot check the manifest against the rule table", file="config.json")
    check_manifest(check, cfg)
    _sizes(check)
    for name, problem in copy_problems(out, m, None if check.repair == REPAIR else check.repair):
        check.add("file", problem, file=name, fix=False)
    return check


def check_manifest(check: OutputCheck, cfg: ModelConfig | None) -> None:
    """The findings that need only the manifest and config.json (`cfg`; None: unreadable, a finding
    already), none of OUT's files: the conversion id, the rule table's plan and entries, and every field
    derived from the options, config.json or the per-shard digests. A reader that has no files yet (a
    fetch, before it downloads any) runs this part alone."""
    m = check.manifest
    if m.tool_version == __version__ and m.format_version == FORMAT_VERSION and \
            conversion_id(m.source.fingerprint, m.options) != m.conversion_id:
        check.add("manifest", "conversion_id does not follow from the recorded source fingerprint and options: the "
                  "manifest was edited", file=MANIFEST_NAME)
    c = m.source.content
    if c.stamps is not None and c.stamps != m.content_identity:
        check.add("manifest", f"source.content.stamps {c.stamps[:23]}... is not the digest of the rank files' content "
                              f"stamps ({m.content_identity[:23]}...): the content record claims other weights than "
                              f"the rank files hold; {EDITED}", file=MANIFEST_NAME)
    if cfg is not None:
        check.expected = _rules(check, cfg)
        _from_config(check, cfg)
    _from_options(check)


def _share(check: OutputCheck) -> None:
    """The ranks OUT holds when it is a node's share; a share record that is not valid, or not this
    output's, is a finding (none of its ranks counts)."""
    m = check.manifest
    if Tree(check.out).lstat(SHARE_NAME) is not None:
        check.repair = share_repair(check.out)  # stage's share is staged again, a node's convert resumed
    try:
        check.share = read_share(check.out, m.conversion_id, m.tp_size)
    except (OutputError, Refused) as e:
        check.add("manifest", str(e), file=SHARE_NAME, fix=False)
        check.held = []
        return
    check.held = list(check.share.ranks) if check.share is not None else None
    if check.share is None and not _recorded(check.out):
        check.repair = copy_repair(check.out, m)


def _recorded(out: Path) -> bool:
    """Whether OUT keeps a conversion record (convert wrote it here; a .lucifer/ that is a link counts, refused
    by the commands that read it)."""
    try:
        return Tree(out).lstat(RECORD_REL) is not None
    except (Refused, NotADirectoryError):
        return True


# A whole output without its conversion record (.lucifer/, left behind as the README says): a copy on a
# serving host, repaired by copying again from where it came (the output, or its published repo).
COPY_REPAIR = ("copy the damaged files again from the output they were copied from (for a published one, "
               f"{FETCH_SHARE.at(ranks='').command.rstrip()} into a new folder)")


def copy_repair(out: Path, m: Manifest) -> str:
    """The fix for a copy of an output (no conversion record): a node's share that lost its lucifer-share.json
    (some ranks' folders there, the others absent) is copied or staged again, anything else copied again."""
    tree = Tree(out)

    def there(rel: str) -> bool:
        try:
            return tree.lstat(str(Path(rel).parent)) is not None
        except (Refused, NotADirectoryError):
            return True  # not absent: the file readers name what is wrong with it

    present = sorted({rank for _, rank, f in m.files(None) if there(f.path)})
    if not present or len(present) == m.tp_size:
        return COPY_REPAIR
    ranks = ",".join(map(str, present))
    return (f"OUT holds rank(s) {ranks} of tp {m.tp_size} only, as a node's share does, but no {SHARE_NAME}: copy "
            f"{SHARE_NAME} from the share it came from, or stage or fetch that node's share again "
            f"({STAGE_AGAIN.at(ranks=f'--ranks {ranks}').command}; {FETCH_SHARE.at(ranks=f'--ranks {ranks}').command}); "
            f"convert --resume would write every rank's files here")


def expected_entries(cfg: ModelConfig, options: Options) -> Expected:
    """What the manifest must say for `cfg` and `options`, from the rule table."""
    plan = make_plan(cfg, options.tp, options.moe_backend)
    layouts = tensor_layouts(options)
    specs: dict = {}
    entries: dict = {}
    for role in ["target"] + (["draft"] if options.mtp and cfg.num_mtp else []):
        specs[role] = build_specs(cfg, plan, role)
        entries[role] = [{s.name: TensorRecord.planned(s, *_stored(s, layouts)) for s in rank_specs}
                         for rank_specs in specs[role]]
    return Expected(plan, specs, entries)


def _stored(s: TensorSpec, layouts: dict) -> tuple[tuple[int, ...], str]:
    """A planned tensor's stored shape and layout name."""
    if not s.expert_tensor:
        return s.shape, "model"
    lay = layouts[s.expert_tensor]
    return (s.experts, *lay.kernel_shape(s.matrix_shape)), lay.name


def _rules(check: OutputCheck, cfg: ModelConfig) -> Expected | None:
    """The plan, the roles, every role's every rank entry and each tensor entry against the rule table."""
    m, options = check.manifest, check.manifest.options
    try:
        want = expected_entries(cfg, options)
    except (LuciferError, ValueError) as e:
        check.add("manifest", f"cannot rebuild the plan from config.json and the recorded options: {e}")
        return None
    if m.tp_size != options.tp:
        check.add("manifest", f"tp_size {m.tp_size} != options.tp {options.tp}")
    if m.plan.to_dict() != want.plan.to_dict():
        check.add("manifest", "the recorded plan is not the virtual-TP plan of config.json at this TP size")
    for role in sorted(set(m.roles) | set(want.entries)):
        if role not in want.entries:
            check.add("manifest", f"unexpected role {role!r} for these options", role)
            continue
        if role not in m.roles:
            check.add("manifest", f"role {role!r} is missing", role)
            continue
        got_ranks = m.roles[role]
        if len(got_ranks) != options.tp:
            check.add("manifest", f"{len(got_ranks)} rank entr{'y' if len(got_ranks) == 1 else 'ies'} recorded, TP "
                                  f"is {options.tp}: {EDITED}", role)
        for entry, want_t in zip(got_ranks, want.entries[role]):
            _entry(check, role, entry.rank, entry.tensors, want_t)
    return want


def _entry(check: OutputCheck, role: str, rank: int, got_t: dict[str, TensorRecord],
           want_t: dict[str, TensorRecord]) -> None:
    for name in sorted(set(got_t) - set(want_t)):
        check.add("manifest", "tensor not produced by the rule table", role, rank, name)
    for name in sorted(set(want_t) - set(got_t)):
        check.add("manifest", "tensor missing from the manifest", role, rank, name)
    for name in sorted(set(want_t) & set(got_t)):
        got, wanted = got_t[name].to_dict(), want_t[name].to_dict()
        for k in TensorRecord.PLANNED:
            if got[k] != wanted[k]:
                check.add("manifest", f"entry field {k!r} is {got[k]!r}, the rule table gives {wanted[k]!r}; {EDITED}",
                          role, rank, name, got_t[name].file)


def recorded_fields(options: Options) -> dict:
    """The manifest's fields that follow from the options alone (Manifest's keyword arguments): what the
    writer records and every reader compares."""
    gen = options.arch in GENERATION_ARCHES and options.expert_layout == "kernel"
    return {"arch": options.arch,  # null: model layout converted without --arch, for any GPU family
            # null without arch, or on the b12x route: vLLM picks the variant for the GPU it runs on
            "moe_variant": None if options.moe_backend else MOE_VARIANT.get(options.arch),
            "expert_layout": options.expert_layout, "flashinfer_layout": options.flashinfer_layout if gen else None,
            "layouts": {t: LayoutRecord(lay.name, tuple(lay.steps), lay.version)
                        for t, lay in tensor_layouts(options).items()},
            "layout_version": LAYOUT_VERSION, "runtime": runtime_record(options)}


def _from_options(check: OutputCheck) -> None:
    """The fields derived from the options; the runtime record's `vllm_line` (prose naming this tool's
    vetted builds) only when this tool version wrote it."""
    m = check.manifest
    try:
        fields = recorded_fields(m.options)
    except ValueError as e:  # the layout table refuses the combination (kernel layout without an arch)
        check.add("manifest", f"the recorded options are not a combination convert writes: {e}; {EDITED}",
                  file=MANIFEST_NAME)
        return
    for key, want in fields.items():
        got = getattr(m, key)
        if key == "runtime" and m.tool_version != __version__:
            got, want = ({k: v for k, v in d.items() if k != "vllm_line"} for d in (got, want))
        if got != want:
            check.add("manifest", f"{key} is {str(got)[:120]}, the recorded options give {str(want)[:120]}; "
                                  f"{EDITED}", file=MANIFEST_NAME)


def _from_config(check: OutputCheck, cfg: ModelConfig) -> None:
    """The draft record and runtime_owned (from config.json), the content digest (from the per-shard
    digests) and the dropped tensors (none of them converted)."""
    m = check.manifest
    want = Draft(**draft_record(cfg)) if check.expected is not None and "draft" in check.expected.entries else None
    if check.expected is not None and m.draft != want:
        check.add("manifest", f"draft record {m.draft}, config.json gives {want}; {EDITED}", "draft",
                  file=MANIFEST_NAME)
    if m.runtime_owned is not None:  # vLLM's own parameters are the draft kind's (model/drafts), never recorded
        check.add("manifest", f"runtime_owned lists {len(m.runtime_owned)} tensor(s); convert records none (the draft "
                              f"kind's table says what vLLM owns); {EDITED}", file=MANIFEST_NAME)
    c = m.source.content
    if (c.algorithm, c.block_bytes, c.digest) != (ALGORITHM, BLOCK, checkpoint_digest(c.files)):
        check.add("manifest", f"source.content.digest {c.digest[:23]}... does not follow from its per-shard digests "
                              f"({ALGORITHM}, {BLOCK}-byte blocks); {EDITED}", file=MANIFEST_NAME)
    if check.expected is not None:
        converted = {p.source for specs in check.expected.specs.values() for rank_specs in specs for s in rank_specs
                     for p in s.pieces}
        for key in sorted(set(m.dropped) & converted):
            check.add("manifest", f"source tensor {key[:80]!r} is recorded as dropped, but the rule table converts "
                                  f"it; {EDITED}", file=MANIFEST_NAME)


def _sizes(check: OutputCheck) -> None:
    """Every rank file OUT holds (a share: of its ranks) at its recorded size; a missing one is left to
    the readers that open it (they name what it holds)."""
    tree = Tree(check.out)
    for role, rank, f in check.manifest.files(check.held):
        try:
            st = tree.lstat(f.path)
        except (Refused, NotADirectoryError):
            st = None  # a folder that is a link or a file: the file readers name it
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size != f.bytes:
            check.add("file", f"{f.path}: {st.st_size} bytes, the manifest records {f.bytes} "
                      f"({'truncated' if st.st_size < f.bytes else 'grown'})", role, rank, file=f.path)
