"""TP3 on stock vLLM (the venv's vetted release): the plugin supplies virtual TP, vLLM's own DeepSeek-V4 models load the rank files.

One world of three gloo processes (`vllm_cpu_model.py`) builds, with nothing but `--load-format
lucifer_tp3` (no overrides passed, no config patched here; the harness replaces only its machine
checks), each into a fresh model:

* vLLM's CPU `DeepseekV4ForCausalLM` and its NVIDIA `DeepSeekV4MTP` draft (the CPU draft class is a
  stub), loaded by `lucifer_tp3` from the rank files (`--expert-layout model`: stock vLLM has no
  kernel-layout path for them);
* the NVIDIA `DeepseekV4ForCausalLM` told the GPU is 12.0 (FlashInfer's SM120 sparse MLA pads 24 local
  heads to 32, FlashInfer CUTLASS MoE) and 9.0 (FlashMLA pads to 64, Marlin MoE), as `lucifer-shard
  serve` starts them on those GPU families;
* the NVIDIA class told the GPU is 12.0, 10.0 and 9.0, loaded from kernel-layout rank files of that
  arch (`--expert-layout kernel`, the default with `--arch`), then vLLM's own post-load step of every
  MoE layer (`Mxfp4MoEMethod.process_weights_after_loading`): the plugin's identity re-layout runs once
  per tagged layer, the experts keep their storage and bytes (SM90's scales viewed 5-D), and vLLM builds
  its FlashInfer CUTLASS kernel on them;
* the SM120 class again, through vLLM's own post-load step after loading, counting its post-load hooks;
* vLLM's own `DefaultModelLoader` on the original checkpoint, which stock vLLM refuses at TP3, and a
  lucifer_tp3 start the plugin refuses (`--hf-overrides`).

The source has 6 routed experts: vLLM's CPU class asserts `n_routed_experts % tp_size == 0`
(`cpu/model.py:192`, values it never uses), which Flash's 256 experts do not satisfy at TP3; the
plugin refuses that case on the CPU platform with the reason (`stock_vtp.stock_problems`). Every
other padded axis is `tiny`'s, Flash's real sizes: 64 heads, 8 output groups, 2048-wide experts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import shim_fixtures as sf
from lucifer_shard.model.drafts import owned_by_runtime
from vllm_cpu_model import NVIDIA_ENGINE

TP = 3
EXPERTS = 6
CPU_CLASS = "vllm.models.deepseek_v4.cpu.model.DeepseekV4ForCausalLM"
NVIDIA_CLASS = "vllm.models.deepseek_v4.nvidia.model.DeepseekV4ForCausalLM"
DRAFT_CLASS = "vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP"
SPECULATIVE = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
SM90_ENGINE = {"attention_backend": "FLASHMLA_SPARSE_DSV4", "moe_backend": "marlin", "kv_cache_dtype": "fp8"}
SM90_KERNEL_ENGINE = {**SM90_ENGINE, "moe_backend": "flashinfer_cutlass"}
# kernel-layout runs: arch -> (engine, capability)
KERNEL_RUNS = {"sm120": (NVIDIA_ENGINE, [12, 0]), "sm100": (NVIDIA_ENGINE, [10, 0]), "sm90": (SM90_KERNEL_ENGINE, [9, 0])}
LOADED = ("lucifer", "draft", "nvidia_sm120", "nvidia_sm90")
WORLD_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("stock-tp3")
    source, out = base / "model", base / "out"
    sf.synth_tiny(source, EXPERTS)
    sf.cli("convert", "--tp", str(TP), "--arch", "sm120", str(source), str(out), "--expert-layout", "model", "--quiet")
    kernel = {arch: base / f"out-{arch}" for arch in KERNEL_RUNS}
    for arch, path in kernel.items():
        sf.cli("convert", "--tp", str(TP), "--arch", arch, str(source), str(path), "--quiet")
    # node 1's share from a checkpoint of the same schema with other weights (same conversion id, other content)
    other, other_out = base / "model-other", base / "out-other"
    sf.synth_tiny(other, EXPERTS, fill="random", seed=1)
    sf.cli("convert", "--tp", str(TP), "--arch", "sm120", str(other), str(other_out), "--expert-layout", "model", "--quiet")
    for r in range(TP):
        sf.cli("stage", str(other_out if r == 1 else out), str(base / f"node{r}"), "--nnodes", str(TP), "--node-rank",
               str(r), "--quiet")
    lucifer = {"model": str(out), "load_format": "lucifer_tp3"}
    spec = {"tp": TP, "results": str(base / "results"), "runs": [
        {"name": "lucifer", **lucifer, "files": str(out / "target")},
        {"name": "draft", **lucifer, "files": str(out / "draft"), "role": "draft", "model_class": DRAFT_CLASS,
         "engine": {**NVIDIA_ENGINE, **SPECULATIVE}},
        {"name": "nvidia_sm120", **lucifer, "files": str(out / "target"), "model_class": NVIDIA_CLASS,
         "engine": NVIDIA_ENGINE},
        {"name": "nvidia_sm90", **lucifer, "files": str(out / "target"), "model_class": NVIDIA_CLASS,
         "engine": SM90_ENGINE, "capability": [9, 0]},
        *({"name": f"kernel_{arch}", "model": str(kernel[arch]), "load_format": "lucifer_tp3",
           "files": str(kernel[arch] / "target"), "model_class": NVIDIA_CLASS, "engine": engine,
           "capability": capability, "moe_post_load": True} for arch, (engine, capability) in KERNEL_RUNS.items()),
        {"name": "post_load", **lucifer, "model_class": NVIDIA_CLASS, "engine": NVIDIA_ENGINE, "post_load": True,
         "capture": False},
        {"name": "default", "model": str(source), "load_format": "auto"},
        {"name": "hf_overrides", **lucifer, "engine": {"hf_overrides": {"rope_theta": 5000}}},
        {"name": "mixed_shares", "model": str(base / "node{rank}"), "load_format": "lucifer_tp3", "capture": False},
    ]}
    return {"out": out, "source": source, "kernel": kernel, "other": other_out,
            "reports": sf.run_world(spec, f"vllm-{sf.vllm_version()}-stock-tp3", timeout=WORLD_TIMEOUT_S)}


def test_stock_vllm_itself_refuses_tp3(world):
    """The control: without the plugin's padding (vLLM's own loader on the checkpoint), stock vLLM refuses."""
    for rep in world["reports"]:
        err = rep["runs"]["default"].get("error", "")
        assert "Total number of attention heads (64) must be divisible by tensor parallel size (3)" in err, err


def test_geometry_is_the_manifests_plan(world):
    man = sf.manifest(world["out"])
    axes = man["plan"]["axes"]
    want = {"num_attention_heads": axes["heads"]["padded"], "o_groups": axes["groups"]["padded"],
            "moe_intermediate_size": axes["routed"]["kernel_local"] * TP, "vocab_size": axes["vocab"]["original"]}
    assert want == {"num_attention_heads": 72, "o_groups": 9, "moe_intermediate_size": 2304, "vocab_size": 1000}
    cfg = json.loads((world["out"] / "config.json").read_text())
    assert (world["out"] / "config.json").read_bytes() == (world["source"] / "config.json").read_bytes()
    for rep in world["reports"]:
        assert rep["vllm"] == sf.vllm_version() and rep["tp_rank"] == rep["rank"]
        for name in LOADED:
            run = rep["runs"][name]
            assert "error" not in run, (name, run.get("error"))
            assert run["hf_sizes"] == want, (name, run["hf_sizes"])
            assert run["virtual_tp_plan"] is None and run["stock_padding"]["vocab"] == [1000, 1152], name
        for name in ("lucifer", "nvidia_sm120", "nvidia_sm90"):
            params = rep["runs"][name]["params"]
            assert params["model.embed_tokens.weight"][0] == params["lm_head.weight"][0] == [384, cfg["hidden_size"]]
            assert params["model.layers.0.attn.wq_b.weight"][0][0] == 24 * cfg["head_dim"]  # 24 local heads of 72


def test_vllms_own_classes(world):
    for rep in world["reports"]:
        runs = rep["runs"]
        assert runs["lucifer"]["model_class"] == CPU_CLASS and runs["draft"]["model_class"] == DRAFT_CLASS
        assert runs["nvidia_sm120"]["model_class"] == runs["nvidia_sm90"]["model_class"] == NVIDIA_CLASS
        assert {runs[n]["loader"] for n in LOADED} == {"LuciferTP3Loader"}


def test_every_loaded_parameter_is_its_rank_file_tensor(world):
    man = sf.manifest(world["out"])
    for rep in world["reports"]:
        for name, role in (("lucifer", "target"), ("draft", "draft"), ("nvidia_sm120", "target"),
                           ("nvidia_sm90", "target")):
            run = rep["runs"][name]
            entry = man["roles"][role]["ranks"][rep["rank"]]["tensors"]
            assert run["file_tensors"] == len(entry) and run["file_problems"] == [], (name, run["file_problems"])
            # the draft borrows the target's embedding and LM head after loading: no file holds them
            owned = (owned_by_runtime("mtp", run["params"]) if role == "draft" else set())
            assert set(run["params"]) - owned == set(entry), (name, set(run["params"]) ^ set(entry))
            assert len(owned) == (2 if role == "draft" else 0), (name, owned)


def test_the_backends_make_the_shapes_the_files_fill(world):
    """SM120: FlashInfer pads 24 local heads' sink to 32; SM90: FlashMLA to 64 (the loader fills the 24-entry
    prefix, the rest stays -inf, checked in the comparison above). Both MoE backends keep the rank files'
    kernel-local width 768 (704 real + 64 zero columns per rank)."""
    for rep in world["reports"]:
        for name, sink in (("nvidia_sm120", 32), ("nvidia_sm90", 64)):
            p = rep["runs"][name]["params"]
            assert p["model.layers.0.attn.attn_sink"][0] == [sink], name
            experts = "model.layers.1.ffn.experts.routed_experts"
            assert p[f"{experts}.w13_weight"][0] == [EXPERTS, 2 * 768, 128], name  # hidden 256 / 2 per byte
            assert p[f"{experts}.w2_weight"][0] == [EXPERTS, 256, 768 // 2], name
        assert rep["runs"]["lucifer"]["params"]["model.layers.0.attn.attn_sink"][0] == [24]  # the CPU class: unpadded


def test_kernel_layout_experts_are_served_verbatim(world):
    """Each arch's kernel-layout files in vLLM's NVIDIA class on that GPU family: vLLM's own post-load step
    runs the plugin's identity re-layout exactly once per MoE layer, every expert tensor keeps the storage
    the loader filled, holds the rank file's bytes in the file's shape afterwards (SM90: scales 5-D, as
    FlashInfer's interleave makes them), and vLLM builds its FlashInfer CUTLASS kernel on them."""
    for arch in KERNEL_RUNS:
        man = sf.manifest(world["kernel"][arch])
        assert man["expert_layout"] == "kernel" and man["arch"] == arch
        for rep in world["reports"]:
            run = rep["runs"][f"kernel_{arch}"]
            assert "error" not in run, (arch, run.get("error"))
            post = run["moe_post_load"]
            assert "error" not in post, (arch, post.get("error"))
            entry = man["roles"]["target"]["ranks"][rep["rank"]]["tensors"]
            moe = {n.rpartition(".")[0] for n in entry if n.endswith(".routed_experts.w13_weight")}
            assert set(post["layers"]) == moe and moe, (arch, sorted(post["layers"]))
            for prefix, layer in post["layers"].items():
                assert layer["backend"] == man["moe_variant"] and layer["kernel"] == "FlashInferExperts", layer
                assert layer["relayout_calls"] == 1 and all(layer["storage_kept"].values()), (arch, prefix, layer)
                assert layer["shapes"] == {n: entry[f"{prefix}.{n}"]["shape"] for n in layer["shapes"]}, layer
            # after the post-load step every parameter still is its rank-file tensor, byte for byte
            assert run["file_tensors"] == len(entry) and run["file_problems"] == [], (arch, run["file_problems"])
        scales = post["layers"][sorted(moe)[0]]["shapes"]
        if arch == "sm90":
            assert len(scales["w13_weight_scale"]) == len(scales["w2_weight_scale"]) == 5, scales


def test_the_plugin_refuses_what_stock_vllm_cannot_serve(world):
    for rep in world["reports"]:
        err = rep["runs"]["hf_overrides"].get("error", "")
        assert err.startswith("ShimError: lucifer_tp3: --hf-overrides {'rope_theta': 5000} with --load-format "), err
        assert "\n" not in err and "drop --hf-overrides" in err


def test_a_share_of_other_weights_stops_every_rank_of_vllms_own_model(world):
    """Issue 53: ranks 0 and 2 on shares of OUT, rank 1 on a share of another checkpoint of the same schema (the same
    conversion id: the id does not cover the weights). Each node's own checks pass; as vLLM's CPU DeepseekV4ForCausalLM
    loads, every rank stops in one line naming rank 1's and rank 0's content digests and the fix."""
    ours, theirs = (sf.manifest(p) for p in (world["out"], world["other"]))
    assert ours["conversion_id"] == theirs["conversion_id"]
    # the identity line's content is the digest of the rank files' stamps, recorded as source.content.stamps (issue 61)
    short = [m["source"]["content"]["stamps"].removeprefix("blake3:")[:12] for m in (ours, theirs)]
    assert short[0] != short[1]
    for rep in world["reports"]:
        err = rep["runs"]["mixed_shares"].get("error", "")
        assert err.startswith("ShimError: lucifer_tp3: the nodes hold shares of different outputs: TP rank 1 (node 1's "
                              "share, host "), err
        assert "\n" not in err and f"content {short[1]}" in err and f"content {short[0]}" in err
        assert "other source weights" in err and "lucifer-shard stage OUT DEST --nnodes N --node-rank R" in err


def test_post_load_hooks_run_exactly_once(world):
    """The NVIDIA class's post-load hook (`finalize_mhc_broadcast_weights`, called by the model's
    `process_weights_after_loading`) runs once through the whole load: 0.33.0's `load_weights` ran it
    itself and vLLM's post-load step runs it again, 0.34.0's runs it only from `finalize_model_weights`;
    the loader replays only hooks vLLM's post-load step does not run."""
    for rep in world["reports"]:
        run = rep["runs"]["post_load"]
        assert "error" not in run, run.get("error")
        assert run["hook_calls"] == {"finalize_mhc_broadcast_weights": 1}, run["hook_calls"]
