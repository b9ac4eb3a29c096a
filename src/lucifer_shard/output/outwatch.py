"""Whether a writer changed OUT while a reader (verify, diff, inspect, check-numerics, the vLLM loader)
was reading it.

The writer lock (`outlock`) tells a reader that a `convert` is running now; it cannot tell it that
a whole `convert --force` ran and finished between two looks, which leaves a reader holding a mix
of two outputs (verify once reported 87,100 "problems" on a valid output, the loader loaded the
other checkpoint's bytes). Every convert that changes an output replaces its manifest and its
COMPLETE (new files renamed into place) or deletes them first (`--force`), so a reader notes their
identity (device, inode, size, mtime and ctime, not following links) when it starts and compares
it when it ends: any difference, or the lock held at either end, means OUT was written meanwhile.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from ..outnames import MANIFEST_NAME
from .manifest import COMPLETE_NAME
from .outlock import writer_of

Identity = tuple[int, int, int, int, int] | None


def _identity(path: Path) -> Identity:
    try:
        st = os.lstat(path)
    except OSError:  # missing (or unreachable): a state of its own, compared like any other
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _state(out: Path) -> tuple[Identity, Identity]:
    return _identity(out / MANIFEST_NAME), _identity(out / COMPLETE_NAME)


@dataclass(frozen=True)
class ReadWatch:
    """Started before a reader's first look at OUT; `problem()` after its last."""

    out: Path
    seen: tuple[Identity, Identity]

    @classmethod
    def start(cls, out: Path) -> "ReadWatch":
        return cls(Path(out), _state(Path(out)))

    def problem(self, command: str) -> str | None:
        """Why what `command` read of OUT may be a mix of two outputs, or None."""
        holder = writer_of(self.out)
        if holder is not None:
            return (f"{self.out} is being written by lucifer-shard convert ({holder}); run {command} when it has "
                    f"finished")
        if _state(self.out) != self.seen:
            return (f"{self.out} was rewritten while {command} ran (its manifest or COMPLETE changed: a "
                    f"lucifer-shard convert ran meanwhile), so what it read may mix two outputs; run {command} again")
        return None

    def check(self, command: str) -> None:
        problem = self.problem(command)
        if problem:
            raise OutputError(problem)
