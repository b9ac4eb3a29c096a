"""One-line, actionable errors. The CLI prints `error: <message>` and exits non-zero."""


class LuciferError(Exception):
    """Base class: the message is one line that names what is wrong and how to fix it."""

    exit_code = 2


class SourceError(LuciferError):
    """The source checkpoint or config is not what the V4-Flash schema requires."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key  # the source tensor at fault, when there is one (to name its shard)


class PlanError(LuciferError):
    """The requested TP size or arch cannot be served by the virtual-TP plan."""


class OutputError(LuciferError):
    """The output directory is missing, incomplete, tampered with or from another conversion."""


class UsageRefused(LuciferError):
    """The command line asks for something that does not apply or cannot work together."""


class MismatchError(LuciferError):
    """A check found a problem: diff, verify, check-numerics, doctor or the serve preflight."""

    exit_code = 1
