"""vLLM's own plugin machinery finds the entry point and resolves --load-format lucifer_tp3."""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, sys
import lucifer_shard.runtime_shim as rs
light = [m for m in ("vllm", "torch") if m in sys.modules]
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
try:
    loader = get_model_loader(LoadConfig(load_format="LUCIFER_TP3"))
    name = type(loader).__module__ + "." + type(loader).__qualname__
except ValueError as e:
    name = "ValueError: " + str(e)
print(json.dumps({"heavy_at_import": light, "loader": name, "registered": rs._state["registered"]}))
"""


def _probe(**env):
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllm_plugin_loader_finds_entry_point_and_resolves_loader():
    got = _probe()
    assert got["heavy_at_import"] == []  # importing the plugin module imports neither vLLM nor torch
    assert got["registered"] is True
    assert got["loader"] == "lucifer_shard.runtime_shim.load.loader.LuciferTP3Loader"


def test_vllm_plugins_allow_list_excluding_the_plugin_leaves_load_format_unknown():
    got = _probe(VLLM_PLUGINS="some_other_plugin")
    assert got["registered"] is False
    assert got["loader"].startswith("ValueError") and "lucifer_tp3" in got["loader"]


def test_register_is_idempotent_and_get_model_loader_returns_shim(shim):
    from vllm.config import LoadConfig
    from vllm.model_executor import model_loader as ml

    from lucifer_shard.runtime_shim.load.loader import LuciferTP3Loader

    before = dict(ml._LOAD_FORMAT_TO_MODEL_LOADER)
    shim._state["registered"] = False  # force the body to run again
    shim.register()
    shim.register()
    assert ml._LOAD_FORMAT_TO_MODEL_LOADER == before
    assert isinstance(ml.get_model_loader(LoadConfig(load_format="lucifer_tp3")), LuciferTP3Loader)


def test_register_never_raises(monkeypatch, shim):
    import vllm.model_executor.model_loader as ml

    def boom(name):
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(ml, "register_model_loader", boom)
    monkeypatch.setitem(shim._state, "registered", False)
    monkeypatch.delitem(ml._LOAD_FORMAT_TO_MODEL_LOADER, "lucifer_tp3")
    shim.register()  # logs, does not raise
    assert "registry exploded" in shim.registration_error()
    monkeypatch.undo()
    shim._state["registered"] = False
    shim.register()
    assert shim.registration_error() is None
