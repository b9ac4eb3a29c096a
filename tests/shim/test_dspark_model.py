"""DeepSeek-V4-Flash-0731's DSpark drafter in vLLM's own `DSparkDeepseekV4ForCausalLM` (the venv's release).

The source is `synth dspark`: tiny's target and a three-stage DSpark drafter with 0731's config keys
(`dspark_*`, the stale `num_nextn_predict_layers` 1). vLLM builds the draft model exactly as a worker
does for `--speculative-config '{"method":"dspark"}'` (`vllm_cpu_model.py`: the draft model config vLLM's
speculative config derives from the target's, its NVIDIA class told the GPU is 12.0), each run into a
fresh model:

* TP 1 and 2: vLLM's `DefaultModelLoader` from the checkpoint (its own `load_weights`: `_remap_dspark_name`,
  the `context_wkv_proj` duplication, the Markov head, the F32 confidence head) against `lucifer_tp3` from
  the draft rank files: every parameter byte-identical, except the embedding and LM head vLLM aliases
  from the target after loading (neither loader fills them);
* TP3, the plugin's virtual TP (72 heads, 9 groups, experts 2304 wide; 6 routed experts, which vLLM's CPU
  platform asks to divide by 3): `lucifer_tp3` from the rank
  files, every parameter the rank file's tensor; a copy whose rank-0 draft file lost one tensor
  (manifest and file consistent, so only the plugin's key check can see it: vLLM 0.34.0's own loader
  only logs how many it loaded), refused naming it; the output served with method "mtp" (vLLM builds
  DeepSeekV4MTP, which has none of these weights), refused in one line.

vLLM 0.33.0 has the same class (its `load_weights` drops an unloaded confidence head instead of keeping it):
these are stock proofs, run on both vetted releases (`model/runtimes.Build.draft_kinds`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

import shim_fixtures as sf
from lucifer_shard.model.config import DSPARK
from lucifer_shard.model.drafts import owned_by_runtime
from lucifer_shard.model.runtimes import SUPPORTED_BUILDS
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import manifest_text
from vllm_cpu_model import NVIDIA_ENGINE

DSPARK_CLASS = "vllm.models.deepseek_v4.nvidia.dspark.DSparkDeepseekV4ForCausalLM"
MTP_CLASS = "vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP"
DSPARK_ENGINE = {**NVIDIA_ENGINE, "speculative_config": {"method": "dspark", "num_speculative_tokens": 5}}
MTP_ENGINE = {**NVIDIA_ENGINE, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
DRAFT = {"role": "draft", "model_class": DSPARK_CLASS, "engine": DSPARK_ENGINE}
DROPPED = "model.markov_head.markov_w2.weight"
WORLD_TIMEOUT_S = 900
# Harness-only: vLLM 0.33.0 picks its V1 model runner on a machine without Triton (this CPU venv), and V1
# refuses dspark speculative decoding at config time; a GPU host (vLLM's Triton installed) gets the V2 runner,
# which serves it. The runner changes no parameter of the draft model, so the worlds ask for V2 themselves.
WORLD_ENV = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1"}
# the TP3 world's source: vLLM's CPU platform check wants n_routed_experts % 3 == 0 (stock_vtp.stock_problems)
TP3_EXPERTS = 6

@pytest.fixture(scope="module", autouse=True)
def dspark_release() -> None:
    """The venv's release has a vetted DSpark draft class (0.34.0; not 0.33.0)."""
    version = sf.vllm_version()
    if DSPARK not in next((b.draft_kinds for b in SUPPORTED_BUILDS if b.commit == version), ()):
        pytest.skip(f"vLLM {version}: no vetted DSpark draft class for DeepSeek-V4 (model/runtimes.Build.draft_kinds)")


def drop_tensor(out: Path, dst: Path, role: str, rank: int, name: str) -> Path:
    """A copy of `out` whose `role` rank-`rank` file and manifest no longer hold tensor `name` (the file
    rewritten by safetensors with its identity stamp, the manifest's size and self-digest updated): a
    consistent output missing one tensor."""
    copy = sf.link_copy(out, dst)
    doc = json.loads((copy / MANIFEST_NAME).read_text())
    entry = doc["roles"][role]["ranks"][rank]
    rel = entry["tensors"].pop(name)["file"]
    path = copy / rel
    with safe_open(str(path), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != name}
        metadata = f.metadata()
    path.unlink()  # a hard link to the original's: write a new file, never through the link
    save_file(kept, str(path), metadata=metadata)
    next(x for x in entry["files"] if x["path"] == rel)["bytes"] = path.stat().st_size
    doc.pop("manifest_digest")
    (copy / MANIFEST_NAME).unlink()  # a hard link to the original's
    (copy / MANIFEST_NAME).write_text(manifest_text(doc))
    return copy


@pytest.fixture(scope="module")
def source(shim_base) -> Path:
    model = shim_base / "dspark-model"
    if not model.exists():
        sf.cli("synth", "dspark", str(model), "--quiet")
    return model


def convert(source: Path, out: Path, tp: int) -> Path:
    sf.cli("convert", "--tp", str(tp), "--arch", "sm120", str(source), str(out), "--expert-layout", "model", "--quiet")
    return out


