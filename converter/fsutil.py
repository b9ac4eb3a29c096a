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


def _publish(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    _publish(tmp, path)


def atomic_copy(src: Path, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    shutil.copyfile(src, tmp)
    _publish(tmp, path)
