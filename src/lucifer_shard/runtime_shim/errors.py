"""One-line failures: what was expected, what was found, how to fix it; always `lucifer_tp3: ...`.

vLLM shows loader exceptions in worker logs; a single line with the fix is the whole message. These
are not the converter's `lucifer_shard.errors.LuciferError`: they are raised inside vLLM's processes,
which catch and report a `ValueError` (a bad configuration) or a `RuntimeError` (a failed load) and
know nothing of the CLI's error kinds and exit codes, so the two hierarchies share only the one-line
rule (`lucifer_shard.errors.one_line`) and the table of remedies (`lucifer_shard.errors.REMEDIES`): the line
ends with its row.
"""
from __future__ import annotations

from lucifer_shard.errors import Remedy, one_line

PREFIX = "lucifer_tp3: "


def _prefixed(msg: str) -> str:
    msg = one_line(str(msg))
    return msg if msg.startswith(PREFIX) else PREFIX + msg


class ShimError(ValueError):
    """The files, the manifest or the vLLM configuration do not match (fix the inputs)."""

    def __init__(self, msg: str, remedy: Remedy | None = None):
        super().__init__(_prefixed(f"{msg}; {remedy}" if remedy else msg))
        self.remedy = remedy


class ShimRuntimeError(RuntimeError):
    """vLLM did something the shim did not expect while loading (a changed code path)."""

    def __init__(self, msg: str, remedy: Remedy | None = None):
        super().__init__(_prefixed(f"{msg}; {remedy}" if remedy else msg))
        self.remedy = remedy
