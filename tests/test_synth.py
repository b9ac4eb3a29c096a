"""synth: schema-exact synthetic checkpoints, deterministic, loadable by safetensors."""
from __future__ import annotations

import json

import numpy as np
import torch
import pytest
from safetensors import safe_open

from helpers import run
from lucifer_shard.engine.synth import synth
from lucifer_shard.model.tensorspecs import expected_sources
from lucifer_shard.source.checkpoint import open_checkpoint


def _keys_and_types(root):
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    found = {}
    for name in sorted(set(index.values())):
        with safe_open(str(root / name), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                found[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return index, found


def test_tiny_matches_the_schema_exactly(tiny_pattern, tiny_cfg):
    index, found = _keys_and_types(tiny_pattern)
    want = expected_sources(tiny_cfg)
    assert set(found) == set(want) == set(index)
    for key, (shape, dtype) in found.items():
        assert (shape, dtype) == (want[key].shape, want[key].dtype), key
    assert len(set(index.values())) >= 4  # several shards
    kinds = {("tid2eid" in k, "indexer" in k, ".compressor.ape" in k) for k in found}
    assert (True, False, False) in kinds and (False, True, False) in kinds
    # the layers cover hash routing, C4 (compressor + indexer), C128 and a sliding-window-only layer
    assert "layers.0.ffn.gate.tid2eid" in found and "layers.1.ffn.gate.bias" in found
    assert found["layers.2.attn.compressor.ape"][0] == (4, 256) and "layers.2.attn.indexer.wq_b.weight" in found
    assert found["layers.3.attn.compressor.ape"][0] == (128, 128) and "layers.3.attn.indexer.wq_b.weight" not in found
    assert not any(k.startswith("layers.1.attn.compressor") for k in found)
    assert "mtp.0.ffn.experts.7.w2.scale" in found and "mtp.0.e_proj.scale" in found
    assert found["embed.weight"][0] == (1000, 256) and 1000 % 3


@pytest.mark.parametrize("fill", ["pattern", "random"])
def test_same_seed_is_byte_identical(tmp_path, fill):
    a = synth("tiny", tmp_path / "a", fill=fill, seed=3, progress=False)
    b = synth("tiny", tmp_path / "b", fill=fill, seed=3, progress=False)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_random_fill_values_are_valid(tiny_random):
    ckpt = open_checkpoint(tiny_random)
    for key, entry in ckpt.tensors.items():
        t = ckpt.read(key, tuple(slice(None) for _ in entry.shape))
        if entry.dtype == "F8_E8M0":
            b = t.view(torch.uint8).numpy()
            assert b.max() < 0xFF and b.min() > 0, key
        elif entry.dtype == "F8_E4M3":
            assert np.isfinite(t.float().numpy()).all(), key
        elif entry.dtype == "I64":
            assert t.min() >= 0 and t.max() < ckpt.config.n_experts
        elif entry.dtype in ("BF16", "F32"):
            assert np.isfinite(t.float().numpy()).all(), key


def test_pattern_fill_never_writes_ff(tiny_pattern):
    ckpt = open_checkpoint(tiny_pattern)
    key = "layers.3.ffn.experts.0.w2.scale"
    b = ckpt.read(key, (slice(None), slice(None))).view(torch.uint8).numpy()
    assert b.max() < 0xFF and len(np.unique(b)) > 200


# ---------------------------------------------------------------- OUT and file modes (issue 27)


@pytest.mark.parametrize("make, named", [
    (lambda p: p.write_text("x\n"), "is a regular file"),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine\n")), "not empty (notes.txt)"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{}\n")), "holds a checkpoint (config.json)"),
    (lambda p: (p.mkdir(), (p / "lucifer-manifest.json").write_text("{}\n"), (p / "COMPLETE").write_text("x\n")),
     "holds a lucifer-shard output (COMPLETE, lucifer-manifest.json)"),
    (lambda p: p.symlink_to(p.parent / "nowhere"), "is a symlink to nothing"),
])
def test_synth_refuses_an_out_that_is_not_absent_or_empty(tmp_path, make, named):
    out = tmp_path / "out"
    make(out)
    before = sorted((q.name, q.read_bytes()) for q in out.iterdir()) if out.is_dir() else None
    r = run("synth", "tiny", out)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert line.startswith(f"error: OUT {out}: ") and named in line and "\n" not in line, line
    assert (sorted((q.name, q.read_bytes()) for q in out.iterdir()) if out.is_dir() else None) == before


