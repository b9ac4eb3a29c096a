"""How every command talks: -q/-v, progress only on a terminal, the --json envelope, one error line,
its own interrupt message, and the exit codes.

A command declared with `@conventions(interrupted=...)` (under `@click.command`) gains `-q/--quiet`,
`-v/--verbose` and `--json`, and its outcome goes through its `Console`:

  success        the result as text on stdout, or with --json one envelope on stdout:
                 {"schema_version": 1, "command": ..., "ok": true, "error": null, "result": {...}}
  LuciferError   `error: <one line>` on stderr and its exit code; with --json also the envelope,
                 ok false, error {"kind", "message", "exit_code"}, and the result the command had
                 reached (a diff report with its findings)
  Ctrl-C         the command's own interrupt message on stderr, exit 130
  SIGTERM        handled as Ctrl-C (the same clean stop and message), exit 143
  anything else  a bug: `error: internal error: <type>: <message>; details in <log>` (the traceback
                 goes to OUT/.lucifer/ or a temporary file), exit 70; with --json also the envelope

The console lives in the click context's `meta` (shared by a command and its group).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import click

from ..errors import ERROR_KINDS, LuciferError, UsageRefused

SCHEMA_VERSION = 1
INTERNAL_ERROR = 70  # EX_SOFTWARE: a bug, not bad input
TERMINATED = 143  # 128 + SIGTERM
BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a reader that went away
EXIT_CODES = (
    (0, "ok"),
    (1, "a check found a problem (diff, verify, check-numerics, doctor, serve preflight, plan room)"),
    (2, "usage or input error, or a refusal (bad MODEL/OUT, options that do not apply, OUT locked by "
        "another writer)"),
    (INTERNAL_ERROR, "internal error: a bug; one line names the log file holding the traceback"),
    (130, "interrupted (Ctrl-C)"),
    (143, "terminated (SIGTERM), stopped as cleanly as for Ctrl-C"),
    (BROKEN_PIPE, "stdout closed before the output was written (e.g. `| head`)"),
)
LOGGER = "lucifer_shard"
_META_KEY = "lucifer_shard.cli.console"
_OFF = ("", "0", "false", "no", "off")


def exit_code_lines() -> list[str]:
    return [f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES]


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
        """The command's result: kept for the envelope, printed now as text unless --json."""
        self.result = result
        if not self.json and lines:
            click.echo("\n".join(lines))

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

    def succeed(self) -> None:
        if self.json:
            click.echo(json.dumps(self.envelope(), indent=1))

    def fail(self, message: str, exit_code: int, kind: str, line: str | None = None) -> NoReturn:
        """End the command: the envelope (with --json), one line on stderr (`error: <message>` unless
        `line` says otherwise), the exit code."""
        if self.json:
            click.echo(json.dumps(self.envelope({"kind": kind, "message": message, "exit_code": exit_code}), indent=1))
        click.echo(f"error: {message}" if line is None else line, err=True)
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
    from ..spec.manifest import STATE_DIR

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


# OS errors that come from the machine or the input (permissions, limits, a full or read-only disk,
# a bad name), not from a bug: one line naming the file and the errno, exit 2.
ENVIRONMENT_ERRNOS = {errno.EACCES: "check its permissions", errno.EPERM: "check its permissions and attributes",
                      errno.EROFS: "the filesystem is read-only", errno.ENOSPC: "free some room",
                      errno.EDQUOT: "the disk quota is exhausted", errno.ENAMETOOLONG: "use a shorter path",
                      errno.ELOOP: "too many symbolic links in the path", errno.EMFILE: "raise `ulimit -n`",
                      errno.ENFILE: "the system is out of file descriptors", errno.EIO: "the disk reported an "
                      "I/O error", errno.ENOENT: "it does not exist", errno.ENOTDIR: "a part of the path is not "
                      "a directory", errno.EISDIR: "it is a directory", errno.ENXIO: "no such device"}


def os_error_line(e: OSError) -> str | None:
    """`<file>: <strerror>; <advice>` for an OSError of ENVIRONMENT_ERRNOS, else None (a bug)."""
    advice = ENVIRONMENT_ERRNOS.get(e.errno)
    if advice is None:
        return None
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None) or "a file"
    return f"{where}: {e.strerror}; {advice}"


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
    con.fail(message, INTERNAL_ERROR, "internal", line=f"error: {message}; details in {log}")


class Terminated(KeyboardInterrupt):
    """SIGTERM (what containers and systemd send), raised where Ctrl-C would be: the same clean stop."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """While a command runs, SIGTERM raises Terminated in the main thread, as SIGINT raises
    KeyboardInterrupt; elsewhere (a command run from a worker thread) signals stay as they are."""
    def handler(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def conventions(interrupted: str) -> Callable:
    """Give a click command -q/-v/--json and route its outcome through its Console (module docstring)."""

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(*args, quiet: bool, verbose: int, as_json: bool, **kwargs):
            ctx = click.get_current_context()
            con = Console.of(ctx)
            con.command, con.json, con.interrupted = ctx.command.name or "", as_json, interrupted
            try:
                if quiet and verbose:
                    raise UsageRefused("-q and -v exclude each other; pass one")
                con.verbosity = -1 if quiet else verbose
                _configure_logging(con.verbosity)
                with _sigterm_interrupts():
                    f(*args, **kwargs)
            except LuciferError as e:
                con.fail(str(e), e.exit_code, e.kind)
            except Terminated:
                con.fail(interrupted, TERMINATED, "terminated", line=interrupted)
            except KeyboardInterrupt:
                con.fail(interrupted, 130, "interrupted", line=interrupted)
            except BrokenPipeError:  # stdout closed early (`| head`): nothing is wrong, nothing to say
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(BROKEN_PIPE)
            except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
                raise  # click's own usage errors and exits
            except OSError as e:
                line = os_error_line(e)
                if line is None:
                    _internal(con, e, kwargs.get("out"))
                con.fail(line, ERROR_KINDS["environment"][0], "environment")
            except Exception as e:  # noqa: BLE001 - the one place an unexpected exception is reported
                _internal(con, e, kwargs.get("out"))
            con.succeed()

        for option in reversed((
            click.option("-q", "--quiet", is_flag=True,
                         help="No progress bars and no remarks; results, warnings and errors only."),
            click.option("-v", "--verbose", count=True, help="Log what is being done (-vv: and why)."),
            click.option("--json", "as_json", is_flag=True,
                         help="One JSON envelope on stdout {schema_version, command, ok, error, result}, "
                              "also on failure."),
        )):
            command = option(command)
        return command

    return decorate
