"""One-line failures: what was expected, what was found, how to fix it; always `lucifer_tp3: ...`.

vLLM shows loader exceptions in worker logs; a single line with the fix is the whole message.
"""
from __future__ import annotations

PREFIX = "lucifer_tp3: "


def _one_line(msg: str) -> str:
    msg = " ".join(str(msg).split())
    return msg if msg.startswith(PREFIX) else PREFIX + msg


class ShimError(ValueError):
    """The files, the manifest or the vLLM configuration do not match (fix the inputs)."""

    def __init__(self, msg: str):
        super().__init__(_one_line(msg))


class ShimRuntimeError(RuntimeError):
    """vLLM did something the shim did not expect while loading (a changed code path)."""

    def __init__(self, msg: str):
        super().__init__(_one_line(msg))
