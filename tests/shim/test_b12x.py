"""The b12x route at TP3 on stock vLLM (the venv's vetted release): routed experts 704 wide per rank.

`convert --moe-backend b12x` plans the routed width for vLLM's b12x MoE, which takes the exact per-rank
MXFP4 width (`mxfp4_round_up_hidden_size_and_intermediate_size` returns it unrounded for B12X; the
CUTLASS, Marlin and TRT-LLM backends round to 128). One world of three gloo processes (`vllm_cpu_model.py`)
builds vLLM's NVIDIA `DeepseekV4ForCausalLM`, told the GPU is 12.0 (RTX PRO 6000 class) and 12.1 (DGX Spark
GB10), with `--moe-backend b12x` and `--load-format lucifer_tp3`, and its MTP draft, each into a fresh model:

* every parameter is its rank-file tensor, byte for byte, the routed experts 704 wide per rank (real
  704/704/640, zero tails) and the shared experts 768 (vLLM's own block-FP8 padding of
  `moe_intermediate_size` 2112, `DeepseekV4MLP`), the plugin's one override serving both widths;
* vLLM's own post-load step of the MoE layers (`Mxfp4MoEMethod.process_weights_after_loading`, then
  `B12xExperts.process_weights_after_loading`) is run and what it did, or the call that fails on a CPU,
  recorded;
* a server whose MoE backend would round the width to 768 (FlashInfer CUTLASS) is refused in one line.

The harness replaces only machine checks (`allow_construction_on_this_cpu`: here `B12xExperts`'
device check, which asks for an SM120-family CUDA GPU).
"""
from __future__ import annotations

import pytest

import shim_fixtures as sf
from lucifer_shard.model.drafts import owned_by_runtime
from vllm_cpu_model import NVIDIA_ENGINE

TP = 3
EXPERTS = 6
NVIDIA_CLASS = "vllm.models.deepseek_v4.nvidia.model.DeepseekV4ForCausalLM"
DRAFT_CLASS = "vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP"
B12X_ENGINE = {**NVIDIA_ENGINE, "moe_backend": "b12x"}  # the SM120 family's attention and KV cache, b12x's MoE
CAPABILITIES = {"sm120": [12, 0], "sm121": [12, 1]}
EXPERTS_PREFIX = "model.layers.1.ffn.experts.routed_experts"
SHARED_PREFIX = "model.layers.1.ffn.shared_experts"
WORLD_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("b12x-tp3")
    source, out = base / "model", base / "out"
    sf.synth_tiny(source, EXPERTS)
    sf.cli("convert", "--tp", str(TP), "--moe-backend", "b12x", str(source), str(out), "--quiet")
    lucifer = {"model": str(out), "load_format": "lucifer_tp3", "model_class": NVIDIA_CLASS}
    spec = {"tp": TP, "results": str(base / "results"), "runs": [
        *({"name": arch, **lucifer, "files": str(out / "target"), "engine": B12X_ENGINE, "capability": cap}
          for arch, cap in CAPABILITIES.items()),
        {"name": "draft", **lucifer, "files": str(out / "draft"), "role": "draft", "model_class": DRAFT_CLASS,
         "engine": {**B12X_ENGINE, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}},
        {"name": "post_load", **lucifer, "engine": B12X_ENGINE, "moe_post_load": True, "capture": False},
        {"name": "cutlass", **lucifer, "engine": {**B12X_ENGINE, "moe_backend": "flashinfer_cutlass"}},
    ]}
    return {"out": out, "reports": sf.run_world(spec, f"vllm-{sf.vllm_version()}-b12x-tp3", timeout=WORLD_TIMEOUT_S)}


def test_the_manifest_records_the_route_and_its_widths(world):
    man = sf.manifest(world["out"])
    assert man["options"]["moe_backend"] == "b12x" and man["runtime"]["moe_backend"] == "b12x"
    assert man["expert_layout"] == "model" and man["moe_variant"] is None
    routed, shared = man["plan"]["axes"]["routed"], man["plan"]["axes"]["shared"]
    assert (routed["padded"], routed["local"], routed["kernel_local"]) == (2112, 704, 704)
    assert (shared["padded"], shared["local"]) == (2304, 768)


