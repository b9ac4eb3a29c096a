"""doctor's SM12x kernel lines (runtime_shim/serving/kernels.py) against vLLM 0.34.0's own requirement and the
installed FlashInfer 0.7.4's real DSV4 sparse-MLA decode dispatch, and against a build without that dispatch
(the module hidden: what an older FlashInfer is to vLLM's probe)."""
from __future__ import annotations

import sys

import pytest

from lucifer_shard.output.manifest_types import Manifest
from lucifer_shard.runtime_shim.checks import FAIL, OK
from lucifer_shard.runtime_shim.manifest import Output
from lucifer_shard.runtime_shim.serving import kernels
from shim_fixtures import cli

DISPATCH = "flashinfer.mla._sparse_mla_sm120"


@pytest.fixture(scope="module")
def out_dspark(tmp_path_factory):
    base = tmp_path_factory.mktemp("dspark")
    cli("synth", "dspark", str(base / "model"), "--quiet")
    cli("convert", "--tp", "3", "--arch", "sm121", str(base / "model"), str(base / "out"), "--quiet")
    return base / "out"


def _vllm_probe_caches_cleared():
    """vLLM caches its FlashInfer probes (functools.cache): cleared, they look again."""
    from vllm.utils import flashinfer

    for name in ("has_flashinfer", "has_flashinfer_sparse_mla_sm120", "has_flashinfer_sparse_mla_sm120_config"):
        getattr(getattr(flashinfer, name), "cache_clear", lambda: None)()


def test_flashinfer_074s_table_admits_the_target_and_the_dspark_draft(out_dspark):
    m = Manifest.load(out_dspark)
    checks = kernels.sparse_mla_checks(Output(out_dspark, m), None, draft=True)  # no GPU here: OUT's --arch, sm121
    assert [c.status for c in checks] == [OK, OK], checks
    assert "24 heads per rank padded to 32, top_k 128 (the target, sm121)" in checks[0].detail
    assert "top_k 192 (the DSpark draft, k=5, sm121)" in checks[1].detail  # 128 + 5, rounded up to 64
    assert "k=1" in kernels.sparse_mla_checks(Output(out_dspark, m), None, draft=True, tokens=1)[1].detail


def test_a_flashinfer_without_the_dispatch_fails_with_the_fix(out_dspark, monkeypatch):
    m = Manifest.load(out_dspark)
    monkeypatch.setitem(sys.modules, DISPATCH, None)  # an import of it now fails, as on a FlashInfer without it
    _vllm_probe_caches_cleared()
    try:
        checks = kernels.sparse_mla_checks(Output(out_dspark, m), "sm120", draft=False)
    finally:
        monkeypatch.undo()
        _vllm_probe_caches_cleared()
    assert [c.status for c in checks] == [FAIL], checks
    assert "does not admit 24 heads per rank padded to 32, top_k 128" in checks[0].detail
    assert checks[0].fix == kernels.FIX


def test_no_line_where_the_family_needs_no_such_kernel(out_kernel):
    m = Manifest.load(out_kernel)
    assert kernels.sparse_mla_checks(Output(out_kernel, m), "sm90", draft=False) == []
    assert [c.status for c in kernels.sparse_mla_checks(Output(out_kernel, m), None, draft=False)] == [OK]  # sm120's files


def test_doctor_shows_the_line(out_dspark):
    from lucifer_shard.runtime_shim.serving import doctor

    checks = doctor.doctor_report(out_dspark, mtp=True)
    assert [c.status for c in checks if c.name == kernels.NAME] == [OK, OK], [str(c) for c in checks]
