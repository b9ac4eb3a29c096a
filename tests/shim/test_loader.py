"""The lucifer_tp3 loader on real converted `tiny` outputs: 3-process gloo load and every refusal."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lucifer_shard.model import runtimes

import shim_fixtures as sf

HERE = Path(__file__).resolve().parent
# Key set, dtype and shape are checked whatever `verify` says.
EVERY_VERIFY = pytest.mark.parametrize("verify", ["none", "headers"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loader(extra=None):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(LoadConfig(load_format="lucifer_tp3", model_loader_extra_config=extra or {}))


def _refusal(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg and msg.startswith("lucifer_tp3: "), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


# --------------------------------------------------------------------- the 3-process load


def test_three_processes_gloo_tp3_each_loads_its_rank_byte_exact(out_kernel, tmp_path, shim):
    """vLLM's parallel state on gloo (world 3, TP 3): each process picks its own rank's files."""
    r = subprocess.run([sys.executable, str(HERE / "dist_load_worker.py"), str(out_kernel), str(_free_port()),
                        str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    man = sf.manifest(out_kernel)
    reports = [json.loads((tmp_path / f"rank-{i}.json").read_text()) for i in range(3)]
    for rank, rep in enumerate(reports):
        assert rep["tp_rank"] == rank and rep["tp_size"] == 3 and rep["all_ranks"] == [0, 1, 2]
        assert rep["loader"] == "lucifer_shard.runtime_shim.load.loader.LuciferTP3Loader"
        for role in ("target", "draft"):
            want_files = [str(out_kernel / f["path"]) for f in man["roles"][role]["ranks"][rank]["files"]]
            assert rep[role]["files"] == sorted(want_files)
            assert all(f"/{role}/rank-{rank}/" in f for f in rep[role]["files"])
            assert rep[role]["tensors"] == len(man["roles"][role]["ranks"][rank]["tensors"])
        sink = rep["target"]["params"]["model.layers.0.attn.attn_sink"]
        assert sink == [[sf.SINK_PARAM_LEN], "torch.float32"]


def test_three_processes_each_on_a_share_of_its_own_rank_only(out_model, tmp_path, shim):
    """Issue 35 (the fallback of its point 4, as this CPU cannot run vLLM's CPU forward): a TP3 world of
    three gloo processes, process R given only node R's share (lucifer-shard stage --nnodes 3 --node-rank R),
    each loads its rank byte for byte from files that hold no other rank."""
    for r in range(3):
        sf.cli("stage", str(out_model), str(tmp_path / f"node{r}"), "--nnodes", "3", "--node-rank", str(r), "-q")
        assert {p.parent.name for p in (tmp_path / f"node{r}").rglob("*.safetensors")} == {f"rank-{r}"}
    results = tmp_path / "results"
    results.mkdir()
    r = subprocess.run([sys.executable, str(HERE / "dist_load_worker.py"), str(tmp_path / "node{rank}"),
                        str(_free_port()), str(results)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(3):
        rep = json.loads((results / f"rank-{rank}.json").read_text())
        assert rep["tp_rank"] == rank and rep["all_ranks"] == [0, 1, 2]
        for role in ("target", "draft"):
            assert rep[role]["files"] and all(f.startswith(str(tmp_path / f"node{rank}" / role / f"rank-{rank}"))
                                              for f in rep[role]["files"]), rep[role]["files"]


def test_a_share_of_other_weights_stops_every_rank_at_load(out_model, tmp_path, shim):
    """Issue 53: node 1 given a share of another checkpoint of the same schema (other weights: the same
    conversion id, another content digest), nodes 0 and 2 shares of out_model. Every node's own checks pass;
    at load the three gloo processes compare identities over vLLM's CPU group and each stops in one line
    naming node 1's and node 0's content digests and the fix."""
    other_model, other = tmp_path / "model2", tmp_path / "out2"
    sf.cli("synth", "tiny", str(other_model), "--fill", "random", "--seed", "1", "--quiet")
    sf.cli("convert", "--tp", "3", "--arch", "sm120", "--expert-layout", "model", str(other_model), str(other), "-q")
    base, derived = sf.manifest(out_model), sf.manifest(other)
    assert base["conversion_id"] == derived["conversion_id"]
    assert base["source"]["content"]["digest"] != derived["source"]["content"]["digest"]
    for r in range(3):
        sf.cli("stage", str(other if r == 1 else out_model), str(tmp_path / f"node{r}"), "--nnodes", "3",
               "--node-rank", str(r), "-q")
    results = tmp_path / "results"
    results.mkdir()
    r = subprocess.run([sys.executable, str(HERE / "dist_load_worker.py"), str(tmp_path / "node{rank}"),
                        str(_free_port()), str(results)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    # the identity line's content is the digest of the rank files' stamps, recorded as source.content.stamps (issue 61)
    ours, theirs = (m["source"]["content"]["stamps"].removeprefix("blake3:")[:12] for m in (base, derived))
    for rank in range(3):
        msg = json.loads((results / f"rank-{rank}.json").read_text())["error"]
        assert "\n" not in msg and msg.startswith("lucifer_tp3: the nodes hold shares of different outputs: "), msg
        assert f"TP rank 1 (node 1's share, host " in msg and f"content {theirs}" in msg, msg
        assert f"TP rank 0 (node 0's share, host " in msg and f"content {ours}" in msg, msg
        assert "other source weights" in msg and "lucifer-shard stage OUT DEST --nnodes N --node-rank R" in msg


def test_a_drafter_without_weights_loads_the_target_as_the_target(shim):
    """vLLM's ngram drafter has no model: its speculative config's draft_model_config is the target's own
    (vllm/config/speculative.py), and the target's load must not be taken for the draft's."""
    from types import SimpleNamespace

    from lucifer_shard.runtime_shim.load.loader import LuciferTP3Loader

    target, draft = SimpleNamespace(), SimpleNamespace()
    ngram = SimpleNamespace(model_config=target, speculative_config=SimpleNamespace(draft_model_config=target))
    assert LuciferTP3Loader._role_from_config(ngram, target) == "target"
    dspark = SimpleNamespace(model_config=target, speculative_config=SimpleNamespace(draft_model_config=draft))
    assert [LuciferTP3Loader._role_from_config(dspark, c) for c in (target, draft)] == ["target", "draft"]
    alone = SimpleNamespace(model_config=target, speculative_config=None)
    assert LuciferTP3Loader._role_from_config(alone, target) == "target"


def test_in_process_each_rank_byte_exact_and_hooks_replayed(out_kernel, tp_world):
    man = sf.manifest(out_kernel)
    for rank in range(3):
        tp_world(3, rank)
        model = sf.build_model(man, "target", rank)
        loader = _loader()
        loader.load_weights(model, sf.model_config(out_kernel))
        assert sf.assert_byte_exact(model, sf.file_tensors(out_kernel, man, "target", rank)) == 134
        assert model.calls == ["refresh.0", "refresh.1", "refresh.2", "refresh.3", "finalize_mega_moe_weights",
                               "finalize_mhc_broadcast_weights", "setup_b12x_wo_projection"]
        assert sorted(loader.tags) == [f"model.layers.{i}.ffn.experts.routed_experts" for i in range(4)]
        if rank == 2:  # the virtual heads are -inf in the file tail and in the padded param
            sink = dict(model.named_parameters())["model.layers.0.attn.attn_sink"]
            assert torch.isinf(sink[16:]).all() and torch.isfinite(sink[:16]).all()
    draft = sf.build_model(man, "draft", 2)
    loader = _loader({"verify": "full"})
    loader.load_weights(draft, sf.model_config(out_kernel))
    assert draft.calls == ["finalize_mega_moe_weights"]
    assert sf.assert_byte_exact(draft, sf.file_tensors(out_kernel, man, "draft", 2)) > 0


def test_model_layout_output_loads_without_tags(out_model, tp_world):
    man = sf.manifest(out_model)
    model = sf.build_model(man, "target", 0)
    loader = _loader({"verify": "full"})
    loader.load_weights(model, sf.model_config(out_model))
    assert loader.tags == {}
    sf.assert_byte_exact(model, sf.file_tensors(out_model, man, "target", 0))


def test_a_worker_reads_and_checks_the_manifest_once(out_model, tp_world, monkeypatch):
    """vLLM's worker calls the loader's load_model, which checks the engine and loads the weights: OUT's
    manifest is read and fully checked once in it (issue 60 item 5), and the load is byte-exact."""
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from lucifer_shard.runtime_shim import manifest as shim_manifest

    reads = []
    real = shim_manifest.check_output
    monkeypatch.setattr(shim_manifest, "check_output", lambda out, **kw: reads.append(Path(out)) or real(out, **kw))
    man = sf.manifest(out_model)
    model = sf.build_model(man, "target", 0)

    # Harness replacement: vLLM's BaseModelLoader.load_model builds the real DeepSeek-V4 class (create_model)
    # from a full VllmConfig; here it hands the stand-in model to the loader's load_weights, as vLLM's does
    # once it has built it (model_loader/base_loader.py). The loader's own load_model runs unchanged.
    def built(self, vllm_config, model_config, prefix=""):
        self.load_weights(model, model_config)
        return model

    monkeypatch.setattr(BaseModelLoader, "load_model", built)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=3), speculative_config=None)
    assert _loader({"verify": "full"}).load_model(vllm_config, sf.model_config(out_model)) is model
    assert reads == [out_model]
    sf.assert_byte_exact(model, sf.file_tensors(out_model, man, "target", 0))


# ------------------------------------------------------------------------------- refusals


def test_refuses_wrong_tp_size(out_kernel, tp_world):
    tp_world(4, 0)
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out_kernel), "target"), sf.model_config(out_kernel))
    _refusal(e, "tensor_parallel_size 4, but the files were built for 3", "--tp 4", "-tp 3")


def test_refuses_missing_rank_files(out_kernel, tmp_path, tp_world):
    out = sf.link_copy(out_kernel, tmp_path / "out")
    (out / "target/rank-1/part-00000.safetensors").unlink()
    tp_world(3, 1)
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out), "target", 1), sf.model_config(out))
    _refusal(e, "rank files missing", "target/rank-1/part-00000.safetensors")


def test_a_nodes_share_loads_its_rank_and_names_node_rank_and_fix_for_another(out_model, tmp_path, tp_world):
    """Issue 35: a worker reads its rank from a share that holds only that rank (lucifer-shard stage); a worker
    whose rank the share lacks fails at load in one line naming the node, the rank and the fix."""
    share = tmp_path / "node1"
    sf.cli("stage", str(out_model), str(share), "--nnodes", "3", "--node-rank", "1", "-q")
    assert {p.parent.name for p in share.rglob("*.safetensors")} == {"rank-1"}
    man = sf.manifest(share)
    tp_world(3, 1)
    model = sf.build_model(man, "target", 1)
    _loader({"verify": "full"}).load_weights(model, sf.model_config(share))
    assert sf.assert_byte_exact(model, sf.file_tensors(share, man, "target", 1)) == 134
    tp_world(3, 2)
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(man, "target", 2), sf.model_config(share))
    _refusal(e, "is node 1's share (rank(s) 1 of tp 3 (node 1 of 3)) but this worker runs TP rank 2, node 2's",
             "lucifer-shard stage OUT DEST --nnodes 3 --node-rank 2")


@EVERY_VERIFY
def test_refuses_missing_and_unexpected_keys(out_kernel, tp_world, verify):
    man = sf.manifest(out_kernel)
    extra = sf.build_model(man, "target", extra_params={"model.layers.0.attn.new_thing": ((4,), torch.float32)})
    with pytest.raises(ValueError) as e:
        _loader({"verify": verify}).load_weights(extra, sf.model_config(out_kernel))
    _refusal(e, "key missing", "model.layers.0.attn.new_thing")
    fewer = sf.build_model(man, "target", drop=("model.layers.1.attn.wq_b.weight",))
    with pytest.raises(ValueError) as e:
        _loader({"verify": verify}).load_weights(fewer, sf.model_config(out_kernel))
    _refusal(e, "key unexpected", "model.layers.1.attn.wq_b.weight")


@EVERY_VERIFY
def test_refuses_shape_mismatch_no_narrowing(out_kernel, tp_world, verify):
    name = "model.layers.0.attn.wq_b.weight"
    man = sf.manifest(out_kernel)
    shape = man["roles"]["target"]["ranks"][0]["tensors"][name]["shape"]
    bigger = (shape[0] + 128, shape[1])
    model = sf.build_model(man, "target", overrides={name: (bigger, torch.float8_e4m3fn)})
    with pytest.raises(ValueError) as e:
        _loader({"verify": verify}).load_weights(model, sf.model_config(out_kernel))
    _refusal(e, "shape mismatch", name, f"({shape[0]},{shape[1]}) != param ({bigger[0]},{bigger[1]})")


@EVERY_VERIFY
def test_refuses_dtype_mismatch_no_casting(out_kernel, tp_world, verify):
    """An E8M0 param receiving the U8 expert scales would be converted by value by copy_()."""
    name = "model.layers.3.ffn.experts.routed_experts.w2_weight_scale"
    man = sf.manifest(out_kernel)
    shape = tuple(man["roles"]["target"]["ranks"][0]["tensors"][name]["shape"])
    model = sf.build_model(man, "target", overrides={name: (shape, torch.float8_e8m0fnu)})
    with pytest.raises(ValueError) as e:
        _loader({"verify": verify}).load_weights(model, sf.model_config(out_kernel))
    _refusal(e, "dtype mismatch", name, "U8 in the files, param is F8_E8M0")


def test_refuses_plan_mismatch(out_kernel, tp_world):
    cfg = json.loads((out_kernel / "config.json").read_text())
    plan = sf.fork_plan(cfg, 3)
    plan["moe_intermediate_size"] = {**plan["moe_intermediate_size"], "local_size": 720, "padded_size": 2160}
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out_kernel), "target"), sf.model_config(out_kernel, plan))
    _refusal(e, "virtual-TP plan mismatch on axis moe_intermediate_size", "runtime padded_size 2160, manifest 2112")
    with pytest.raises(ValueError) as e:  # no plan at all: on stock 0.33.0, a config the plugin did not pad
        _loader().load_weights(sf.build_model(sf.manifest(out_kernel), "target"), sf.model_config(out_kernel, None))
    _refusal(e, "stock virtual TP: the model config was not padded", "num_attention_heads 64 -> 72")


def test_refuses_wrong_arch_for_kernel_layout(out_kernel, tp_world, monkeypatch):
    from lucifer_shard.runtime_shim.adapt import lucifer_tuple

    monkeypatch.setattr(lucifer_tuple, "device_arch", lambda: ("sm90", "9.0"))
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out_kernel), "target"), sf.model_config(out_kernel))
    _refusal(e, "GPU capability 9.0 but files were laid out for sm120", "--arch sm90")


def test_refuses_wrong_backend_for_tagged_layer(out_kernel, tp_world, monkeypatch):
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    from lucifer_shard.runtime_shim.adapt import compat

    monkeypatch.setitem(compat.VERDICTS, runtimes.RELAYOUT, compat.WrapperVerdict(runtimes.RELAYOUT, True, None, (), ""))
    model = sf.build_model(sf.manifest(out_kernel), "target")
    experts = model.get_submodule("model.layers.2.ffn.experts.routed_experts")
    experts.quant_method = SimpleNamespace(mxfp4_backend=Mxfp4MoeBackend.B12X_MXFP4_MXFP8
                                           if hasattr(Mxfp4MoeBackend, "B12X_MXFP4_MXFP8") else Mxfp4MoeBackend.MARLIN)
    with pytest.raises(ValueError) as e:
        _loader().load_weights(model, sf.model_config(out_kernel))
    _refusal(e, "MoE backend resolved to", "on layer model.layers.2.ffn.experts.routed_experts",
             "files require FLASHINFER_CUTLASS_MXFP4_MXFP8", "--moe-backend flashinfer_cutlass")


def test_refuses_kernel_layout_without_relayout_wrapper(out_kernel, tp_world, monkeypatch):
    """On a vLLM whose re-layout is not vetted the wrapper is not installed: a real MoE layer must not load
    kernel bytes."""
    from types import SimpleNamespace

    from lucifer_shard.runtime_shim.adapt import compat

    monkeypatch.setitem(compat.VERDICTS, runtimes.RELAYOUT,
                        compat.WrapperVerdict(runtimes.RELAYOUT, False, None, (), "matches no build vetted for it"))
    model = sf.build_model(sf.manifest(out_kernel), "target")
    model.get_submodule("model.layers.0.ffn.experts.routed_experts").quant_method = SimpleNamespace(
        mxfp4_backend=SimpleNamespace(name="FLASHINFER_CUTLASS_MXFP4_MXFP8"))
    with pytest.raises(ValueError) as e:
        _loader().load_weights(model, sf.model_config(out_kernel))
    _refusal(e, "re-layout wrapper is not installed", "--expert-layout model")


def test_refuses_file_from_another_conversion(out_kernel, out_model, tmp_path, tp_world):
    out = sf.link_copy(out_kernel, tmp_path / "out")
    p = "target/rank-0/part-00000.safetensors"
    (out / p).unlink()
    (out / p).write_bytes((out_model / p).read_bytes())
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out), "target"), sf.model_config(out))
    _refusal(e, "metadata lucifer.conversion_id", "from another conversion")


def test_verify_none_trusts_the_files_identity_and_nothing_else(out_kernel, out_model, tmp_path, tp_world):
    """verify=none skips the manifest self-digest and each file's identity stamp (headers refuses each
    case), still reads byte-exact, and still names a truncated file: the one output check every reader
    runs (issue 52) compares the recorded sizes in every mode (a stat each, no byte read)."""
    man = sf.manifest(out_kernel)
    model = sf.build_model(man, "target")
    _loader({"verify": "none"}).load_weights(model, sf.model_config(out_kernel))
    assert sf.assert_byte_exact(model, sf.file_tensors(out_kernel, man, "target", 0)) == 134

    edited = sf.link_copy(out_kernel, tmp_path / "edited")
    doc = sf.manifest(edited)
    doc["tool_version"] = "edited by hand"
    (edited / "lucifer-manifest.json").unlink()
    (edited / "lucifer-manifest.json").write_text(json.dumps(doc))
    _loader({"verify": "none"}).load_weights(sf.build_model(man, "target"), sf.model_config(edited))
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(man, "target"), sf.model_config(edited))
    _refusal(e, "manifest_digest does not match")

    foreign = sf.link_copy(out_kernel, tmp_path / "foreign")  # same names, shapes, dtypes: another conversion
    p = "target/rank-0/part-00000.safetensors"
    (foreign / p).unlink()
    (foreign / p).write_bytes((out_model / p).read_bytes())
    _loader({"verify": "none"}).load_weights(sf.build_model(man, "target"), sf.model_config(foreign))

    short = sf.link_copy(out_kernel, tmp_path / "short")
    data = (short / p).read_bytes()
    (short / p).unlink()
    (short / p).write_bytes(data[:-100])
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(man, "target"), sf.model_config(short))
    _refusal(e, f"{p}: {len(data) - 100} bytes, the manifest records {len(data)} (truncated)")
    with pytest.raises(ValueError) as e:
        _loader({"verify": "none"}).load_weights(sf.build_model(man, "target"), sf.model_config(short))
    _refusal(e, f"{p}: {len(data) - 100} bytes, the manifest records {len(data)} (truncated)")


@EVERY_VERIFY
def test_refuses_header_offsets_that_disagree_with_dtype_and_shape(out_kernel, tmp_path, tp_world, verify):
    from lucifer_shard.runtime_shim.manifest import read_header

    out = sf.link_copy(out_kernel, tmp_path / "out")
    path = out / "target/rank-0/part-00000.safetensors"
    name = "model.layers.0.attn.wq_b.weight"
    t = read_header(path).tensors[name]
    start, end = t.start, t.end
    was, now = f'"data_offsets":[{start},{end}]', f'"data_offsets":[{start},{end - 1}]'
    data = path.read_bytes()
    assert data.count(was.encode()) == 1 and len(str(end - 1)) == len(str(end))
    path.unlink()
    path.write_bytes(data.replace(was.encode(), now.encode()))
    with pytest.raises(ValueError) as e:
        _loader({"verify": verify}).load_weights(sf.build_model(sf.manifest(out), "target"), sf.model_config(out))
    _refusal(e, f"{path}: tensor {name!r} data_offsets [{start}, {end - 1}) hold {end - 1 - start} bytes",
             "the file is corrupt")


def test_refuses_unknown_extra_config_key(shim):
    with pytest.raises(ValueError) as e:
        _loader({"pattern": "model-rank-{rank}-part-{part}.safetensors"})
    _refusal(e, "unknown --model-loader-extra-config key(s) 'pattern'", "accepts role, verify")
    with pytest.raises(ValueError) as e:
        _loader({"verify": "sometimes"})
    _refusal(e, "verify='sometimes'", "expected one of 'none', 'headers', 'full'")


def test_verify_full_catches_tampered_bytes(out_kernel, tmp_path, tp_world):
    out = sf.link_copy(out_kernel, tmp_path / "out")
    man = sf.manifest(out)
    t = man["roles"]["target"]["ranks"][2]["tensors"]["model.layers.0.attn.wq_b.weight"]
    path = out / t["file"]
    sf.real_copy(path)
    from lucifer_shard.runtime_shim.manifest import read_header

    header = read_header(path)
    start = header.data_start + header.tensors["model.layers.0.attn.wq_b.weight"].end - 1  # last byte: a zero tail
    data = bytearray(path.read_bytes())
    data[start] ^= 0x40
    path.write_bytes(bytes(data))
    tp_world(3, 2)
    _loader().load_weights(sf.build_model(man, "target", 2), sf.model_config(out))  # verify=headers (the default) passes
    with pytest.raises(ValueError) as e:
        _loader({"verify": "full"}).load_weights(sf.build_model(man, "target", 2), sf.model_config(out))
    _refusal(e, "verify=full", "model.layers.0.attn.wq_b.weight")


def test_refuses_incomplete_output_and_missing_draft_role(out_kernel, tmp_path, tp_world):
    out = sf.link_copy(out_kernel, tmp_path / "out")
    (out / "COMPLETE").unlink()
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out), "target"), sf.model_config(out))
    _refusal(e, "COMPLETE missing", "--resume")
    with pytest.raises(ValueError) as e:
        _loader({"role": "draft"}).load_weights(sf.build_model(sf.manifest(out_kernel), "target"),
                                                sf.model_config(out_kernel))
    _refusal(e, "role='draft'", "target model")


def test_post_processing_checks(out_kernel, tp_world):
    man = sf.manifest(out_kernel)
    model = sf.build_model(man, "target")
    loader = _loader()
    loader.load_weights(model, sf.model_config(out_kernel))
    prefix = "model.layers.1.ffn.experts.routed_experts"
    with pytest.raises(RuntimeError) as e:  # the wrapper never ran: vLLM took another path
        loader.check_after_processing(model)
    _refusal(e, "re-layout wrapper ran 0 times", "expected exactly 1")
    for tag in loader.tags.values():
        tag.relayout_calls = 1
    loader.check_after_processing(model)  # identity re-layout: storage unchanged
    mod = model.get_submodule(prefix)
    mod.w13_weight = torch.nn.Parameter(mod.w13_weight.data.clone(), requires_grad=False)  # a re-layout copy
    with pytest.raises(RuntimeError) as e:
        loader.check_after_processing(model)
    _refusal(e, f"{prefix}.w13_weight was re-laid-out after loading")


# ------------------------------------------------------- hostile outputs (issue 26: classes 3, 4, 5, 11)


@pytest.fixture(scope="session")
def out_twin(shim_base) -> Path:
    """A checkpoint with out_kernel's headers and sizes but other weights (`--fill random`), converted
    with the same options: the same conversion id, other content stamps."""
    base = shim_base / "twin"
    sf.cli("synth", "tiny", str(base / "model"), "--fill", "random", "--quiet")
    return sf.convert_tiny(base)


def test_refuses_a_rank_file_of_other_weights_at_verify_headers(out_kernel, out_twin, tmp_path, tp_world):
    assert sf.manifest(out_twin)["conversion_id"] == sf.manifest(out_kernel)["conversion_id"]
    out = sf.link_copy(out_kernel, tmp_path / "out")
    p = "target/rank-0/part-00000.safetensors"
    (out / p).unlink()
    (out / p).write_bytes((out_twin / p).read_bytes())
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out), "target"), sf.model_config(out))
    _refusal(e, "metadata lucifer.content", "other source weights")


@pytest.mark.parametrize("where", ["link", "outside"])
def test_reads_nothing_outside_the_output(out_kernel, tmp_path, tp_world, where):
    """A rank file that is a symlink (to the very same bytes), or a re-sealed manifest that points
    outside OUT, is refused before a byte is loaded."""
    from lucifer_shard.output.manifest import manifest_text

    out = sf.link_copy(out_kernel, tmp_path / "out")
    p = "target/rank-0/part-00000.safetensors"
    if where == "link":
        (out / p).unlink()
        (out / p).symlink_to(out_kernel / p)
        needle = "is a symlink"
    else:
        doc = sf.manifest(out)
        rank = doc["roles"]["target"]["ranks"][0]
        rank["files"][0]["path"] = str(out_kernel / p)
        for t in rank["tensors"].values():
            t["file"] = str(out_kernel / p)
        (out / "lucifer-manifest.json").unlink()
        (out / "lucifer-manifest.json").write_text(manifest_text(doc))
        (out / p).unlink()
        needle = "files[0].path"
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out_kernel), "target"), sf.model_config(out))
    _refusal(e, needle)


def test_a_convert_during_the_load_is_named_not_loaded(out_kernel, out_twin, tmp_path, tp_world, monkeypatch):
    """A whole `convert --force` of other weights while the loader reads: refused with the reason
    (on main the mixed bytes were loaded at verify=headers)."""
    from lucifer_shard.engine.convert import convert
    from lucifer_shard.model.options import Options
    from lucifer_shard.runtime_shim.load import reader

    out = tmp_path / "out"
    shutil.copytree(out_kernel, out)
    source = sf.manifest(out_twin)["source"]["path"]
    real = reader.read_tensors

    def rewritten_meanwhile(*a, **k):
        got = real(*a, **k)
        convert(source, out, Options(tp=3), force=True, progress=False)
        return got

    monkeypatch.setattr(reader, "read_tensors", rewritten_meanwhile)
    with pytest.raises(ValueError) as e:
        _loader().load_weights(sf.build_model(sf.manifest(out_kernel), "target"), sf.model_config(out))
    _refusal(e, "was rewritten while vLLM ran")
