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
from pathlib import Path

from ..errors import OutputError
from .manifest import STATE_DIR

LOCK_NAME = "lock"
# A reader's probe holds the lock in shared mode for microseconds; a writer that finds it taken
# looks again for this long before it concludes that another writer holds it.
PROBE_GRACE_S = 0.25


def lock_path(out: Path) -> Path:
    return Path(out) / STATE_DIR / LOCK_NAME


def _read_record(fd: int) -> dict | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def describe(record: dict | None) -> str:
    """'pid 123 on host, started 2025-01-01T10:00:00+00:00' (or what is known of it)."""
    if not record:
        return "holder unknown: its record is not written yet"
    return f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}"


class OutLock:
    """The exclusive writer lock on OUT, as a context manager. Creates OUT and its state folder if
    needed; on release removes what only the lock needed (a state folder holding nothing but the
    lock file, and OUT itself if this lock created it and it is empty)."""

    def __init__(self, out: Path):
        self.out = Path(out)
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
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise OutputError(f"{self.out}: cannot create {self.path.relative_to(self.out)} ({e.strerror}); "
                                  f"choose a directory you can write") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record(fd)
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                raise OutputError(f"{self.out} is locked by another writer ({describe(record)}); wait for it to "
                                  f"finish or stop it, then run again") from None
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
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self.fd is None:
            return
        state = self.path.parent
        if state.is_dir() and [p.name for p in state.iterdir()] == [LOCK_NAME]:
            self.path.unlink()  # under the lock: a waiting opener sees the file changed and retries
            state.rmdir()
            if self.created_out and not any(self.out.iterdir()):
                self.out.rmdir()
        else:
            os.ftruncate(self.fd, 0)  # a clean release leaves no holder record behind
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "OutLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_of(out: Path) -> str | None:
    """Who holds OUT's writer lock (see `describe`), or None. Takes nothing: a shared probe that is
    dropped at once, and no file is created."""
    try:
        fd = os.open(lock_path(out), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return describe(_read_record(fd))
    finally:
        os.close(fd)  # also drops the probe's shared lock
    return None


def refuse_if_written(out: Path, command: str) -> None:
    """OutputError when a `convert` holds OUT: its files are not finished, so not damaged either."""
    holder = writer_of(out)
    if holder is not None:
        raise OutputError(f"{out} is being written by lucifer-shard convert ({holder}); run {command} when it "
                          f"has finished")
