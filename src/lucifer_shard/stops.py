"""A stop (Ctrl-C, SIGTERM) for the whole life of a `lucifer-shard` process: outside a command's run a signal
only sets a flag, so it never lands as a traceback in an import, in click's parsing or in the interpreter's
exit; the command's own handler (cli/console.py) raises the one recorded before it began, and a stop after
the command has finished ends the process at once, its output complete. A second signal always ends it at once.
Below every room: the process's entry point (cli/entry.py) and the console share it."""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

from .errors import BROKEN_PIPE

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class Terminated(KeyboardInterrupt):
    """SIGTERM (what containers and systemd send), raised where Ctrl-C would be: the same clean stop."""


_received: list[int] = []


def stop_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an exception was raised from or while handling, if any: a stop can come out
    as the error of a cleanup it interrupted, wrapped by Python (the RuntimeError of a class being built),
    or as the context of a network error (a stop during huggingface_hub's retry wait), and it is still the
    user's stop, not a bug."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def received() -> int | None:
    """The first stop's signal recorded so far; None without one."""
    return _received[0] if _received else None


def pending() -> KeyboardInterrupt | None:
    """The first stop recorded so far, as the exception a command raises for it; None without one."""
    signum = received()
    if signum is None:
        return None
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def check() -> None:
    """Raise the stop recorded so far, if any: called at each chunk of a loop that moves data, so a stop
    ends it within one chunk."""
    stop = pending()
    if stop is not None:
        raise stop


def end_now(signum: int, why: str) -> NoReturn:
    """One line on stderr and the signal's exit code, at once: nothing is left to finish or clean up."""
    _flush(sys.stderr)
    try:
        _flush(sys.stdout)
    except OSError:  # a reader gone: the line below may still reach stderr
        pass
    try:
        os.write(2, f"{why} ({NAMES[signal.Signals(signum)]})\n".encode())
    except OSError:
        pass
    os._exit(EXIT_CODES[signal.Signals(signum)])


def _record(signum: int, frame) -> None:
    _received.append(signum)
    if len(_received) > 1:
        end_now(signum, "stopped at once: a second stop")


def _after(signum: int, frame) -> None:
    end_now(signum, "stopped after the command had finished: its output above is complete")


def record_stops() -> None:
    """From here on a stop is recorded, not raised (the process's first act, before the heavy imports)."""
    for s in STOP_SIGNALS:
        signal.signal(s, _record)


def exit_now(code: int | str | None) -> NoReturn:
    """The command has finished (`code`: its SystemExit's): what it wrote is flushed and the process leaves
    without the interpreter's finalization, which puts the default handlers back, so that a stop while it
    joins threads would kill the process with no word (exit -2). A stop recorded meanwhile, or from here on,
    ends it at once with its line."""
    for s in STOP_SIGNALS:
        signal.signal(s, _after)
    if _received:
        end_now(_received[0], "stopped after the command had finished: its output above is complete")
    if isinstance(code, str):  # as the interpreter does with a message for an exit code
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()  # a log file's last records (the internal-error log, -v to a file)
    try:
        _flush(sys.stdout)
    except BrokenPipeError:  # a reader such as `head` went away: the console's exit for it
        code = BROKEN_PIPE
    except OSError:
        pass
    try:
        _flush(sys.stderr)
    except OSError:
        pass
    os._exit(code or 0)


def _flush(stream) -> None:
    """Flush a standard stream that may be None (the process started with it closed: `>&-`) or closed."""
    if stream is not None and not stream.closed:
        stream.flush()
