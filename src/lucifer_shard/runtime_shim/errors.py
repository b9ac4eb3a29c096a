"""One-line failures: what was expected, what was found, how to fix it; always `lucifer_tp3: ...`.

vLLM shows loader exceptions in worker logs; a single line with the fix is the whole message. These
are not the converter's `lucifer_shard.errors.LuciferError`: they are raised inside vLLM's processes,
which catch and report a `ValueError` (a bad configuration) or a `RuntimeError` (a failed load) and
know nothing of the CLI's error kinds and exit codes, so the two hierarchies share only the one-line
rule (`lucifer_shard.errors.one_line`).
"""
from __future__ import annotations

from lucifer_shard.errors import one_line

PREFIX = "lucifer_tp3: "


def _prefixed(msg: str) -> str:
    msg = one_line(str(msg))
    return msg if msg.startswith(PREFIX) else PREFIX + msg


class ShimError(ValueError):
    """The files, the manifest or the vLLM configuration do not match (fix the inputs)."""

    def __init__(self, msg: str):
        super().__init__(_prefixed(msg))


class ShimRuntimeError(RuntimeError):
    """vLLM did something the shim did not expect while loading (a changed code path)."""

    def __init__(self, msg: str):
        super().__init__(_prefixed(msg))
