"""The `forward` synth preset: tiny's padded axes with the geometry vLLM's DeepSeek-V4 CPU kernels
require (tests/forward runs it through vLLM); here only that it is schema-exact and that convert and
diff take it at TP 1, 2 and 3, like every other preset."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from lucifer_shard.engine.convert import convert
from lucifer_shard.engine.synth import PRESETS, preset_config, synth
from lucifer_shard.model.config import parse_config
from lucifer_shard.model.options import Options
from lucifer_shard.model.tensorspecs import expected_sources
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.proof.diff import diff
from lucifer_shard.proof.verify import verify
from lucifer_shard.source.checkpoint import open_checkpoint

from helpers import scratch


@pytest.fixture(scope="module")
def forward_model(tmp_path_factory) -> Iterator[Path]:
    with scratch(tmp_path_factory, "forward") as root:
        yield synth("forward", root / "model", fill="pattern", progress=False)


def test_forward_differs_from_tiny_only_where_the_cpu_kernels_need_it():
    tiny, fwd = preset_config("tiny"), preset_config("forward")
    changed = {k for k in tiny if tiny[k] != fwd.get(k)} | (set(fwd) - set(tiny))
    assert changed == {"head_dim", "index_topk", "n_routed_experts"}
    # flash_mla_with_kvcache_cpu: q must be [num_tokens, num_heads, 512]; topk_transform_512_cpu
    # only supports index_topk == 512; hash_topk_cpu / biased_topk_cpu take 64, 128, 256 or 384 experts
    assert (fwd["head_dim"], fwd["index_topk"], fwd["n_routed_experts"]) == (512, 512, 64)
    # tiny's real padded axes: 64 heads, 8 groups, 2048 routed and shared width, vocab not divisible by 3
    assert (fwd["num_attention_heads"], fwd["o_groups"], fwd["moe_intermediate_size"]) == (64, 8, 2048)
    assert fwd["vocab_size"] % 3 != 0


def test_cli_offers_every_preset():
    from lucifer_shard.cli import cli

    choices = cli.commands["synth"].params[0].type.choices
    assert list(choices) == list(PRESETS)


def test_forward_matches_the_schema(forward_model):
    cfg = parse_config(preset_config("forward"))
    ckpt = open_checkpoint(forward_model)
    want = expected_sources(cfg)
    assert set(ckpt.tensors) == set(want)
    for key, entry in ckpt.tensors.items():
        assert (tuple(entry.shape), entry.dtype) == (want[key].shape, want[key].dtype), key
    assert "layers.1.ffn.experts.63.w2.weight" in ckpt.tensors and "mtp.0.ffn.experts.63.w1.scale" in ckpt.tensors
    size = sum(f.stat().st_size for f in forward_model.glob("*.safetensors"))
    assert 200e6 < size < 400e6  # small enough for CI (about 311 MB)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_forward_converts_and_diffs(forward_model, tmp_path, tp):
    out = tmp_path / "out"
    convert(str(forward_model), out, Options(tp=tp, arch="sm120", expert_layout="model"), progress=False)
    report = diff(out, str(forward_model), progress=False)
    assert report.ok, report.problem_lines()
    assert report.stats["source_tensors"] == report.stats["source_total"]
    assert verify(out, progress=False).ok
    assert json.loads((out / MANIFEST_NAME).read_text())["tp_size"] == tp
