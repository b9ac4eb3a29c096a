"""One writer per output directory: an exclusive kernel lock on OUT/.lucifer/lock.

`convert` takes the lock before it reads or removes anything in OUT and holds it until it
returns. The kernel drops the lock of a process that dies (`flock`), so a stale lock cannot
block anyone: the next writer simply gets it, and finds the dead holder's record. The lock file
holds that record (pid, host, start time) as one JSON line, written by the holder once it has the
lock and emptied when it lets go cleanly, so a refusal can say who is writing and a takeover can
say who died. Readers (`verify`, `diff`, `inspect`, `check-numerics`, the vLLM loader) probe the
lock with a shared non-blocking lock that they drop at once, to say "being written" instead of
reporting a half-written output as damaged.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import COMMAND_AGAIN, SAME_COMMAND, EnvironmentRefused, Locked, OutputError
from ..guarded_io import Refused, Tree, remove_empty_dir
from ..outnames import STATE_DIR

LOCK_NAME = "lock"
# A reader's probe holds the lock in shared mode for microseconds; a writer that finds it taken
# looks again for this long before it concludes that another writer holds it.
PROBE_GRACE_S = 0.25


LOCK_REL = f"{STATE_DIR}/{LOCK_NAME}"


def lock_path(out: Path) -> Path:
    return Path(out) / STATE_DIR / LOCK_NAME


def _read_record(fd: int) -> dict | None:
    """The holder record in the lock file, or None when there is none or it is not one (any JSON
    of another shape, a torn line: the lock itself is what counts)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _shared(fd: int) -> bool:
    """Whether the lock `fd` could not take exclusively is held only shared (by readers)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True  # the caller closes fd, which drops this shared lock


def describe(record: dict | None) -> str:
    """'pid 123 on host, started 2025-01-01T10:00:00+00:00' (or what is known of it)."""
    if not record:
        return "holder unknown: its record is not written yet"
    pid, host, started = (_shown(record.get(k)) for k in ("pid", "host", "started"))
    return f"pid {pid} on {host}, started {started}"


def _shown(value: object) -> str:
    """A record field as one short line (a record of another shape is still described, not trusted)."""
    return " ".join(str(value).split())[:80]


class OutLock:
    """The exclusive writer lock on OUT, as a context manager. Creates OUT and its state folder if
    needed; on release removes what only the lock needed (a state folder holding nothing but the
    lock file, and OUT itself if this lock created it and it is empty). The lock file is opened
    through `guarded_io.Tree.open_own`: a lock or state folder that is a link, a FIFO or a hard
    link to a file elsewhere is refused by name, never truncated."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.tree = Tree(self.out)
        self.path = lock_path(self.out)
        self.fd: int | None = None
        self.created_out = False
        self.previous: dict | None = None  # the record of a holder that died holding the lock

    def acquire(self) -> "OutLock":
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"{self.out} exists and is not a directory; choose a directory for OUT")
        self.created_out = not self.out.exists()
        deadline = time.monotonic() + PROBE_GRACE_S
        while True:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                fd = self.tree.open_own(LOCK_REL, os.O_RDWR)
            except Refused as e:
                raise OutputError(f"refusing OUT: {e}") from None
            except OSError as e:  # a read-only or unwritable OUT: the machine's refusal, one kind everywhere
                raise EnvironmentRefused(f"{self.out}: cannot create {LOCK_REL} ({e.strerror}); "
                                         f"choose a directory you can write") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record(fd)
                read_only = _shared(fd)  # held shared past a probe's grace: a stage copying OUT
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                if read_only:
                    raise Locked(f"{self.out} is being read by lucifer-shard stage",
                                 remedy=SAME_COMMAND.after("wait for it to finish")) from None
                raise Locked(f"{self.out} is locked by another writer ({describe(record)})",
                             remedy=SAME_COMMAND.after("wait for it to finish or stop it")) from None
            if self._same_file(fd):
                break
            os.close(fd)  # a previous holder removed the file between our open and lock: take the new one
        self.fd = fd
        self.previous = _read_record(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return self

    def _same_file(self, fd: int) -> bool:
        st = self.tree.lstat(LOCK_REL)
        mine = os.fstat(fd)
        return st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self.fd is None:
            return
        if list(self.tree.entries(STATE_DIR)) == [LOCK_NAME]:
            self.tree.remove(LOCK_REL)  # under the lock: a waiting opener sees the file changed and retries
            self.tree.remove_dir(STATE_DIR)
            if self.created_out and not self.tree.entries():
                remove_empty_dir(self.out)
        else:
            os.ftruncate(self.fd, 0)  # a clean release leaves no holder record behind
        fd, self.fd = self.fd, None  # before the close: never closed twice, even if the close fails
        os.close(fd)

    def __enter__(self) -> "OutLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_of(out: Path) -> str | None:
    """Who holds OUT's writer lock (see `describe`), or None. Takes nothing: a shared probe that is
    dropped at once, and no file is created (nor a link followed: no writer holds such a lock)."""
    try:
        fd = Tree(out).open_read(LOCK_REL)
    except (OSError, Refused):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return describe(_read_record(fd))
    finally:
        os.close(fd)  # also drops the probe's shared lock
    return None


@contextmanager
def reading(out: Path, command: str) -> Iterator[None]:
    """OUT's writer lock held shared while `command` reads OUT (stage: for the whole of its copy), so
    that no convert starts rewriting it meanwhile; Locked when a convert holds it now. Creates
    nothing: an OUT without a state folder (copied without `.lucifer/`) has no writer to wait for."""
    try:
        fd = Tree(out).open_read(LOCK_REL)
    except (FileNotFoundError, NotADirectoryError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Locked(f"{out} is being written by lucifer-shard convert ({describe(_read_record(fd))})",
                         remedy=COMMAND_AGAIN.at(command=command).after("wait for it to finish")) from None
        yield
    finally:
        os.close(fd)  # drops the shared lock


def refuse_if_written(out: Path, command: str) -> None:
    """OutputError when a `convert` holds OUT: its files are not finished, so not damaged either."""
    holder = writer_of(out)
    if holder is not None:
        raise Locked(f"{out} is being written by lucifer-shard convert ({holder})",
                     remedy=COMMAND_AGAIN.at(command=command).after("wait for it to finish"))
