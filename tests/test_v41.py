"""DeepSeek-V4.1-Flash: `plan` reads its nested config and shows each rank's GPU and host bytes; `convert`
refuses it in one line and writes nothing."""
from __future__ import annotations

import json
import shutil

import pytest


from helpers import CONFIGS, REPO, run
from lucifer_shard.model import boxfit, v41

CONFIG = CONFIGS / "deepseek-v4.1-flash.json"
# From the V4.1 tensor inventory (the team's checkpoint notes): TP3 routed-expert bytes per rank, main model
# and drafter, exactly a third; each rank's Engram rows times 264 bytes (rank 0 and rank 2).
ROUTED_TP3 = 96_259_276_800 + 2_406_481_920
ENGRAM_TP3 = (67_585_364_880, 67_586_622_048)


def test_tp3_bytes_per_rank():
    r = v41.rank_bytes(json.loads(CONFIG.read_text()), 3)
    assert r.gpu["routed experts"] == ROUTED_TP3
    assert ENGRAM_TP3[0] <= r.host <= ENGRAM_TP3[1]
    assert 96.5 < r.gpu_total / 2**30 < 97.0  # the inventory's 96.91 GiB less the compressors and indexer
    # GPU weights, and on the Spark's unified memory the Engram tables too: only the H200 has room left
    assert [f.fits for f in boxfit.fits(r.gpu_total, None, r.host)] == [False, False, False, True]
    assert [b.name for b in boxfit.BOXES] == ["DGX Spark (GB10)", "RTX PRO 6000", "H100", "H200"]


def test_plan_shows_gpu_and_host_bytes_and_the_boxes():
    r = run("plan", "--tp", "3", str(CONFIG))
    assert r.exit_code == 0, r.output
    assert "not convertible yet" in r.output and "an estimate" in r.output
    assert "    3      96.69 GiB                62.94 GiB" in r.output
    rows = {line.split()[0]: line for line in r.output.splitlines() if line.startswith(("  DGX Spark (", "  H200 "))}
    assert "fits (tokens not modelled)" in rows["H200"] and "does not fit" in rows["DGX"]
    doc = (REPO / "docs" / "deepseek-v4.1.md").read_text()
    for figure in ("27.97 GiB", "13.25", "28.35 GiB short", "51.32 GiB short"):  # what the doc quotes of this table
        assert figure in r.output and figure.removesuffix(" short") in doc, figure
    doc = json.loads(run("plan", "--tp", "3", str(CONFIG), "--json").output)["result"]
    assert doc["convertible"] is False and doc["per_tp"]["3"]["host_bytes"] > 0
    assert [b["fits"] for b in doc["fit"]["boxes"]] == [False, False, False, True] and doc["fit"]["kv_cache"] is None


def test_convert_refuses_it_in_one_line_and_writes_nothing(tmp_path):
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    shutil.copy(CONFIG, model / "config.json")
    r = run("convert", "--tp", "3", str(model), str(out))
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "DeepSeek-V4.1-Flash (model_type 'deepseek_v41') is not supported yet" in line
    assert "lucifer-shard plan --tp 3 config.json" in line and not out.exists()


def _edited(tmp_path, **text):
    """The V4.1 config with `text_config` fields set (a value None: the field removed)."""
    cfg = json.loads(CONFIG.read_text())
    for k, v in text.items():
        if v is None:
            del cfg["text_config"][k]
        else:
            cfg["text_config"][k] = v
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("fields", [
    {"num_attention_heads": 0}, {"hidden_size": [5120]}, {"hidden_size": True}, {"engram_num_embeddings": 7},
    {"engram_num_embeddings": ["a", "b"]}, {"head_dim": 0, "o_groups": 0}, {"dspark_n_routed_experts": [1, 2]},
    {"n_routed_experts": -384}, {"o_groups": 7}, {"vocab_size": None}, {"engram_layer_ids": "1,14"},
], ids=str)
def test_plan_refuses_each_field_out_of_its_type_or_range_in_one_line(tmp_path, fields):
    """Issue 52 Q: V4.1 configs go through a typed, bounded schema (v41.FIELDS) as V4's do: kind source,
    exit 2, the field named; on main these exited 70 (ZeroDivisionError, TypeError) or planned negative sizes."""
    r = run("plan", "--tp", "3", str(_edited(tmp_path, **fields)), "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["error"]["kind"] == "source", r.output
    assert "\n" not in doc["error"]["message"] and "text_config" in doc["error"]["message"], doc["error"]
