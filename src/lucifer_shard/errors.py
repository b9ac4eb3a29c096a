"""One-line, actionable errors. The CLI prints `error: <message>` and exits non-zero.

Every failure has a `kind`, a stable name from ERROR_KINDS that `--json` puts in the envelope's
`error.kind` (scripts branch on it; the message is for people and may be reworded). A kind has one
exit code, except `no_room`: plan, which only looks, reports it as a finding (1); convert refuses (2).

A failure the user fixes by running a command also carries its `remedy`, a row of the table below
(REMEDIES): the command to run and why it fixes the failure, each spelled once, whichever room raises
it. The line ends with it (`<message>; <first>, then run <command> (<why>), or <instead>`) and
`--json` gives it apart (cli/console.py renders both).
"""
from __future__ import annotations

import errno
import resource
from dataclasses import dataclass, replace

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
    "locked": (2, "OUT is being written by another lucifer-shard convert, or a download folder is in use by another "
                  "command"),
    "no_room": (2, "OUT's filesystem lacks the bytes or inodes, found before the first write or by a write "
                   "(plan reports it with exit 1)"),
    "environment": (2, "the machine or the network refused an operation: permissions, a read-only disk, an I/O "
                       "error, file-descriptor, file-size, memory or thread limits; the link to the Hub refused, "
                       "reset, timed out, a 5xx after retries or a 402 download quota"),
    "server": (2, "smoke's URL: nothing answers there, it is not a vLLM OpenAI-compatible server, or it ran past "
                  "--timeout"),
    "mismatch": (1, "a check found a problem: diff or verify findings, numerics past tolerance, a damaged or "
                    "edited output"),
    "check_failed": (1, "a doctor or smoke check failed"),
    "preflight_failed": (1, "serve's preflight failed (the doctor's checks for this output)"),
    "internal": (70, "a bug: the message names the log file that holds the traceback"),
    "interrupted": (130, "Ctrl-C"),
    "terminated": (143, "SIGTERM, stopped as cleanly as for Ctrl-C"),
}


@dataclass(frozen=True)
class Remedy:
    """The command that fixes a failure and why it does: a row of REMEDIES. `command` and `why` may name
    `{placeholders}` the raise site fills (`at`); `first` and `instead`, the raise site's (`after`)."""

    command: str
    why: str = ""
    first: str = ""
    instead: str = ""  # what else fixes it, where the command is not the only way

    def at(self, **names: str) -> "Remedy":
        """This row with its placeholders filled."""
        return replace(self, command=self.command.format(**names), why=self.why.format(**names))

    def after(self, first: str, instead: str = "") -> "Remedy":
        """This row for one failure: what must be done before it, and what else would do."""
        return replace(self, first=first, instead=instead)

    def __str__(self) -> str:
        run = f"run {self.command}" + (f" ({self.why})" if self.why else "")
        run = f"{self.first}, then {run}" if self.first else run
        return f"{run}, or {self.instead}" if self.instead else run


# ---------------------------------------------------------------- the remedies, each spelled once

SAME_COMMAND = Remedy("the same command again")
COMMAND_AGAIN = Remedy("{command} again")
READ_AGAIN = Remedy(SAME_COMMAND.command, "it reads the file anew; if it fails again, report it to the repo's owner")
CONVERT_RESUME = Remedy("the same convert command with --resume", "it keeps what is finished and sound and writes the "
                        "rest")
CONVERT_AGAIN = Remedy("lucifer-shard convert again")
CONVERT_FORCE = Remedy("the same convert command with --force", "it replaces the output")
NODE_CONVERT_RESUME = Remedy("the node's convert again with --resume", "the same command line, its --ranks or "
                             "--nnodes/--node-rank: it rewrites only the files that fail")
STAGE_AGAIN = Remedy("lucifer-shard stage OUT DEST {ranks}", "it replaces only the files that fail")
FETCH_SHARE = Remedy("lucifer-shard fetch REPO DEST {ranks}", "it checks every file against the manifest")
FETCH_AGAIN = Remedy("the same fetch again", "it resumes: files already checked are kept, a cut file continues")
COPY_AGAIN = Remedy("the same fetch or stage again", "it continues: the files already checked are kept")
CONVERT = Remedy("lucifer-shard convert --tp 3 --expert-layout model {model} {out}", "it writes the output vLLM serves")
PLAN = Remedy("lucifer-shard plan --tp 3 {model}", "it shows the bytes per rank")
DOCTOR = Remedy("lucifer-shard doctor {out}", "it shows every check, this vLLM build's among them")
SERVE = Remedy("lucifer-shard serve {out}", "it starts vLLM with the plugin's virtual-TP wrappers active")
IN_ORDER = Remedy("lucifer-shard {command} ... {args}", "the arguments in the order the command takes them")
VERIFY = Remedy("lucifer-shard verify {out}", "it names every problem and its fix")
CACHE_RECORD = Remedy("lucifer-shard cache record {out}", "it records what that start compiled, every file's digest")
INSPECT = Remedy("lucifer-shard inspect {out}", "it shows the checkpoint it was converted from")

# name -> row: the table (tests/test_remedies.py checks each row is used and no raise site spells its own)
REMEDIES: dict[str, Remedy] = {name: r for name, r in globals().items() if isinstance(r, Remedy)}


class LuciferError(Exception):
    """Base class: the message is one line that names what is wrong, and `remedy` the command that fixes
    it (a row of REMEDIES), or the message says the fix itself where no command does."""

    kind = "usage"

    def __init__(self, message: str, exit_code: int | None = None, remedy: Remedy | None = None):
        super().__init__(one_line(f"{message}; {remedy}" if remedy else message))
        self.message = one_line(message)
        self.remedy = remedy
        self.exit_code = ERROR_KINDS[self.kind][0] if exit_code is None else exit_code


