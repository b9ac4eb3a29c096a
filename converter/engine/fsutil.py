"""Crash-safe file publication: write to a hidden temporary name, fsync, rename, fsync the directory."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(path: Path, write) -> None:
    """`write(tmp)`, fsync, rename to `path`; a failed write (a full disk) leaves no temporary file."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    _publish(path, lambda tmp: tmp.write_text(text))


def atomic_copy(src: Path, path: Path) -> None:
    _publish(path, lambda tmp: shutil.copyfile(src, tmp))
