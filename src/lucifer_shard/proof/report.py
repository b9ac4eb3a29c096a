"""The problem report of `diff` and `verify`: findings (the first few in full, all counted per tensor)
and the run's numbers, rendered as text lines or JSON."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..output.manifest import REPAIR  # noqa: F401  (the report's fix of a whole output; output/output_check's too)

SHOW_TENSORS = 20  # tensors listed in the human report


@dataclass
class Problem:
    """One finding. `kind`: manifest, file, header, structure, coverage, source, data, pad, scale, replica."""

    kind: str
    message: str
    role: str | None = None
    rank: int | None = None
    tensor: str | None = None
    file: str | None = None
    detail: dict = field(default_factory=dict)

    def where(self) -> str:
        parts = [p for p in (self.role, f"rank {self.rank}" if self.rank is not None else None, _shown(self.tensor)) if p]
        return " ".join(parts)

    def line(self) -> str:
        where = self.where()
        return f"{self.kind.upper():<9} {where + ': ' if where else ''}{self.message}"

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "message": self.message, "role": self.role, "rank": self.rank,
             "tensor": self.tensor, "file": self.file}
        d.update(self.detail)
        return d


@dataclass
class Report:
    """Findings (the first `limit` in full, all counted) and the run's numbers."""

    command: str
    limit: int = 10
    problems: list[Problem] = field(default_factory=list)
    count: int = 0
    by_tensor: dict[str, int] = field(default_factory=dict)  # "role rank-r name" (or file) -> bad bytes/items
    stats: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    lead: int = 0  # problems listed first (add_first)
    repair: str = REPAIR  # the fix its findings name (a node's share: stage it again, output/share.py)
    # rank files already reported whole (a wrong size): one finding a file, not one per tensor it holds
    reported_files: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.count == 0

    @property
    def room(self) -> int:
        return max(0, self.limit - len(self.problems))

    def add(self, problem: Problem, weight: int = 1) -> None:
        self.count += 1
        if len(self.problems) < self.limit:
            self.problems.append(problem)
        key = _tensor_key(problem)
        self.by_tensor[key] = self.by_tensor.get(key, 0) + weight

    def concerns(self, role: str, rank: int, file: str, tensors: list[str]) -> bool:
        """Whether a finding (listed in full or only counted) names the rank file `file` or a tensor it holds."""
        keys = [_tensor_key(Problem("file", "", role, rank, name, file)) for name in tensors]
        return file in self.reported_files or any(k in self.by_tensor for k in (file, *keys))

    def add_first(self, problem: Problem) -> None:
        """A finding that explains the others (the source is not the one converted): listed before them,
        in the order found."""
        self.add(problem)
        if self.problems and self.problems[-1] is problem:
            self.problems.pop()
        self.problems.insert(self.lead, problem)
        self.lead += 1
        del self.problems[self.limit:]

    def add_many(self, problems: list[Problem], total: int, key_of: Problem) -> None:
        """`total` findings of one kind in one tensor, of which `problems` are the first few, in full."""
        self.count += total
        self.problems.extend(problems[: self.room])
        key = _tensor_key(key_of)
        self.by_tensor[key] = self.by_tensor.get(key, 0) + total

    def merge(self, other: "Report") -> None:
        """Append another report's findings (in order) and counts."""
        self.count += other.count
        self.problems.extend(other.problems[: self.room])
        for k, n in other.by_tensor.items():
            self.by_tensor[k] = self.by_tensor.get(k, 0) + n

    def outcome_lines(self, ok_text: str, noun: str) -> list[str]:
        """The closing lines of a text report: the OK sentence, or every problem and the count."""
        if self.ok:
            return [f"OK: {ok_text}"]
        return [*self.problem_lines(), f"FAILED: {self.count} {noun}"]

    def to_dict(self) -> dict:
        info = {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in self.info.items()}  # a share: its record
        return {"command": self.command, "ok": self.ok, "problem_count": self.count, **info,
                "summary": self.stats, "problems": [p.to_dict() for p in self.problems],
                "tensors_with_problems": dict(sorted(self.by_tensor.items()))}

    def problem_lines(self) -> list[str]:
        lines = []
        for p in self.problems:
            lines.append(p.line())
            d = p.detail
            where = []
            if "tensor_index" in d:
                where.append(f"at {p.tensor}{fmt_index(d['tensor_index'])}")
            if "file_offset" in d:
                where.append(f"{p.file} byte offset {', '.join(str(o) for o in d['file_offset'])}")
            if where:
                lines.append("          " + ", ".join(where))
        if self.count > len(self.problems):
            lines.append(f"... and {self.count - len(self.problems)} more finding(s) (raise --max-mismatches "
                         f"or use --json)")
        if self.by_tensor:
            lines.append(f"tensors with problems ({len(self.by_tensor)}):")
            for k, n in sorted(self.by_tensor.items())[:SHOW_TENSORS]:
                lines.append(f"  {k}  ({n})")
            if len(self.by_tensor) > SHOW_TENSORS:
                lines.append(f"  ... and {len(self.by_tensor) - SHOW_TENSORS} more")
        return lines

    def first(self) -> str:
        if not self.problems:
            return ""
        p = self.problems[0]
        where = p.where()
        return f"{where + ': ' if where else ''}{p.message}"


def _shown(name: str | None) -> str | None:
    """A tensor name for a report line: names read from a damaged header may hold control characters."""
    return name if name is None or name.isprintable() else repr(name)


def _tensor_key(p: Problem) -> str:
    if p.tensor:
        return " ".join(x for x in (p.role, f"rank-{p.rank}" if p.rank is not None else None, _shown(p.tensor)) if x)
    return p.file or p.kind


def fmt_index(index) -> str:
    return "" if index is None else "[" + ", ".join(str(i) for i in index) + "]"


def hexbytes(b: np.ndarray | bytes) -> str:
    return "0x" + bytes(b).hex()