class SourceError(LuciferError):
    """The source checkpoint or config is not what the V4-Flash schema requires."""

    kind = "source"

    def __init__(self, message: str, key: str | None = None, remedy: Remedy | None = None):
        super().__init__(message, remedy=remedy)
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
    """A doctor or smoke check failed."""

    kind = "check_failed"


class ServerError(LuciferError):
    """smoke: nothing answers at the URL, it is not a vLLM OpenAI-compatible server, or it ran past --timeout."""

    kind = "server"


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
    2: "refused: the command line, MODEL, OUT, the machine or the server is not what the command needs",
    BROKEN_PIPE: "stdout was closed before the output was written (a reader such as `head` went away)",
}


def exit_codes() -> list[tuple[int, str, tuple[str, ...]]]:
    """(code, meaning, kinds) for every exit code the tool gives, by code."""
    kinds: dict[int, list[str]] = {}
    for kind, (code, _) in ERROR_KINDS.items():
        kinds.setdefault(code, []).append(kind)
    return [(code, EXIT_SUMMARIES[code] if code in EXIT_SUMMARIES else ERROR_KINDS[kinds[code][0]][1],
             tuple(kinds.get(code, ()))) for code in sorted(set(kinds) | set(EXIT_SUMMARIES))]


def one_line(text: str) -> str:
    """`text` with every character that is not printable escaped as Python writes it (a newline in a
    path as `\\n`): a message that names a path stays one line whatever the path holds."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# ---------------------------------------------------------------- faults of the machine

# OS errors that come from the machine or the input (permissions, limits, a read-only or failing disk,
# a bad name), not from a bug: errno -> the advice of its one line. A full disk or quota is `no_room`
# (the kind convert's room check gives before writing), every other one `environment`.
ENVIRONMENT_ERRNOS = {errno.EACCES: "check its permissions", errno.EPERM: "check its permissions and attributes",
                      errno.EROFS: "the filesystem is read-only", errno.ENOSPC: "free some room there",
                      errno.EDQUOT: "the disk quota is exhausted", errno.ENAMETOOLONG: "use a shorter path",
                      errno.ELOOP: "too many symbolic links in the path", errno.EMFILE: "raise `ulimit -n`",
                      errno.ENFILE: "the system is out of file descriptors",
                      errno.EIO: "the disk reported an I/O error (see dmesg)",
                      errno.ENOENT: "it does not exist", errno.ENOTDIR: "a part of the path is not a directory",
                      errno.EISDIR: "it is a directory", errno.ENXIO: "no such device",
                      errno.EFBIG: "the file size limit (ulimit -f) is reached"}
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# What a command needs, stated when a limit stops it: its peak memory is bounded, whatever the model's size
# (docs/evidence/performance.md measures convert at 0.5 GiB and checks it stays under 1.5 GiB); an address-space
# limit also counts the libraries and thread stacks it maps (docs/evidence/reliability.md: each command ran in
# 900 MiB on the tiny checkpoint, so 2 GiB leaves room for more threads).
MEMORY_BOUND = "1.5 GiB"
ADDRESS_SPACE = 2 << 30


def _limit(which: int) -> str:
    soft = resource.getrlimit(which)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _memory(what: str, command: str, then: Remedy) -> "EnvironmentRefused":
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        where = "the machine is out of memory (no address-space limit is set)"
        fix = "free memory (or add swap)"
    else:
        where = f"this process may use {_mib(soft)} of address space (ulimit -v {soft >> 10})"
        fix = f"raise ulimit -v to at least {_mib(ADDRESS_SPACE)} (ulimit -v {ADDRESS_SPACE >> 10})"
    return EnvironmentRefused(f"out of memory ({what}): {where}; lucifer-shard {command} keeps its memory under "
                              f"{MEMORY_BOUND} whatever the model's size, and an address-space limit also counts "
                              f"the libraries and thread stacks it maps", remedy=then.after(fix))


def fault(e: BaseException, command: str, then: Remedy = SAME_COMMAND) -> LuciferError | None:
    """The one-line error of a fault of the machine (an OS error of ENVIRONMENT_ERRNOS naming its file,
    memory or threads exhausted, as each command meets them), or None: a bug. `then`: what to do once
    the cause is fixed."""
    text = " ".join(str(e).split())
    if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM) or (
            isinstance(e, (ImportError, RuntimeError)) and ("failed to map segment" in text
                                                            or "Cannot allocate memory" in text)):
        return _memory(text or type(e).__name__, command, then)
    if isinstance(e, RuntimeError) and "can't start new thread" in text:
        space = resource.getrlimit(resource.RLIMIT_AS)[0]
        return EnvironmentRefused(f"cannot start a thread ({text}): this process may run {_limit(resource.RLIMIT_NPROC)} "
                                  f"processes and threads (ulimit -u) with "
                                  f"{'no address-space limit' if space == resource.RLIM_INFINITY else _mib(space)} "
                                  f"(ulimit -v); lucifer-shard {command} runs worker threads and needs at "
                                  f"least {_mib(ADDRESS_SPACE)} of address space with them",
                                  remedy=then.after("raise the limits"))
    if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        line = f"{where or 'lucifer-shard ' + command}: {e.strerror}"
        remedy = then.after(ENVIRONMENT_ERRNOS[e.errno])
        return NoRoom(line, remedy=remedy) if e.errno in DISK_FULL else EnvironmentRefused(line, remedy=remedy)
    return None
