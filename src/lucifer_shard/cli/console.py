"""How every command talks: -q/-v, progress only on a terminal, the --json envelope, one error line,
its own interrupt message, and the exit codes (errors.exit_codes()).

A command declared with `@conventions(interrupted=...)` (under `@click.command`) gains `-q/--quiet`,
`-v/--verbose` and `--json`, and its outcome goes through its `Console`:

  success        the result as text on stdout (with -q only its QUIET value), or with --json one
                 envelope on stdout, strict JSON (a non-finite float is null):
                 {"schema_version": 2, "command": ..., "ok": true, "error": null, "result": {...}}
  LuciferError   `error: <one line>` on stderr (its message, then its remedy: `; run <command> (<why>)`)
                 and its kind's exit code; with --json also the envelope, ok false, error {"kind",
                 "message", "exit_code", "remedy"} (remedy: {"command", "why", "first"} of its row of
                 errors.REMEDIES, or null), and the result the command had reached (a diff report with
                 its findings)
  usage          click's own (a bad value, an unknown option, a missing argument): the same, kind
                 usage, exit 2 (`Group`, the command group's class)
  Ctrl-C         the command's own interrupt message on stderr, exit 130
  SIGTERM        handled as Ctrl-C (the same clean stop and message), exit 143
  stdout closed  nothing more is said, exit 141 (text and --json alike)
  a fault        of the machine (an OS error naming its file, memory or threads exhausted) or of the
                 network (refused, reset, timed out, a 5xx or 402 from the Hub): one line of its kind
                 (errors.fault, source.hub.link_fault), exit 2
  anything else  a bug: `error: internal error: <type>: <message>; details in <log>` (the traceback
                 goes to OUT/.lucifer/ for convert, else a temporary file: a check writes nothing
                 into OUT), exit 70; with --json also the envelope

The console lives in the click context's `meta` (shared by a command and its group).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, NoReturn

import click
from click.core import ParameterSource

from .. import stops
from ..errors import BROKEN_PIPE, ERROR_KINDS, LuciferError, Remedy, UsageRefused, exit_codes, fault
from ..stops import Terminated

SCHEMA_VERSION = 2  # 2: error.kind is a kind of errors.ERROR_KINDS (1 had Python class names)
PROG = "lucifer-shard"
LOGGER = "lucifer_shard"
_META_KEY = "lucifer_shard.cli.console"
_OFF = ("", "0", "false", "no", "off")

# What -q leaves on stdout, per command: the one value a script captures with $(...), as (what it is,
# its key path in the result); no path: nothing, the exit code is the answer. Errors and warnings
# still go to stderr. (The -q help of each command and docs/cli.md's table say the same.)
QUIET: dict[str, tuple[str, tuple[str, ...]]] = {
    "plan": ("only the bytes convert will write (an integer)", ("footprint", "write_bytes")),
    "convert": ("only OUT", ("out",)),
    "diff": ("nothing (the exit code is the answer)", ()),
    "verify": ("nothing (the exit code is the answer)", ()),
    "inspect": ("only the conversion id", ("conversion_id",)),
    "check-numerics": ("nothing (the exit code is the answer)", ()),
    "synth": ("only the checkpoint's path", ("path",)),
    "stage": ("only DEST", ("dest",)),
    "fetch": ("only DEST", ("dest",)),
    "doctor": ("nothing (the exit code is the answer)", ()),
    "serve": ("only the vllm command line (with --dry-run, when the preflight passes)", ("command",)),
    "smoke": ("nothing (the exit code is the answer)", ()),
    "cache": ("nothing (the exit code is the answer)", ()),
}


def exit_code_lines() -> list[str]:
    return [f"  {code:>3}  {meaning}" + (f"  [{', '.join(kinds)}]" if kinds else "")
            for code, meaning, kinds in exit_codes()]


def quiet_value(command: str, result: Any) -> str | None:
    """The QUIET value of `command`'s result, or None (nothing to print)."""
    path = QUIET[command][1]
    for key in path:
        if not isinstance(result, dict) or result.get(key) is None:
            return None
        result = result[key]
    return str(result) if path else None


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +-inf) as None: strict JSON (JSON.parse rejects NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def to_stdout(text: str) -> None:
    """Write a line to stdout; BrokenPipeError when stdout is closed (a reader gone, or `>&-`: then
    Python starts with no sys.stdout, and click.echo would drop the text without a word)."""
    if sys.stdout is None:
        raise BrokenPipeError(errno.EPIPE, "stdout is closed")
    try:
        click.echo(text)
    except OSError as e:
        if e.errno in (errno.EPIPE, errno.EBADF):
            raise BrokenPipeError(errno.EPIPE, "stdout is closed") from e
        raise


def stdout_gone() -> NoReturn:
    """stdout was closed early (`| head`, `>&-`): nothing is wrong, nothing more to say; exit 141."""
    with contextlib.suppress(OSError):  # so that the interpreter's last flush of stdout does not fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.exit(BROKEN_PIPE)


@dataclass
class Console:
    command: str = ""
    json: bool = False
    verbosity: int = 0  # -1 quiet, 0 normal, 1 -v (INFO log), 2 -vv (DEBUG log)
    interrupted: str = "interrupted"
    result: Any = None

    @classmethod
    def of(cls, ctx: click.Context | None = None) -> "Console":
        ctx = ctx or click.get_current_context()
        return ctx.meta.setdefault(_META_KEY, cls())

    @property
    def progress(self) -> bool:
        """Progress bars only for a person watching: stderr is a terminal, no -q, TQDM_DISABLE unset."""
        disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() not in _OFF
        return self.verbosity >= 0 and sys.stderr.isatty() and not disabled

    def emit(self, result: Any, lines: list[str] | None = None) -> None:
        """The command's result: kept for the envelope, printed now as text unless --json (with -q
        only its QUIET value)."""
        self.result = result
        if self.json:
            return
        text = quiet_value(self.command, result) if self.verbosity < 0 else "\n".join(lines or ())
        if text:
            to_stdout(text)

    def note(self, message: str) -> None:
        """A remark for the person at the terminal (stderr; silenced by -q)."""
        if self.verbosity >= 0:
            click.echo(message, err=True)

    @staticmethod
    def warn(message: str) -> None:
        click.echo(f"warning: {message}", err=True)

    def envelope(self, error: dict | None = None) -> dict:
        return {"schema_version": SCHEMA_VERSION, "command": self.command, "ok": error is None,
                "error": error, "result": self.result}

    def _write_envelope(self, error: dict | None) -> None:
        to_stdout(json.dumps(finite(self.envelope(error)), indent=1, allow_nan=False))

    def fail_with(self, e: LuciferError) -> NoReturn:
        """End the command with `e`: its kind, its line (message and remedy), its exit code."""
        self.fail(str(e), e.exit_code, e.kind, remedy=e.remedy)

    def succeed(self) -> None:
        if self.json:
            try:
                self._write_envelope(None)
            except BrokenPipeError:
                stdout_gone()

    def fail(self, message: str, exit_code: int, kind: str, line: str | None = None,
             remedy: Remedy | None = None) -> NoReturn:
        """End the command: the envelope (with --json), one line on stderr (`error: <message>` unless
        `line` says otherwise), the exit code (141 when stdout is closed before the envelope is out).
        `message` already ends with `remedy`, which the envelope also gives apart."""
        gone = False
        if self.json:
            try:
                self._write_envelope({"kind": kind, "message": message, "exit_code": exit_code,
                                      "remedy": None if remedy is None else asdict(remedy)})
            except BrokenPipeError:
                gone = True
        click.echo(f"error: {message}" if line is None else line, err=True)
        if gone:
            stdout_gone()
        sys.exit(exit_code)


def internal_error_log(out: str | os.PathLike | None) -> str:
    """Write the current exception's traceback, with the command line and versions, to
    OUT/.lucifer/ when that folder exists and is writable, else to a temporary file; its path.
    Never raises: an OUT that cannot even be stat'ed (a name too long, no permission) gets the
    temporary file, and if nothing can be written the line says so."""
    import datetime
    import platform
    import tempfile
    import traceback

    from .. import __version__
    from ..guarded_io import Tree
    from ..outnames import STATE_DIR

    try:
        now = datetime.datetime.now().astimezone()
        text = (f"lucifer-shard {__version__} internal error at {now.isoformat(timespec='seconds')}\n"
                f"command: {' '.join(sys.argv)}\npython {platform.python_version()} on {platform.platform()}\n\n"
                + traceback.format_exc())
        name = f"internal-error-{now:%Y%m%d-%H%M%S}-{os.getpid()}.log"
    except Exception as e:  # noqa: BLE001 - the handler of last resort must not fail itself
        return f"no log file (composing it failed: {type(e).__name__})"
    try:  # OUT may be anything here (a name too long, unreadable): the handler itself cannot fail
        tree = Tree(out) if out else None
        if tree is not None and tree.lstat(STATE_DIR) is not None:
            tree.write_bytes(f"{STATE_DIR}/{name}", text.encode("utf-8", "replace"))
            return str(tree.path(f"{STATE_DIR}/{name}"))
    except (OSError, LuciferError, ValueError, TypeError):
        pass  # a full disk, a link, say: try the temporary folder
    try:
        fd, path = tempfile.mkstemp(prefix="lucifer-shard-", suffix=f"-{name}")
        with os.fdopen(fd, "w", errors="replace") as f:
            f.write(text)
        return path
    except OSError as e:
        return f"no log file (writing one failed: {e.strerror})"


class _ClickStderr(logging.Handler):
    """Log records on the current stderr (click's, so test runners capture them)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(self.format(record), err=True)


def _configure_logging(verbosity: int) -> None:
    log = logging.getLogger(LOGGER)
    if not any(isinstance(h, _ClickStderr) for h in log.handlers):
        handler = _ClickStderr()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity == 1 else logging.WARNING)


def _internal(con: Console, e: BaseException, out) -> NoReturn:
    """A bug: one line naming the log that holds the traceback, exit 70."""
    log = internal_error_log(out)
    try:
        text = " ".join(str(e).split())
    except Exception:  # noqa: BLE001 - an exception whose str() fails still gets its line
        text = "(no message)"
    message = f"internal error: {type(e).__name__}: {text}"
    con.fail(message, ERROR_KINDS["internal"][0], "internal", line=f"error: {message}; details in {log}")


def _link(e: BaseException, command: str) -> LuciferError | None:
    """A network failure no command named a file for (each maps its own, `source.hub.link_fault`): still
    the link's fault, kind environment, not a bug."""
    from ..source.hub import link_fault

    return link_fault(e, f"lucifer-shard {command}")


def _stopped(con: Console, stop: KeyboardInterrupt, message: str) -> NoReturn:
    stops.answered()
    kind = "terminated" if isinstance(stop, Terminated) else "interrupted"
    con.fail(message, ERROR_KINDS[kind][0], kind, line=message)


def _log_parameters(ctx: click.Context) -> None:
    """-v: the command as given; -vv: also every default it runs with."""
    given, defaults = [], []
    for name, value in ctx.params.items():
        if name not in ("quiet", "verbose", "as_json"):
            default = ctx.get_parameter_source(name) in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
            (defaults if default else given).append(f"{name}={value}")
    log = logging.getLogger(f"{LOGGER}.cli")
    log.info("%s %s", ctx.info_name, " ".join(given))
    log.debug("%s defaults: %s", ctx.info_name, " ".join(defaults))



HUB_BARS_OFF = "HF_HUB_DISABLE_PROGRESS_BARS"  # read by huggingface_hub at import; its switch once imported


@contextlib.contextmanager
def _hub_bars(shown: bool):
    """huggingface_hub's own bars (snapshot_download's "Fetching N files") off under -q and --json, as ours are."""
    if shown:
        yield
        return
    before = os.environ.get(HUB_BARS_OFF)
    os.environ[HUB_BARS_OFF] = "1"
    hub = sys.modules.get("huggingface_hub.utils")
    was = hub.are_progress_bars_disabled() if hub else True
    if hub:
        hub.disable_progress_bars()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HUB_BARS_OFF, None)
        else:
            os.environ[HUB_BARS_OFF] = before
        if hub and not was:
            hub.enable_progress_bars()


