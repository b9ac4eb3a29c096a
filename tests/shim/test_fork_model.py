"""TP3 in the target fork's own code: mlow/vllm's DeepSeek-V4 models, virtual-TP plan and loaders.

For each vetted fork build (`model/runtimes.SUPPORTED_BUILDS`, the stock releases left out), one world of three gloo processes
(`vllm_cpu_model.py` with the fork's source first on PYTHONPATH, from tools/fork-overlay.sh) builds
the fork's own `DeepseekV4ForCausalLM` and `DeepSeekV4MTP` at tensor-parallel size 3 and loads them
before post-load processing, each into a fresh model:

* by the fork's `DefaultModelLoader` from the original checkpoint, under the fork's own virtual-TP
  plan (`apply_b12x_virtual_tp_padding_to_model_config`, the guard bypassed as in the audit);
* by `lucifer_tp3` from the rank files (`--expert-layout model`), the plan applied by the shim's
  policy wrapper on the fork's `maybe_apply_b12x_virtual_tp_padding`, as `lucifer-shard serve` does;

and, once, stock vLLM 0.33.0's NVIDIA classes with the plugin's virtual TP on the same rank files,
compared with the fork's loader like ours.

Expected, and asserted: the same plan, names, shapes and dtypes; every parameter byte-identical
except the routed experts' `w2_weight` and `w2_weight_scale`, where the fork's loader takes W2
bytes 0/384/768 and scale groups 0/24/48 of each source row (the audit's unit-blind slicing) and
the rank files hold bytes 0/352/704 and groups 0/22/44, each checked here against the source.

The fork's code never enters this repository: without an overlay (`bash tools/fork-overlay.sh
--git <clone of github.com/mlow/vllm> 45c1582e9 cece381c4 81564374e`) these tests are skipped
with that reason; docs/evidence/serving-proof.md records a run.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import shim_fixtures as sf
from lucifer_shard.model.runtimes import SUPPORTED_BUILDS

FORK_BUILDS = tuple(b for b in SUPPORTED_BUILDS if not b.stock)
from lucifer_shard.model.drafts import owned_by_runtime
from lucifer_shard.output.manifest_types import Manifest
from lucifer_shard.runtime_shim.manifest import compare_plan
from vllm_cpu_model import NVIDIA_ENGINE

TP = 3
CACHE = Path(os.environ.get("LUCIFER_FORK_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "lucifer-shard"))
DRAFT = {"role": "draft", "engine": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}}
WORLD_TIMEOUT_S = 1800


def audit_offsets(cfg: dict) -> tuple[int, int]:
    """(logical width per rank, the fork's kernel-local width) of the routed experts at TP3, by the
    audit's arithmetic: ceil(2048 / 3) aligned up to 32 = 704, rounded up to 128 = 768."""
    local = math.ceil(math.ceil(cfg["moe_intermediate_size"] / TP) / 32) * 32
    return local, math.ceil(local / 128) * 128


def slice_of(src: torch.Tensor, start: int, length: int, width: int) -> torch.Tensor:
    """Columns [start, start + length) of `src`, clipped to its width, zero-filled to `width`."""
    out = torch.zeros(src.shape[0], width, dtype=torch.uint8)
    real = max(0, min(length, src.shape[1] - start))
    out[:, :real] = src[:, start:start + real]
    return out


def source_tensor(model: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    shard = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(model / shard), framework="pt") as f:
        t = f.get_tensor(key)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@pytest.fixture(scope="module")
def converted(shim_base) -> tuple[Path, Path]:
    # 6 routed experts, so that stock vLLM's CPU platform takes the same files (`stock`)
    model = shim_base / "model-6-experts"
    if not model.exists():
        sf.synth_tiny(model, 6)
    out = shim_base / "fork-tp3-model-layout"
    if not (out / "COMPLETE").exists():
        sf.cli("convert", "--tp", str(TP), "--arch", "sm120", str(model), str(out), "--expert-layout", "model", "--quiet")
    return model, out


@pytest.fixture(scope="module", params=FORK_BUILDS, ids=[b.commit for b in FORK_BUILDS])
def world(request, converted, tmp_path_factory) -> dict:
    build = request.param
    overlay = CACHE / f"fork-{build.commit}"
    if not (overlay / ".complete").is_file():
        pytest.skip(f"no CPU overlay of mlow/vllm {build.commit} in {CACHE}: run `bash tools/fork-overlay.sh "
                    f"--git <clone of github.com/mlow/vllm> {build.commit}` (the fork is never vendored)")
    model, out = converted
    base = tmp_path_factory.mktemp(f"fork-{build.commit}")
    fork_run = {"load_format": "auto", "model": str(model), "plan": "fork-helper"}
    lucifer_run = {"load_format": "lucifer_tp3", "model": str(out)}
    spec = {
        "tp": TP, "results": str(base / "results"), "engine": NVIDIA_ENGINE, "dump": ["w2_weight"],
        "runs": [
            {"name": "fork", **fork_run},
            {"name": "lucifer", **lucifer_run, "files": str(out / "target"), "compare_to": "fork"},
            {"name": "draft_fork", **fork_run, **DRAFT},
            {"name": "draft_lucifer", **lucifer_run, **DRAFT, "files": str(out / "draft"), "compare_to": "draft_fork"},
        ],
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(overlay), os.environ.get("PYTHONPATH")]))}
    reports = sf.run_world(spec, f"fork-{build.commit}-tp{TP}", env=env, timeout=WORLD_TIMEOUT_S)
    results = Path(spec["results"])
    return {"build": build, "overlay": overlay, "model": model, "out": out, "reports": reports, "results": results,
            "cfg": json.loads((model / "config.json").read_text())}