def test_synth_refusal_kind_is_output(tmp_path):
    import json as _json
    (tmp_path / "afile").write_text("x\n")
    r = run("synth", "tiny", tmp_path / "afile", "--json")
    assert r.exit_code == 2 and _json.loads(r.stdout)["error"]["kind"] == "output", r.output


def test_synth_into_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert run("synth", "tiny", tmp_path / "empty", "-q").exit_code == 0
    assert (tmp_path / "empty" / "config.json").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_every_file_written_is_0666_minus_umask(tmp_path, umask):
    """synth's shards, convert's rank files, copies, manifest, COMPLETE, journal, record and lock
    alike: created like ordinary files (0666 & ~umask), folders 0777 & ~umask."""
    import os
    import stat

    from lucifer_shard.engine.convert import convert
    from lucifer_shard.model.options import Options

    old = os.umask(umask)
    try:
        model = synth("tiny", tmp_path / "model", progress=False)
        convert(str(model), tmp_path / "out", Options(tp=3), progress=False)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode) for p in tmp_path.rglob("*")}
    want = {rel: (0o777 if (tmp_path / rel).is_dir() else 0o666) & ~umask for rel in modes}
    assert "out/.lucifer/journal.jsonl" in modes and "out/.lucifer/lock" in modes
    assert {rel: oct(m) for rel, m in modes.items() if m != want[rel]} == {}


def test_synth_checks_the_room_before_writing(tmp_path, monkeypatch):
    """Issue 43 finding 15: `synth flash-layer --layers 40` ran a shared disk full before it cleaned up; now
    the preset's bytes (engine/presets.py) are checked against the filesystem first, kind no_room, and
    nothing is created."""
    from lucifer_shard.engine import diskspace
    from lucifer_shard.engine.presets import preset_bytes

    need = preset_bytes("flash-layer", 40)
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: need // 2)
    out = tmp_path / "big"
    r = run("synth", "flash-layer", out, "--layers", "40", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["error"]["kind"] == "no_room", r.output
    assert f"({need:,} bytes: checkpoint shards and JSON files)" in doc["error"]["message"]
    assert "then run synth flash-layer again" in doc["error"]["message"] and not out.exists()


@pytest.mark.parametrize("preset", ["tiny", "dspark"])
def test_the_preset_bytes_synth_names_are_what_it_writes(tmp_path, preset):
    """The room check's (and the help's) bytes: at least what synth writes, within 128 KiB of it (the bound on
    the headers and JSON files)."""
    from lucifer_shard.engine.presets import preset_bytes
    from lucifer_shard.units import size

    out = synth(preset, tmp_path / preset, progress=False)
    written = sum(p.stat().st_size for p in out.iterdir())
    assert 0 <= preset_bytes(preset) - written <= 64 << 10 << 1, (preset_bytes(preset), written)
    assert f"writes {size(preset_bytes(preset))}" in run("synth", "--help").stdout


@pytest.mark.parametrize("preset, layers, reads", [("flash-0731-layer", 2, [0, 1]), ("flash-0731-layer", None, [0]),
                                                   ("flash-0731-layer", 5, [2, 3, 4]), ("dspark", 2, [0, 1])])
def test_a_truncated_dspark_drafter_reads_the_last_decoder_layers(preset, layers, reads):
    """flash-0731-layer (the GPU runs' Flash geometry with 0731's DSpark drafter, too large to write here):
    its schema at Flash size, three DSpark stages with all 256 experts; a truncated decoder's drafter reads
    its last layers, as 0731's reads layers 40-42 of 43, so vLLM's aux-state capture stays inside it."""
    from lucifer_shard.engine.presets import preset_bytes, preset_config
    from lucifer_shard.model.config import DSPARK, parse_config

    raw = preset_config(preset, layers)
    cfg = parse_config(raw, preset)
    assert raw["dspark_target_layer_ids"] == reads and cfg.draft_kind == DSPARK
    assert len(raw["compress_ratios"]) == cfg.num_layers + 3  # the three stages keep their ratios
    if preset == "flash-0731-layer":
        want = expected_sources(cfg)
        assert (cfg.hidden_size, cfg.n_experts, raw["dspark_markov_rank"]) == (4096, 256, 256)
        assert "mtp.2.ffn.experts.255.w2.weight" in want and f"layers.{cfg.num_layers}.attn_norm.weight" not in want
        # three Flash-size stages where flash-layer has one MTP layer
        assert preset_bytes(preset, 2) - preset_bytes("flash-layer", 2) > 2 * 3 << 30
