"""A stop (Ctrl-C, SIGTERM) for the whole life of a `lucifer-shard` process is a flag: the handler only records
the signal, so a stop never lands as an exception in an import, a lock, a close or a progress bar (Python's
documentation advises complex programs to do so). The work looks at the flag where it is (`check`: each part
and chunk written, read, hashed, copied or compared, each slice of a wait, `joined` for a call that blocks) and
raises the recorded stop there; the command then ends with its own message (cli/console.py). A stop after the
command has finished ends the process at once, its output complete. A second signal always ends it at once,
whatever it is doing. Below every room: every room, the entry point (cli/entry.py) and the console share it."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

from .errors import BROKEN_PIPE

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class Terminated(KeyboardInterrupt):
    """SIGTERM (what containers and systemd send), raised where Ctrl-C would be: the same clean stop."""


SLICE_S = 0.05  # a wait that a stop must not hold is cut into slices this long, the flag checked after each
T = TypeVar("T")
_received: list[int] = []
_answered: list[bool] = []  # the first stop was raised and the command ended with its message


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
    """Raise the stop recorded so far, if any (any thread: a worker's stop reaches the main thread through its
    future or the wait that joins it). Called where the work is, never from the handler."""
    if _received:
        raise pending()


def answered() -> None:
    """The command ended with its stop's message: the process leaves with its exit code and no further line."""
    _answered.append(True)


def joined(call: Callable[[], T], name: str) -> T:
    """`call()` run on a daemon thread and waited for in slices of SLICE_S, the flag checked after each: a call
    that blocks where no check can run (a download waiting on the network, huggingface_hub's thread map) and
    that a stop must not wait for. On a stop the thread is left to end with the process (what it wrote is a
    download's resumable bytes); its exception is raised here."""
    done: list = []

    def run() -> None:
        try:
            done.append((True, call()))
        except BaseException as e:  # handed to the waiting thread
            done.append((False, e))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(SLICE_S)
        check()
    ok, value = done[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """While a command runs in the main thread: a stop is recorded (a second ends the process) and the one
    recorded before it began is raised at once. Afterwards the handlers found are back; where they were not
    the console script's (a command run inside another program: the tests' CliRunner) its stops were this
    command's alone and are forgotten. In another thread signals stay as they are."""
    try:
        previous = {s: signal.signal(s, _record) for s in STOP_SIGNALS}
    except ValueError:  # not the main thread
        yield
        return
    try:
        check()
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if previous[signal.SIGINT] is not _record:
            _received.clear()
            _answered.clear()


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
    if _received and not _answered:
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