@pytest.fixture(scope="module")
def stock(converted, tmp_path_factory) -> list[dict]:
    """The same rank files in stock vLLM 0.33.0 with the plugin's virtual TP (no overlay): its NVIDIA
    DeepSeek-V4 classes, as an SM120 GPU gets them, loaded by lucifer_tp3."""
    _, out = converted
    base = tmp_path_factory.mktemp("stock-nvidia")
    lucifer_run = {"load_format": "lucifer_tp3", "model": str(out)}
    spec = {"tp": TP, "results": str(base / "results"), "engine": NVIDIA_ENGINE, "runs": [
        {"name": "lucifer", **lucifer_run, "model_class": "vllm.models.deepseek_v4.nvidia.model.DeepseekV4ForCausalLM"},
        {"name": "draft_lucifer", **lucifer_run, **DRAFT, "model_class": "vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP"},
    ]}
    return sf.run_world(spec, f"vllm-0.33.0-stock-nvidia-tp{TP}", timeout=WORLD_TIMEOUT_S)


def _w2_names(prefix: str) -> set[str]:
    return {f"{prefix}.ffn.experts.routed_experts.{leaf}" for leaf in ("w2_weight", "w2_weight_scale")}


def _moe_prefixes(cfg: dict, role: str) -> list[str]:
    n = cfg["num_hidden_layers"]
    if role == "target":
        return [f"model.layers.{i}" for i in range(n)]
    return [f"model.layers.{n}.mtp_block"]


def test_the_forks_own_code_builds_and_loads(world):
    build = world["build"]
    for rep in world["reports"]:
        assert rep["vllm"] == f"0.0.0+g{build.commit}.cpu" and rep["vllm_path"] == str(world["overlay"] / "vllm")
        assert rep["platform"] == "CpuPlatform" and rep["tp_rank"] == rep["rank"]
        for name, cls in (("fork", "nvidia.model.DeepseekV4ForCausalLM"), ("lucifer", "nvidia.model.DeepseekV4ForCausalLM")):
            run = rep["runs"][name]
            assert "error" not in run, run["error"]
            assert run["model_class"] == f"vllm.models.deepseek_v4.{cls}"
        assert rep["runs"]["fork"]["loader"] == "DefaultModelLoader"
        assert rep["runs"]["lucifer"]["loader"] == "LuciferTP3Loader"


def test_same_virtual_tp_plan_as_the_manifest(world):
    manifest_plan = Manifest.load(world["out"]).plan
    for rep in world["reports"]:
        fork_plan, shim_plan = rep["runs"]["fork"]["virtual_tp_plan"], rep["runs"]["lucifer"]["virtual_tp_plan"]
        assert fork_plan is not None and fork_plan == shim_plan
        assert compare_plan(fork_plan, manifest_plan) is None
        assert (fork_plan["attention_heads"]["padded_size"], fork_plan["attention_heads"]["local_size"]) == (72, 24)
        assert fork_plan["moe_intermediate_size"]["local_size"] == 704


def test_only_w2_differs_from_the_forks_loader(world):
    man = sf.manifest(world["out"])
    w2 = set().union(*(_w2_names(p) for p in _moe_prefixes(world["cfg"], "target")))
    for rep in world["reports"]:
        fork, lucifer = rep["runs"]["fork"], rep["runs"]["lucifer"]
        entry = man["roles"]["target"]["ranks"][rep["rank"]]["tensors"]
        assert set(fork["params"]) == set(lucifer["params"]) == set(entry)
        for name, p in fork["params"].items():
            assert p[:2] == lucifer["params"][name][:2], name
        assert lucifer["file_tensors"] == len(entry) and lucifer["file_problems"] == []
        vs = lucifer["vs_reference"]
        assert vs["only_here"] == vs["only_reference"] == []
        assert {d.split(":")[0] for d in vs["differ"]} == w2, vs["differ"]