def test_every_parameter_is_its_rank_file_tensor_704_wide(world):
    man = sf.manifest(world["out"])
    for rep in world["reports"]:
        for name, role in (*((arch, "target") for arch in CAPABILITIES), ("draft", "draft")):
            run = rep["runs"][name]
            assert "error" not in run, (name, run.get("error"))
            assert run["hf_sizes"]["moe_intermediate_size"] == 2112, run["hf_sizes"]
            entry = man["roles"][role]["ranks"][rep["rank"]]["tensors"]
            assert run["file_tensors"] == len(entry) and run["file_problems"] == [], (name, run["file_problems"])
            owned = owned_by_runtime("mtp", run["params"]) if role == "draft" else set()
            assert set(run["params"]) - owned == set(entry), (name, set(run["params"]) ^ set(entry))
        p = rep["runs"]["sm120"]["params"]
        assert p[f"{EXPERTS_PREFIX}.w13_weight"][0] == [EXPERTS, 2 * 704, 128]  # hidden 256 / 2 per byte
        assert p[f"{EXPERTS_PREFIX}.w13_weight_scale"][0] == [EXPERTS, 2 * 704, 256 // 32]
        assert p[f"{EXPERTS_PREFIX}.w2_weight"][0] == [EXPERTS, 256, 704 // 2]
        assert p[f"{EXPERTS_PREFIX}.w2_weight_scale"][0] == [EXPERTS, 256, 704 // 32]
        assert p[f"{SHARED_PREFIX}.gate_up_proj.weight"][0] == [2 * 768, 256]
        assert p[f"{SHARED_PREFIX}.down_proj.weight"][0] == [256, 768]


def test_the_padded_tails_are_zero(world):
    """Rank 2 holds 640 real columns of 704: the manifest's zero regions of the routed experts cover the
    last 64 (32 bytes of W2, 2 of its E8M0 scale groups, stored 0x00: `docs/output-format.md`), and the
    loaded bytes equal the files' (above), so the parameters' tails are those zeros."""
    man = sf.manifest(world["out"])
    last = man["roles"]["target"]["ranks"][2]["tensors"]
    assert last[f"{EXPERTS_PREFIX}.w13_weight"]["zero_regions"] == [[0, 640, 704], [0, 1344, 1408]]
    assert last[f"{EXPERTS_PREFIX}.w2_weight"]["zero_regions"] == [[1, 320, 352]]
    assert last[f"{EXPERTS_PREFIX}.w2_weight_scale"]["zero_regions"] == [[1, 20, 22]]
    assert man["roles"]["target"]["ranks"][0]["tensors"][f"{EXPERTS_PREFIX}.w13_weight"]["zero_regions"] == []


def test_vllms_post_load_step_selects_b12x(world):
    """vLLM's own post-load step on the loaded MoE layers selects its b12x backend for the 704-wide experts (its
    `is_supported_config` takes the width). On this CPU it then stops where b12x prepares the weights for its
    kernels on the GPU (`B12xExperts.process_weights_after_loading` -> `_prepare_experts`: CUDA work), never at a
    shape check; on an SM120 GPU that step is not proven here."""
    for rep in world["reports"]:
        run = rep["runs"]["post_load"]
        assert "error" not in run, run.get("error")
        post = run["moe_post_load"]
        backends = {layer["backend"] for layer in post["layers"].values()} | {post.get("failed_backend")} - {None}
        assert backends and backends <= {"B12X_MXFP4_MXFP8", "B12X_MXFP4_BF16"}, post
        if "error" in post:
            assert "b12x.py" in " ".join(post["frames"]) or "b12x" in post["error"].lower() or "CUDA" in post["error"], post
            assert "shape" not in post["error"].lower(), post["error"]


def test_a_backend_that_rounds_to_768_is_refused_in_one_line(world):
    for rep in world["reports"]:
        err = rep["runs"]["cutlass"].get("error", "")
        assert "704 wide per rank for vLLM's b12x MoE" in err and "--moe-backend b12x" in err, err
        assert "\n" not in err


def test_doctor_says_where_b12x_comes_from_and_refuses_another_gpu_family(world, monkeypatch):
    """doctor's route check in this vLLM environment: on an SM120-family GPU it passes, naming where vLLM's
    `b12x` imports from (FlashInfer's embedded copy behind its top-level alias, in these venvs); on an H200
    (sm90) it fails, naming the route and the fix."""
    from lucifer_shard.runtime_shim.manifest import load_manifest
    from lucifer_shard.runtime_shim.serving import doctor

    m = load_manifest(world["out"])
    (ok,) = doctor._route_checks(m, "sm121", "12.1")
    assert ok.status == doctor.OK and "704 wide per rank for vLLM's b12x MoE" in ok.detail, ok
    assert "imports from" in ok.detail and ("FlashInfer's embedded copy" in ok.detail or "b12x 1." in ok.detail), ok
    (bad,) = doctor._route_checks(m, "sm90", "9.0")
    assert bad.status == doctor.FAIL and "runs on sm120/sm121 only" in bad.detail
    assert bad.fix == "re-convert without --moe-backend b12x"
    monkeypatch.setattr(doctor.importlib, "import_module", lambda name: (_ for _ in ()).throw(ImportError("no b12x")))
    (missing,) = doctor._route_checks(m, "sm120", "12.0")
    assert missing.status == doctor.FAIL and "does not import here (ImportError: no b12x)" in missing.detail
    # the extra's own requirement, from this vLLM's metadata: `vllm[b12x]==...` would resolve vLLM's FlashInfer pin
    # again, which fails where the package index lacks it
    assert missing.fix.startswith("pip install b12x==") and "vllm[" not in missing.fix, missing.fix
