"""One-line, actionable errors. The CLI prints `error: <message>` and exits non-zero.

Every failure has a `kind`, a stable name from ERROR_KINDS that `--json` puts in the envelope's
`error.kind` (scripts branch on it; the message is for people and may be reworded). A kind has one
exit code, except `no_room`: plan, which only looks, reports it as a finding (1); convert refuses (2).
"""
from __future__ import annotations

# kind -> (exit code, meaning). The README's table of kinds is this table (a test compares them).
ERROR_KINDS: dict[str, tuple[int, str]] = {
    "usage": (2, "the command line: an unknown option, a bad value, a missing argument, options that exclude "
                 "each other or do not apply, swapped MODEL and OUT"),
    "source": (2, "MODEL is not a DeepSeek-V4-Flash checkpoint or config.json, or cannot be found"),
    "plan": (2, "the virtual-TP plan cannot be made for this TP size or option set"),
    "output": (2, "OUT is not what the command needs: missing, not a lucifer-shard output, not empty, "
                  "unfinished, of another format version"),
    "refused": (2, "a path the tool will not follow, open or delete: a link, a FIFO, a device, a file it did "
                   "not write"),
    "locked": (2, "OUT is being written by another lucifer-shard convert"),
    "no_room": (2, "OUT's filesystem lacks the bytes or inodes (plan reports it with exit 1)"),
    "environment": (2, "the machine refused an operation: permissions, a read-only or full disk, file-descriptor "
                       "limits, an I/O error"),
    "mismatch": (1, "a check found a problem: diff or verify findings, numerics past tolerance, a damaged or "
                    "edited output"),
    "check_failed": (1, "a doctor check failed"),
    "preflight_failed": (1, "serve's preflight failed (the doctor's checks for this output)"),
    "internal": (70, "a bug: the message names the log file that holds the traceback"),
    "interrupted": (130, "Ctrl-C"),
    "terminated": (143, "SIGTERM, stopped as cleanly as for Ctrl-C"),
}


class LuciferError(Exception):
    """Base class: the message is one line that names what is wrong and how to fix it."""

    kind = "usage"

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = ERROR_KINDS[self.kind][0] if exit_code is None else exit_code


class SourceError(LuciferError):
    """The source checkpoint or config is not what the V4-Flash schema requires."""

    kind = "source"

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key  # the source tensor at fault, when there is one (to name its shard)


class PlanError(LuciferError):
    """The requested TP size or arch cannot be served by the virtual-TP plan."""

    kind = "plan"


class OutputError(LuciferError):
    """The output directory is missing, incomplete, of another format, or not empty."""

    kind = "output"


class UsageRefused(LuciferError):
    """The command line asks for something that does not apply or cannot work together."""

    kind = "usage"


class Locked(OutputError):
    """OUT is held by another writer (its lock names it)."""

    kind = "locked"


class NoRoom(OutputError):
    """OUT's filesystem lacks the bytes or inodes the conversion needs."""

    kind = "no_room"


class EnvironmentRefused(LuciferError):
    """An operating-system error caused by the machine or its limits, not by a bug."""

    kind = "environment"


class MismatchError(LuciferError):
    """A check found a problem: diff, verify, check-numerics, or an output damaged or edited."""

    kind = "mismatch"


class CheckFailed(LuciferError):
    """A doctor check failed."""

    kind = "check_failed"


class PreflightFailed(LuciferError):
    """serve's preflight failed."""

    kind = "preflight_failed"


# Exit codes that are no error kind: success, and a reader that went away. A code shared by several
# kinds is summed up here; a code of one kind means what that kind means. (--help, the README's table
# and the envelope's exit_code all come from exit_codes().)
OK = 0
BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a reader that went away
EXIT_SUMMARIES: dict[int, str] = {
    OK: "ok",
    1: "a check found a problem (plan: OUT is short of room)",
    2: "refused: the command line, MODEL, OUT or the machine is not what the command needs",
    BROKEN_PIPE: "stdout was closed before the output was written (a reader such as `head` went away)",
}


def exit_codes() -> list[tuple[int, str, tuple[str, ...]]]:
    """(code, meaning, kinds) for every exit code the tool gives, by code."""
    kinds: dict[int, list[str]] = {}
    for kind, (code, _) in ERROR_KINDS.items():
        kinds.setdefault(code, []).append(kind)
    return [(code, EXIT_SUMMARIES[code] if code in EXIT_SUMMARIES else ERROR_KINDS[kinds[code][0]][1],
             tuple(kinds.get(code, ()))) for code in sorted(set(kinds) | set(EXIT_SUMMARIES))]
