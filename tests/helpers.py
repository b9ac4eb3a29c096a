"""Test helpers: read tensors as raw bytes with the safetensors library itself; scratch folders for fixtures;
the repository's scripts imported by path."""
from __future__ import annotations

import importlib.util
import shutil
from contextlib import contextmanager
from types import ModuleType
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def script_module(rel: str) -> ModuleType:
    """A script of the repository that is no package module (bench/, tools/), imported from its path."""
    path = REPO / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as uint8, last dim in bytes."""
    t = t.contiguous()
    return t.view(torch.uint8).numpy().reshape(*t.shape[:-1], -1)


class Source:
    """The source checkpoint through its index json."""

    def __init__(self, root: Path):
        import json

        self.root = Path(root)
        self.map = json.loads((self.root / "model.safetensors.index.json").read_text())["weight_map"]

    def get(self, key: str) -> np.ndarray:
        with safe_open(str(self.root / self.map[key]), "pt") as f:
            return raw(f.get_tensor(key))


def rank_tensors(out: Path, role: str, rank: int) -> dict[str, np.ndarray]:
    """Every tensor of one rank's files, as bytes."""
    tensors = {}
    for path in sorted((Path(out) / role / f"rank-{rank}").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                tensors[k] = raw(f.get_tensor(k))
    return tensors


@contextmanager
def scratch(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A tmp_path_factory folder for a module- or session-scoped fixture, removed at its teardown: pytest's
    retention policy removes only tmp_path's folders as tests pass, the rest only with its own base temp."""
    path = tmp_path_factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
