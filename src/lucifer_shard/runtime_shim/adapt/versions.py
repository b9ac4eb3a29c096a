"""Installed distributions' versions, read from their metadata without importing them (the loader and doctor)."""
from __future__ import annotations

import importlib.metadata as md


def dist_version(name: str) -> str | None:
    """The installed version of distribution NAME, or None."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