def _check_w2_slices(world, role: str, fork_run: str, lucifer_run: str, ckpt_prefix: str, prefix: str) -> None:
    from safetensors.torch import load_file

    local, kernel = audit_offsets(world["cfg"])
    experts = world["cfg"]["n_routed_experts"]
    for rep in world["reports"]:
        r = rep["rank"]
        fork = load_file(str(world["results"] / f"rank-{r}-{fork_run}.safetensors"))
        ours = load_file(str(world["results"] / f"rank-{r}-{lucifer_run}.safetensors"))
        for leaf, ckpt, unit in (("w2_weight", "weight", 2), ("w2_weight_scale", "scale", 32)):
            name = f"{prefix}.ffn.experts.routed_experts.{leaf}"
            width = kernel // unit
            for e in range(experts):
                src = source_tensor(world["model"], f"{ckpt_prefix}.ffn.experts.{e}.w2.{ckpt}")
                # the fork: bytes / groups r * 768 / unit, i.e. 0/384/768 and 0/24/48
                assert torch.equal(fork[name][e], slice_of(src, r * kernel // unit, width, width)), (role, r, name, e)
                # the rank files: r * 704 / unit, i.e. 0/352/704 and 0/22/44, zero tail to 768 / unit
                assert torch.equal(ours[name][e], slice_of(src, r * local // unit, local // unit, width)), (role, r, name, e)


def test_w2_the_fork_loads_is_the_audits_wrong_slice_and_ours_the_right_one(world):
    for i in range(world["cfg"]["num_hidden_layers"]):
        _check_w2_slices(world, "target", "fork", "lucifer", f"layers.{i}", f"model.layers.{i}")


def test_draft_in_the_forks_mtp_model(world):
    """The draft rank files in the fork's own DeepSeekV4MTP, where the fork builds it at TP3."""
    build, man = world["build"], sf.manifest(world["out"])
    for rep in world["reports"]:
        fork, lucifer = rep["runs"]["draft_fork"], rep["runs"]["draft_lucifer"]
        if not build.draft_virtual_tp:
            # This build gives the draft no virtual-TP plan: 64 heads do not split over 3 ranks.
            assert "error" in fork and "error" in lucifer, (fork.get("error"), lucifer.get("error"))
            assert "divisible" in fork["error"], fork["error"]
            continue
        assert "error" not in fork and "error" not in lucifer, (fork.get("error"), lucifer.get("error"))
        assert fork["model_class"] == lucifer["model_class"] == "vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP"
        assert fork["virtual_tp_plan"] == lucifer["virtual_tp_plan"] is not None
        entry = man["roles"]["draft"]["ranks"][rep["rank"]]["tensors"]
        owned = set(fork["params"]) - set(entry)
        assert owned == owned_by_runtime("mtp", fork["params"]) and len(owned) == 2, owned
        assert set(fork["params"]) == set(lucifer["params"])
        assert lucifer["file_tensors"] == len(entry) and lucifer["file_problems"] == []
        differ = {d.split(":")[0] for d in lucifer["vs_reference"]["differ"]}
        w2 = _w2_names(_moe_prefixes(world["cfg"], "draft")[0])
        assert w2 <= differ <= w2 | owned, differ  # runtime-owned: uninitialised on both sides
    if build.draft_virtual_tp:
        n = world["cfg"]["num_hidden_layers"]
        _check_w2_slices(world, "draft", "draft_fork", "draft_lucifer", "mtp.0", f"model.layers.{n}.mtp_block")


def test_stock_vllm_with_the_plugin_loads_the_forks_bytes_except_w2(world, stock):
    """Stock 0.33.0 + the plugin's virtual TP and the fork's own virtual TP build the same parameters;
    every one holds the same bytes as the fork's loader reads from the checkpoint, except W2 (the fork's
    unit-blind slicing): the plugin replaces the fork, not its geometry."""
    build = world["build"]
    for role, fork_run, stock_run in (("target", "fork", "lucifer"), ("draft", "draft_fork", "draft_lucifer")):
        if role == "draft" and not build.draft_virtual_tp:
            continue  # the fork builds no TP3 draft on this build (test_draft_in_the_forks_mtp_model)
        w2 = _w2_names(_moe_prefixes(world["cfg"], role)[0]) if role == "draft" else \
            set().union(*(_w2_names(p) for p in _moe_prefixes(world["cfg"], role)))
        for rep, st in zip(world["reports"], stock):
            fork, ours = rep["runs"][fork_run], st["runs"][stock_run]
            assert "error" not in ours, ours.get("error")
            assert set(fork["params"]) == set(ours["params"]), set(fork["params"]) ^ set(ours["params"])
            owned = (owned_by_runtime("mtp", fork["params"]) if role == "draft" else set())
            differ = {n for n, p in fork["params"].items() if p != ours["params"][n]} - owned
            assert differ == w2, (role, rep["rank"], sorted(differ ^ w2))
