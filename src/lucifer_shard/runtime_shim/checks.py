"""The doctor's and serve's check record and its report: a check's status, what it is about (OUT or
this environment), its fix, and whether a failure finds OUT damaged (kind mismatch)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

OK, WARN, FAIL, INFO, SKIP = "ok", "warn", "FAIL", "info", "skip"
# What a check is about: OUT (its files, wherever they are checked) or this environment (vLLM, the
# plugin, the GPU: meaningful only on the serving host). Output checks come first in every report.
OUTPUT, ENVIRONMENT = "output", "environment"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok / warn / FAIL / info / skip
    detail: str
    fix: str = ""
    scope: str = ENVIRONMENT  # OUTPUT or ENVIRONMENT
    verbose: bool = False  # shown only with -v (a fact about other builds, not this one)
    damage: bool = False  # a failure that finds OUT damaged or edited: kind mismatch, as every reader of OUT
    blocks: bool = False  # a warning that keeps lucifer_tp3 from serving on this host (no GPU): the summary says so

    def __str__(self) -> str:
        s = f"[{self.status:>4}] {self.name}: {self.detail}"
        return s + (f" -> {self.fix}" if self.fix else "")

    def to_dict(self) -> dict:
        return asdict(self)


def out_check(name: str, status: str, detail: str, fix: str = "", damage: bool = False) -> Check:
    """A check about OUT."""
    return Check(name, status, detail, fix, OUTPUT, damage=damage)


def format_report(checks: list[Check], verbose: bool = True) -> str:
    """The checks, one line each (those marked verbose only when `verbose`), and a summary worded for
    what was checked: skipped checks (no vLLM here) are neither passed nor failed."""
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    skips = sum(c.status == SKIP for c in checks)
    skipped = f"; {skips} environment check(s) skipped (no vLLM here)" if skips else ""
    if fails:
        tail = f"{fails} check(s) failed{skipped}: lucifer_tp3 serving will not work " + ("from OUT" if skips else "here")
    elif skips:
        tail = f"OUT's checks passed{skipped}: run lucifer-shard doctor OUT on the serving host"
    elif blocked := [c for c in checks if c.blocks and c.status == WARN]:
        tail = (f"no check failed, but lucifer_tp3 cannot serve on this host: {blocked[0].name}: {blocked[0].detail}; "
                f"the other checks hold for this environment on a host that has it")
    else:
        tail = "lucifer_tp3 serving can work here" + (f" ({warns} warning(s))" if warns else "")
    return "\n".join(str(c) for c in checks if verbose or not c.verbose) + "\n" + tail
