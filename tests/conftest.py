"""Shared fixtures: synthetic checkpoints and their conversions, built once per test session, removed at its end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from lucifer_shard.engine.convert import convert
from lucifer_shard.engine.synth import preset_config, synth
from lucifer_shard.model.config import parse_config
from lucifer_shard.model.options import Options

from helpers import CONFIGS, scratch
from skiplog import pytest_runtest_logreport  # noqa: F401  (the hook: make test's list of what it did not prove)


@pytest.fixture(scope="session")
def flash_cfg():
    return parse_config(json.loads((CONFIGS / "deepseek-v4-flash.json").read_text()))


@pytest.fixture(scope="session")
def tiny_cfg():
    return parse_config(preset_config("tiny"))


@pytest.fixture(scope="session")
def tiny_pattern(tmp_path_factory) -> Iterator[Path]:
    with scratch(tmp_path_factory, "tiny-pattern") as root:
        yield synth("tiny", root / "model", fill="pattern", progress=False)


@pytest.fixture(scope="session")
def tiny_random(tmp_path_factory) -> Iterator[Path]:
    with scratch(tmp_path_factory, "tiny-random") as root:
        yield synth("tiny", root / "model", fill="random", seed=7, progress=False)


@pytest.fixture(scope="session")
def converted(tmp_path_factory, tiny_pattern):
    """converted(tp=3, arch=..., ...) -> OUT of `tiny --fill pattern`, converted once per option set."""
    cache: dict[Options, Path] = {}

    def get(source: Path | None = None, **kw) -> Path:
        options = Options(**{"tp": 3, **kw})
        src = source or tiny_pattern
        key = (src, options)
        if key not in cache:
            out = tmp_path_factory.mktemp("out") / "out"
            convert(str(src), out, options, progress=False)
            cache[key] = out
        return cache[key]

    yield get
    for out in cache.values():
        shutil.rmtree(out.parent, ignore_errors=True)
