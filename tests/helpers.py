"""Test helpers: the CLI run in this process or in a fresh one, and its one error line; read tensors as raw
bytes with the safetensors library itself; scratch folders for fixtures; the repository's scripts imported
by path."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from types import ModuleType
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "src" / "lucifer_shard" / "configs"


def run(*args: object, catch_exceptions: bool = False, **kw):
    """`lucifer-shard ARGS` in this process (click's CliRunner), each argument as a string. An exception the
    CLI does not turn into its one error line fails the test, unless `catch_exceptions` keeps it in the
    result; `kw` go to `invoke` (input, env)."""
    from click.testing import CliRunner

    from lucifer_shard.cli.group import cli

    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=catch_exceptions, **kw)


def cli_argv(*args: object) -> list[str]:
    """`lucifer-shard ARGS` as a fresh interpreter's command line."""
    return [sys.executable, "-m", "lucifer_shard.cli", *map(str, args)]


def run_process(*args: object, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """`lucifer-shard ARGS` in a fresh interpreter, its output captured as text: for what reads the
    environment at import, a limit set before it starts, a kill (`kw` go to subprocess.run). With `check`,
    a failed run fails the test with the end of its stderr."""
    r = subprocess.run(cli_argv(*args), capture_output=True, text=True, **kw)
    if check and r.returncode:
        raise AssertionError(f"lucifer-shard {' '.join(map(str, args))} exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def one_error(r, code: int | tuple[int, ...] | None = 2, *needles: str, alone: bool = False,
              internal: bool = False) -> str:
    """A run (a click Result or a CompletedProcess) that ended with `code` (or one of them; None: any
    failure) and exactly one `error: ` line on stderr: no traceback, no internal error (unless `internal`:
    the line of one, exit 70, is what the test provokes), no click usage block; each of `needles` in that
    line, which is returned. `alone`: nothing else printed, on stdout or stderr."""
    got = r.exit_code if hasattr(r, "exit_code") else r.returncode
    text = r.stdout + r.stderr
    assert got not in (0, None) if code is None else got in (code if isinstance(code, tuple) else (code,)), (got, text)
    assert "Traceback" not in text and (internal or "internal error" not in text), text
    assert not re.search(r"^(Usage:|Error:|Try ')", r.stderr, re.M), r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text
    if alone:
        assert text.strip() == errors[0], text
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


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


def own_copy(out: Path, dst: Path) -> Path:
    """A session output hard-linked into `dst`, for a test that starts `serve` on it: a start writes
    OUT/kernel-cache/, which the session's output, shared by every test, must not gain. Absolute, as serve
    names OUT."""
    shutil.copytree(out, dst, copy_function=os.link)
    return dst.resolve()


@contextmanager
def scratch(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A tmp_path_factory folder for a module- or session-scoped fixture, removed at its teardown: pytest's
    retention policy removes only tmp_path's folders as tests pass, the rest only with its own base temp."""
    path = tmp_path_factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
