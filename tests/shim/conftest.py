"""Runtime-shim tests: run against the real vLLM release in the venv made by tools/vllm-env.sh (0.34.0 by default,
LUCIFER_VLLM_VERSION for another vetted one; `vet` runs the stock proofs on a candidate release).

Every test here carries the marker `vllm`; the main environment (no vLLM) deselects them with
`-m 'not gpu and not vllm'`. Run them with `bash tools/vllm-env.sh pytest -q tests/shim -m vllm`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs a vLLM test venv (tools/vllm-env.sh)")
    from shim_fixtures import allow_vet_candidate

    allow_vet_candidate()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def shim_base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shim")


@pytest.fixture(scope="session")
def out_kernel(shim_base) -> Path:
    """`lucifer-shard synth tiny` + `convert --tp 3` (sm120, experts in kernel layout, with MTP)."""
    from shim_fixtures import convert_tiny

    return convert_tiny(shim_base)


@pytest.fixture(scope="session")
def out_model(shim_base) -> Path:
    """The same source converted with --expert-layout model (another conversion id)."""
    from shim_fixtures import convert_tiny

    return convert_tiny(shim_base, "--expert-layout", "model")


@pytest.fixture(scope="session")
def shim():
    """vLLM imported and the plugin registered in this process."""
    import lucifer_shard.runtime_shim as rs

    rs.register()
    assert rs.registration_error() is None, rs.registration_error()
    return rs


@pytest.fixture
def tp_world(monkeypatch, shim):
    """Pretend this process is TP rank `rank` of `size` in vLLM's parallel state (in-process tests)."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state as ps

    def set_world(size=3, rank=0, pp=1):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: size)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(world_size=pp))
        for g in ("get_dp_group", "get_pcp_group"):
            if hasattr(ps, g):
                monkeypatch.setattr(ps, g, lambda: SimpleNamespace(world_size=1))

    set_world()
    return set_world
