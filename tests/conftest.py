"""Shared fixtures: synthetic checkpoints and their conversions, built once per test session."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lucifer_shard.engine.convert import convert
from lucifer_shard.engine.synth import preset_config, synth
from lucifer_shard.spec.config import parse_config
from lucifer_shard.spec.manifest import Options

from helpers import CONFIGS


@pytest.fixture(scope="session")
def flash_cfg():
    return parse_config(json.loads((CONFIGS / "deepseek-v4-flash.json").read_text()))


@pytest.fixture(scope="session")
def tiny_cfg():
    return parse_config(preset_config("tiny"))


@pytest.fixture(scope="session")
def tiny_pattern(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("tiny-pattern") / "model", fill="pattern", progress=False)


@pytest.fixture(scope="session")
def tiny_random(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("tiny-random") / "model", fill="random", seed=7, progress=False)


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

    return get
