"""model/boxfit.py against vLLM itself: `plan`'s KV-cache figures for DeepSeek-V4-Flash and 0731 are the ones
vLLM's own planner makes from the layers its own classes build (`vllm_kv_plan.py`: the full-size configs on the
meta device, the KV cache groups, blocks and the "GPU KV cache size" tokens), per attention backend the Lucifer
tuple serves with (FlashInfer's on SM120, FlashMLA's on SM90), with and without the draft."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import CONFIGS
from lucifer_shard.model import boxfit
from vllm_cpu_model import NVIDIA_ENGINE

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
MEMORY = [8 * GIB, 49 * GIB]
LENGTHS = [65_536, 1 << 20]
BATCHED = 8192  # vLLM's H100/H200 default; the CPU platform schedules synchronously, so that many are in flight
SM90 = {**NVIDIA_ENGINE, "attention_backend": "FLASHMLA_SPARSE_DSV4"}
DSPARK = "vllm.models.deepseek_v4.nvidia.dspark.DSparkDeepseekV4ForCausalLM"
MTP = "vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP"
CASES = {  # config, engine, draft class (None: the target alone), GPU capability
    "0731-sm120": ("deepseek-v4-flash-0731.json", NVIDIA_ENGINE, None, [12, 0]),
    "0731-sm90": ("deepseek-v4-flash-0731.json", SM90, None, [9, 0]),
    "0731-dspark": ("deepseek-v4-flash-0731.json",
                    {**NVIDIA_ENGINE, "speculative_config": {"method": "dspark", "num_speculative_tokens": 5}},
                    DSPARK, [12, 0]),
    "flash-mtp": ("deepseek-v4-flash.json",
                  {**NVIDIA_ENGINE, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, MTP, [12, 0]),
}


def vllm_plan(tmp_path: Path, config: str, engine: dict, draft: str | None, capability: list[int]) -> dict:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(CONFIGS / config, model / "config.json")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "engine": {**engine, "max_num_batched_tokens": BATCHED},
                                "draft_class": draft, "capability": capability, "memory": MEMORY,
                                "max_model_len": LENGTHS}))
    # vLLM 0.34.0 builds a DSpark draft only with its V2 model runner (test_dspark_model.py says why)
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1"}
    done = subprocess.run([sys.executable, str(HERE / "vllm_kv_plan.py"), str(spec)], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=900)
    line = next((x for x in done.stdout.splitlines() if x.startswith("KV-PLAN ")), None)
    assert done.returncode == 0 and line, done.stderr[-4000:]
    return json.loads(line.removeprefix("KV-PLAN "))


@pytest.mark.parametrize("case", list(CASES))
def test_plans_kv_figures_are_vllms(tmp_path, case):
    config, engine, draft, capability = CASES[case]
    got = vllm_plan(tmp_path, config, engine, draft, capability)
    raw = json.loads((CONFIGS / config).read_text())
    served = raw["num_hidden_layers"] + (len(raw["compress_ratios"]) - raw["num_hidden_layers"] if draft else 0)
    pool = boxfit.kv_pool(raw, raw["compress_ratios"][:served])
    assert got["cache_dtype"] == "fp8_ds_mla" and got["in_flight"] == BATCHED
    assert got["groups"] == sorted([g.block, g.page, g.window] for g in pool.groups)
    for p in got["pools"]:
        assert p["blocks"] == p["memory"] // pool.block_bytes, p
        assert p["tokens"] == pool.tokens(p["memory"], p["max_model_len"], got["in_flight"])[0], p