@pytest.fixture(scope="module", params=(1, 2), ids=("tp1", "tp2"))
def small(request, source, tmp_path_factory) -> dict:
    tp = request.param
    base = tmp_path_factory.mktemp(f"dspark-tp{tp}")
    out = convert(source, base / "out", tp)
    spec = {"tp": tp, "results": str(base / "results"), "runs": [
        {"name": "default", "model": str(source), "load_format": "auto", **DRAFT},
        {"name": "lucifer", "model": str(out), "load_format": "lucifer_tp3", "files": str(out / "draft"),
         "compare_to": "default", **DRAFT},
    ]}
    return {"out": out, "reports": sf.run_world(spec, f"vllm-{sf.vllm_version()}-dspark-tp{tp}", env=WORLD_ENV,
                                                  timeout=WORLD_TIMEOUT_S)}


@pytest.fixture(scope="module")
def tp3(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("dspark-tp3")
    sf.synth_tiny(base / "model", TP3_EXPERTS, "dspark")
    out = convert(base / "model", base / "out", 3)
    lacking = drop_tensor(out, base / "lacking", "draft", 0, DROPPED)
    spec = {"tp": 3, "results": str(base / "results"), "runs": [
        {"name": "lucifer", "model": str(out), "load_format": "lucifer_tp3", "files": str(out / "draft"), **DRAFT},
        {"name": "lacking", "model": str(lacking), "load_format": "lucifer_tp3", **DRAFT},
        {"name": "as_mtp", "model": str(out), "load_format": "lucifer_tp3", "role": "draft", "model_class": MTP_CLASS,
         "engine": MTP_ENGINE},
    ]}
    return {"out": out, "reports": sf.run_world(spec, f"vllm-{sf.vllm_version()}-dspark-tp3", env=WORLD_ENV,
                                                  timeout=WORLD_TIMEOUT_S)}


def test_the_checkpoint_declares_dspark_and_the_manifest_records_it(source):
    cfg = json.loads((source / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + 3
    assert sf.manifest(convert(source, source.parent / "dspark-out-tp1", 1))["draft"] == {
        "kind": "dspark", "stages": 3, "tokens": cfg["dspark_block_size"]}


def test_vllms_own_loader_and_the_rank_files_give_the_same_draft(small):
    """Every DSpark parameter vLLM's own `load_weights` fills from the checkpoint equals the one
    lucifer_tp3 fills from the rank files, byte for byte: the stages, `context_wkv_proj` (the three wkv
    stacked), `main_proj`, the Markov head (w2's rows padded to 64 by vLLM itself) and the F32
    confidence head."""
    man = sf.manifest(small["out"])
    for rep in small["reports"]:
        default, lucifer = rep["runs"]["default"], rep["runs"]["lucifer"]
        assert "error" not in default and "error" not in lucifer, (default.get("error"), lucifer.get("error"))
        assert default["model_class"] == lucifer["model_class"] == DSPARK_CLASS
        assert default["loader"] == "DefaultModelLoader" and lucifer["loader"] == "LuciferTP3Loader"
        entry = man["roles"]["draft"]["ranks"][rep["rank"]]["tensors"]
        owned = set(default["params"]) - set(entry)
        assert owned == owned_by_runtime("dspark", default["params"]) == {"model.embed_tokens.weight",
                                                                         "lm_head.weight"}, owned
        assert set(default["params"]) == set(lucifer["params"])
        vs = lucifer["vs_reference"]
        assert vs["only_here"] == vs["only_reference"] == [] and vs["bytes_compared"] > 0
        assert {d.split(":")[0] for d in vs["differ"]} <= owned, vs["differ"]
        assert lucifer["file_tensors"] == len(entry) and lucifer["file_problems"] == []
        p = lucifer["params"]
        assert p["model.confidence_head.proj.weight"][1] == "float32"
        assert p["model.markov_head.markov_w2.weight"][0] == [1024, 64]  # vocabulary 1000, never TP-padded
        assert p["model.context_wkv_proj.weight"][0] == [3 * 128, 256]
        assert {n.split(".")[2] for n in p if n.startswith("model.layers.")} == {"0", "1", "2"}


def test_tp3_draft_is_its_rank_files_with_the_plugins_virtual_tp(tp3):
    man = sf.manifest(tp3["out"])
    for rep in tp3["reports"]:
        run = rep["runs"]["lucifer"]
        assert "error" not in run, run.get("error")
        assert run["model_class"] == DSPARK_CLASS and run["loader"] == "LuciferTP3Loader"
        entry = man["roles"]["draft"]["ranks"][rep["rank"]]["tensors"]
        assert set(run["params"]) - owned_by_runtime("dspark", run["params"]) == set(entry)
        assert run["file_tensors"] == len(entry) and run["file_problems"] == [], run["file_problems"]
        p = run["params"]
        assert p["model.layers.0.attn.wq_b.weight"][0][0] == 24 * 128  # 24 local heads of 72
        assert p["model.layers.0.ffn.experts.routed_experts.w13_weight"][0][1] == 2 * 768
        assert p["model.markov_head.markov_w2.weight"][0] == [1024, 64]  # replicated: lcm(64, 3) not applied


def test_a_draft_missing_one_tensor_is_refused_by_name(tp3):
    for rep in tp3["reports"]:  # the one output check (issue 52) finds it in the manifest, on every rank
        err = rep["runs"]["lacking"].get("error", "")
        assert err.startswith("ShimError: lucifer_tp3: ") and \
            f"draft rank 0 tensor {DROPPED}: tensor missing from the manifest" in err, err
        assert "\n" not in err


def test_a_dspark_output_served_as_mtp_is_refused(tp3):
    for rep in tp3["reports"]:
        err = rep["runs"]["as_mtp"].get("error", "")
        assert err.startswith("ShimError: lucifer_tp3: vLLM built the draft as DeepSeekV4MTP but "), err
        assert "DSpark drafter (DSparkDeepseekV4ForCausalLM)" in err and '"method":"dspark"' in err and "\n" not in err