def conventions(interrupted: str) -> Callable:
    """Give a click command -q/-v/--json and route its outcome through its Console (module docstring)."""

    def decorate(f: Callable) -> Callable:
        name = f.__name__.replace("_", "-")  # the command's name, as click derives it

        @functools.wraps(f)
        def command(*args, quiet: bool, verbose: int, as_json: bool, **kwargs):
            ctx = click.get_current_context()
            con = Console.of(ctx)
            # the message may name OUT ({out}): where a partial result lies
            message = interrupted.format(out=kwargs.get("out")) if "{out}" in interrupted else interrupted
            con.command, con.json, con.interrupted = ctx.command.name or "", as_json, message
            try:
                if quiet and verbose:
                    raise UsageRefused("-q and -v exclude each other; pass one")
                con.verbosity = -1 if quiet else verbose
                _configure_logging(con.verbosity)
                _log_parameters(ctx)
                # a stop is a flag, raised where the work checks it (stops.py)
                with stops.recorded(), _hub_bars(con.verbosity >= 0 and not as_json):
                    f(*args, **kwargs)
            except LuciferError as e:
                con.fail_with(e)
            except KeyboardInterrupt as e:
                _stopped(con, e, message)
            except BrokenPipeError:  # stdout closed early (`| head`): nothing is wrong, nothing to say
                stdout_gone()
            except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
                raise  # click's own usage errors and exits
            except Exception as e:  # noqa: BLE001 - the one place an unexpected exception is reported
                stop = stops.stop_behind(e)
                if stop is not None:
                    _stopped(con, stop, message)
                known = fault(e, con.command) or _link(e, con.command)  # the machine's or the network's, or a bug
                if known is None:  # only convert writes into OUT: the checks leave it as they found it
                    _internal(con, e, kwargs.get("out") if con.command == "convert" else None)
                con.fail_with(known)
            con.succeed()

        for option in reversed((
            click.option("-q", "--quiet", is_flag=True,
                         help=f"Quiet: stdout holds {QUIET[name][0]}; no progress bars, no remarks (warnings "
                              f"and errors still on stderr)."),
            click.option("-v", "--verbose", count=True,
                         help="Log on stderr what is being done, per file, rank or layer (-vv: also per "
                              "tensor)."),
            click.option("--json", "as_json", is_flag=True,
                         help="One JSON envelope on stdout {schema_version, command, ok, error, result}, "
                              "also on failure."),
        )):
            command = option(command)
        return command

    return decorate


