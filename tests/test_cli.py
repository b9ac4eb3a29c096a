"""The command line: plan output, --json, help texts, and one-line errors for bad input."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from helpers import CONFIGS
from lucifer_shard.cli import cli


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    """A directory holding only the shipped config.json: enough to plan."""
    d = tmp_path_factory.mktemp("flash")
    shutil.copy(CONFIGS / "deepseek-v4-flash.json", d / "config.json")
    return d


def run(*args, **kw):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, **kw)


def test_plan_prints_the_audit_table_and_byte_totals(flash_dir):
    r = run("plan", "--tp", 3, flash_dir)
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[1:] for line in r.output.splitlines()[3:8]}
    assert rows["heads"][:4] == ["64", "72", "24", "24"]
    assert rows["groups"][:4] == ["8", "9", "3", "3"]
    assert rows["routed"][:4] == ["2048", "2112", "704", "768"]
    assert rows["shared"][:4] == ["2048", "2304", "768", "768"]
    assert rows["vocab"][:4] == ["129280", "129408", "43136", "43136"]
    assert "ffn.experts.{e}.w2.weight dim 1: r0 [0,352)+32  r1 [352,704)+32  r2 [704,1024)+64" in r.output
    assert "ffn.experts.{e}.w2.scale dim 1: r0 [0,22)+2  r1 [22,44)+2  r2 [44,64)+4" in r.output
    assert "target rank 0: 1502 tensors, 59,232,049,084 B" in r.output
    assert "draft rank 2: 39 tensors, 1,376,044,556 B" in r.output


def test_plan_json(flash_dir):
    r = run("plan", "--tp", 3, "--arch", "sm90", "--json", flash_dir)
    doc = json.loads(r.output)
    assert doc["moe_variant"] == "FLASHINFER_CUTLASS_MXFP4_BF16"
    t = {x["name"]: x for x in doc["roles"]["target"][2]["tensors"]}
    w2 = t["model.layers.5.ffn.experts.routed_experts.w2_weight"]
    assert w2["sources"] == [{"key": "layers.5.ffn.experts.{e}.w2.weight", "dim": 1, "start": 704, "length": 320,
                              "dst_offset": 0, "segment": 384}]
    assert t["model.layers.5.ffn.experts.routed_experts.w13_weight_scale"]["shape"] == [256, 24, 32, 16, 16]
    assert len(doc["roles"]["draft"]) == 3


def test_plan_any_tp(flash_dir):
    for tp in range(1, 9):
        assert run("plan", "--tp", tp, flash_dir).exit_code == 0


@pytest.mark.parametrize("edit,needle", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type='llama'"),
    ({"o_groups": None}, "missing field(s) o_groups"),
    ({"dspark_config": {}}, "dspark_config"),
    ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries"),
])
def test_bad_config_is_one_line(tmp_path, edit, needle):
    cfg = json.loads((CONFIGS / "deepseek-v4-flash.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    r = CliRunner().invoke(cli, ["plan", "--tp", "3", str(tmp_path)])
    assert r.exit_code == 2 and needle in r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1


def _plan_subprocess(env: dict) -> subprocess.CompletedProcess:
    """huggingface_hub reads its environment at import: run in a fresh process."""
    return subprocess.run([sys.executable, "-m", "lucifer_shard.cli", "plan", "--tp", "3",
                           "deepseek-ai/DeepSeek-V4-Flash"], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_repo_id_offline_without_cache(tmp_path):
    r = _plan_subprocess({"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 2 and "not in the local Hugging Face cache" in r.stderr


def test_repo_id_from_the_cache(tmp_path):
    """A repo id resolves through huggingface_hub's cache layout (models--org--name/snapshots/<rev>), offline."""
    repo = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V4-Flash"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    shutil.copy(CONFIGS / "deepseek-v4-flash.json", snap / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    r = _plan_subprocess({"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 0, r.stderr
    assert "routed        2048      2112       704           768" in r.stdout


def test_help_teaches():
    out = run("--help").output
    for cmd in ("plan", "convert", "synth"):
        assert cmd in out
    assert "--resume" in run("convert", "--help").output