def _own_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """The command named in `argv` (the group's only options, --help and --version, end the run) and
    its own arguments: those before `--` (after it, they are arguments even when they look like options:
    serve's vLLM arguments)."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            rest = argv[i + 1:]
            return arg, rest[:rest.index("--")] if "--" in rest else rest
    return None, []


class Group(click.Group):
    """The command group: click's own usage errors (a bad value, an unknown option or command, a missing
    argument) end like every other failure: one `error:` line with the command's --help, kind usage, and
    with --json among the command's own arguments the envelope on stdout. --help and --version as click
    has them."""

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        argv = command_first(list(args)) if parent is None else list(args)
        args = argv
        with _usage_errors(argv):
            ctx = super().make_context(info_name, args, parent, **extra)
        ctx.meta[f"{_META_KEY}.argv"] = argv
        return ctx

    def invoke(self, ctx: click.Context):
        with _usage_errors(ctx.meta.get(f"{_META_KEY}.argv", [])):
            return super().invoke(ctx)


# Every command's own conventions: given before the command's name (`lucifer-shard --json verify OUT`),
# they are the command's, as if given after it.
CONVENTION_FLAGS = ("--json", "-q", "--quiet", "-v", "-vv", "--verbose")


def command_first(argv: list[str]) -> list[str]:
    """`argv` with the convention flags before the command's name moved after it."""
    lead = 0
    while lead < len(argv) and argv[lead] in CONVENTION_FLAGS:
        lead += 1
    if 0 < lead < len(argv) and not argv[lead].startswith("-"):
        return [argv[lead], *argv[:lead], *argv[lead + 1:]]
    return argv


@contextlib.contextmanager
def _usage_errors(argv: list[str]):
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise  # `lucifer-shard` alone: the help, as click shows it
    except click.UsageError as e:
        name, own = _own_args(argv)
        known = e.ctx is not None and e.ctx.parent is not None  # the error of a command, not of the group
        command = e.ctx.info_name if known else name
        where = f"{PROG} {command}" if known else PROG
        text = " ".join(e.format_message().split()).rstrip(".")
        con = Console(command=command or "", json="--json" in own)
        con.fail(f"{text}; see {where} --help", ERROR_KINDS["usage"][0], "usage")
