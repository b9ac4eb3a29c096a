"""The two narrow wrappers: decision tables, and installation gated by signature + source hash."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from lucifer_shard.model import runtimes

import shim_fixtures as sf


def _vllm_config(out, load_format="lucifer_tp3", tp=3, attn="FLASHINFER_MLA_SPARSE_DSV4",
                 moe="flashinfer_cutlass", **parallel):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    mc = sf.model_config(out, plan=None)
    pc = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1,
                         prefill_context_parallel_size=1, enable_expert_parallel=False, enable_eplb=False)
    for k, v in parallel.items():
        setattr(pc, k, v)
    return SimpleNamespace(model_config=mc, parallel_config=pc,
                           load_config=SimpleNamespace(load_format=load_format),
                           attention_config=SimpleNamespace(backend=AttentionBackendEnum[attn]),
                           kernel_config=SimpleNamespace(moe_backend=moe), lora_config=None)


def _policy(calls, moe_align=32):
    from lucifer_shard.runtime_shim.adapt.wrappers import policy

    def original(vllm_config):
        calls.append("original")

    def apply(model_config, parallel_config):
        calls.append("apply")
        cfg = {k: getattr(model_config.hf_text_config, k) for k in
               ("num_attention_heads", "o_groups", "moe_intermediate_size", "n_shared_experts", "vocab_size")}
        model_config.hf_text_config.vllm_virtual_tp_plan = sf.fork_plan(cfg, parallel_config.tensor_parallel_size,
                                                                         moe_align)

    return policy.make_policy_wrapper(original, apply)


def _refusal(e, *needles):
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("lucifer_tp3: "), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


@pytest.fixture
def sm120(monkeypatch, shim):
    from lucifer_shard.runtime_shim.adapt import lucifer_tuple

    monkeypatch.setattr(lucifer_tuple, "device_arch", lambda: ("sm120", "12.0"))


def test_policy_accepts_lucifer_tuple_and_plan_equals_manifest(out_kernel, sm120):
    calls = []
    cfg = _vllm_config(out_kernel)
    _policy(calls)(cfg)
    assert calls == ["apply"]  # the B12X-gated original is bypassed
    assert cfg.model_config.hf_text_config.vllm_virtual_tp_plan["attention_heads"]["padded_size"] == 72


def test_policy_refuses_plan_mismatch(out_kernel, sm120):
    with pytest.raises(ValueError) as e:
        _policy([], moe_align=48)(_vllm_config(out_kernel))
    _refusal(e, "virtual-TP plan mismatch on axis moe_intermediate_size", "B12X_MOE_FORCE_A8")


@pytest.mark.parametrize("kw,needle", [
    ({"moe": "b12x"}, "MoE backend 'b12x' (pass --moe-backend flashinfer_cutlass"),
    ({"attn": "FLASHMLA_SPARSE"}, "attention backend FLASHMLA_SPARSE (pass --attention-backend FLASHINFER_MLA_SPARSE_DSV4)"),
    ({"tp": 4}, "tensor_parallel_size 4, but the files were built for 3: start with -tp 3"),
    ({"data_parallel_size": 2}, "data_parallel_size=2"),
    ({"enable_expert_parallel": True}, "expert parallel on"),
])
def test_policy_refuses_other_tuples_with_lucifer_load_format(out_kernel, sm120, kw, needle):
    with pytest.raises(ValueError) as e:
        _policy([])(_vllm_config(out_kernel, **kw))
    _refusal(e, "serves only the Lucifer tuple", needle)


def test_policy_refuses_wrong_gpu_arch(out_kernel, monkeypatch, shim):
    from lucifer_shard.runtime_shim.adapt import lucifer_tuple

    monkeypatch.setattr(lucifer_tuple, "device_arch", lambda: ("sm90", "9.0"))
    with pytest.raises(ValueError) as e:
        _policy([])(_vllm_config(out_kernel))
    _refusal(e, "GPU capability 9.0 (files were laid out for sm120")


def test_policy_refuses_lucifer_tuple_with_stock_load_format(out_kernel, shim):
    for lf in ("auto", "sharded_state", "safetensors"):
        with pytest.raises(ValueError) as e:
            _policy([])(_vllm_config(out_kernel, load_format=lf))
        _refusal(e, f"found --load-format {lf}", "only supported with --load-format lucifer_tp3", "mis-slices W2")


def test_policy_passes_everything_else_to_the_original(out_kernel, shim):
    calls = []
    tp4 = _vllm_config(out_kernel, load_format="auto", tp=4)
    tp4.model_config.hf_text_config.vocab_size = 129280  # Flash's vocabulary: TP4 pads nothing
    _policy(calls)(tp4)
    _policy(calls)(_vllm_config(out_kernel, load_format="auto", moe="b12x"))  # the fork's own B12X path
    _policy(calls)(SimpleNamespace(model_config=None))
    assert calls == ["original", "original", "original"]


def _tagged_layer(variant="FLASHINFER_CUTLASS_MXFP4_MXFP8"):
    from lucifer_shard.runtime_shim.adapt.wrappers import relayout

    layer = torch.nn.Module()
    for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        layer.register_parameter(n, torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.uint8), requires_grad=False))
    tag = relayout.ExpertTag("model.layers.0.ffn.experts.routed_experts", variant, {})
    tag.data_ptrs = {n: getattr(layer, n).data_ptr() for n in ("w13_weight", "w2_weight")}
    setattr(layer, relayout.TAG_ATTR, tag)
    return layer, tag


def _call(wrapper, layer, backend):
    return wrapper(mxfp4_backend=backend, layer=layer, w13_weight=layer.w13_weight, w2_weight=layer.w2_weight,
                   w13_weight_scale=layer.w13_weight_scale, w2_weight_scale=layer.w2_weight_scale,
                   w13_bias=None, w2_bias=None, _cache_permute_indices={})


def _fake_convert(mxfp4_backend, layer, w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, w13_bias=None,
                  w2_bias=None, _cache_permute_indices=None):
    return ("relaid-out",)


def test_relayout_is_identity_for_tagged_layers_and_refuses_wrong_backend(shim):
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    from lucifer_shard.runtime_shim.adapt.wrappers import relayout

    wrapper = relayout.make_relayout_wrapper(_fake_convert)
    layer, tag = _tagged_layer()
    got = _call(wrapper, layer, Mxfp4MoeBackend.FLASHINFER_CUTLASS_MXFP4_MXFP8)
    assert got[0].data_ptr() == layer.w13_weight.data_ptr() and got[1].data_ptr() == layer.w2_weight.data_ptr()
    assert tag.relayout_calls == 1
    with pytest.raises(ValueError) as e:
        _call(wrapper, layer, Mxfp4MoeBackend.FLASHINFER_CUTLASS_MXFP4_BF16)
    _refusal(e, "MoE backend resolved to FLASHINFER_CUTLASS_MXFP4_BF16 on layer model.layers.0.ffn.experts",
             "files require FLASHINFER_CUTLASS_MXFP4_MXFP8")
    plain, _ = _tagged_layer()
    delattr(plain, relayout.TAG_ATTR)  # untagged layers get the original re-layout
    assert _call(wrapper, plain, Mxfp4MoeBackend.FLASHINFER_CUTLASS_MXFP4_MXFP8) == ("relaid-out",)


def test_relayout_hands_sm90_scales_over_in_the_files_shape_on_the_same_storage(shim):
    """SM90's folded scales are 5-D in the files and held in the 3-D parameter _setup_kernel checks: the
    identity returns that storage viewed as the file's shape, which replace_parameter then binds."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    from lucifer_shard.runtime_shim.adapt.wrappers import relayout

    wrapper = relayout.make_relayout_wrapper(_fake_convert)
    layer, tag = _tagged_layer("FLASHINFER_CUTLASS_MXFP4_BF16")
    layer.w13_weight_scale = torch.nn.Parameter(torch.arange(2 * 128 * 8, dtype=torch.uint8).reshape(2, 128, 8),
                                                requires_grad=False)
    tag.shapes = {"w13_weight_scale": (2, 2, 2, 16, 16)}
    got = _call(wrapper, layer, Mxfp4MoeBackend.FLASHINFER_CUTLASS_MXFP4_BF16)
    assert tuple(got[2].shape) == (2, 2, 2, 16, 16) and got[2].data_ptr() == layer.w13_weight_scale.data_ptr()
    assert torch.equal(got[2].reshape(-1), layer.w13_weight_scale.reshape(-1))
    assert tuple(got[0].shape) == (2, 4) and tag.relayout_calls == 1  # no recorded shape: the parameter's


FAKE_VTP = '''
def maybe_apply_b12x_virtual_tp_padding(vllm_config):
    vllm_config.calls.append("original")


def apply_b12x_virtual_tp_padding_to_model_config(model_config, parallel_config):
    model_config.calls.append("apply")
'''


def _fake_fork(tmp_path, monkeypatch):
    import vllm.config

    from lucifer_shard.runtime_shim.adapt import compat

    path = tmp_path / "fake_virtual_tp.py"
    path.write_text(textwrap.dedent(FAKE_VTP))
    spec = importlib.util.spec_from_file_location("vllm.config.virtual_tp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "vllm.config.virtual_tp", mod)
    monkeypatch.setattr(vllm.config, "virtual_tp", mod, raising=False)
    monkeypatch.setattr(compat, "VERDICTS", {})
    return mod


def test_policy_wrapper_installed_only_when_signature_and_hash_match(tmp_path, monkeypatch, shim):
    import dataclasses

    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    mod = _fake_fork(tmp_path, monkeypatch)
    text = (tmp_path / "fake_virtual_tp.py").read_text()
    policy = wrappers.WRAPPERS[runtimes.POLICY]
    hashes = {s.key: compat.source_hash(compat.source_from_module_text(text, s.qualname)) for s in policy.symbols}
    monkeypatch.setattr(wrappers, "HASHES", {**wrappers.HASHES, "fake0001": hashes,
                                             "fake0002": {k: "sha256:" + "0" * 64 for k in hashes}})
    good = runtimes.Build("fake0001", "fake fork", True, "0.6.14", ())
    bad = runtimes.Build("fake0002", "other fork", True, "0.6.14", ())
    original = mod.maybe_apply_b12x_virtual_tp_padding

    wrappers.install(builds=(bad,))
    assert not compat.installed(runtimes.POLICY)
    assert "maybe_apply_b12x_virtual_tp_padding sha256:" in compat.why_not_installed(runtimes.POLICY)
    assert "matches no build vetted for it (fake0002)" in compat.why_not_installed(runtimes.POLICY)
    assert mod.maybe_apply_b12x_virtual_tp_padding is original

    wrappers.install(builds=(good,))
    assert compat.installed(runtimes.POLICY) and compat.VERDICTS[runtimes.POLICY].build.commit == "fake0001"
    wrapped = mod.maybe_apply_b12x_virtual_tp_padding
    assert wrapped is not original and wrapped.__lucifer_wrapped__ is original
    wrappers.install(builds=(good,))  # idempotent: hashes the original behind the wrapper, wraps once
    assert mod.maybe_apply_b12x_virtual_tp_padding is wrapped
    assert not compat.installed(runtimes.RELAYOUT)  # this venv's re-layout is vetted by no build given
    assert "matches no build vetted for it (fake0001)" in compat.why_not_installed(runtimes.RELAYOUT)

    # the installed wrapper delegates non-Lucifer configs to the fork's function
    cfg = SimpleNamespace(model_config=None, calls=[])
    wrapped(cfg)
    assert cfg.calls == ["original"]


def test_policy_wrapper_refuses_changed_signature(tmp_path, monkeypatch, shim):
    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    mod = _fake_fork(tmp_path, monkeypatch)

    def maybe_apply_b12x_virtual_tp_padding(vllm_config, strict=True):
        pass

    monkeypatch.setattr(mod, "maybe_apply_b12x_virtual_tp_padding", maybe_apply_b12x_virtual_tp_padding)
    wrappers.install(builds=runtimes.SUPPORTED_BUILDS)
    assert not compat.installed(runtimes.POLICY)
    assert "signature (vllm_config, strict) != expected (vllm_config)" in compat.why_not_installed(runtimes.POLICY)


def test_relayout_wrapper_installed_only_where_its_hash_is_vetted(monkeypatch, shim):
    """On this venv's vLLM release the re-layout wrapper sits where _setup_kernel looks it up; a build table
    without the release's re-layout row leaves vLLM's function in place and says why."""
    import dataclasses

    import vllm.model_executor.layers.quantization.mxfp4 as q

    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    release = sf.vllm_version()
    assert compat.installed(runtimes.RELAYOUT) and compat.VERDICTS[runtimes.RELAYOUT].build.commit == release
    assert q.convert_weight_to_mxfp4_moe_kernel_format.__lucifer_wrapped__ is not None
    monkeypatch.setattr(q, "convert_weight_to_mxfp4_moe_kernel_format",
                        compat.unwrap(q.convert_weight_to_mxfp4_moe_kernel_format))
    monkeypatch.setattr(compat, "VERDICTS", {})
    unvetted = tuple(dataclasses.replace(b, wrappers=tuple(w for w in b.wrappers if w != runtimes.RELAYOUT))
                     if b.commit == release else b for b in runtimes.SUPPORTED_BUILDS)
    wrappers.install(builds=unvetted)
    assert not compat.installed(runtimes.RELAYOUT)
    why = compat.why_not_installed(runtimes.RELAYOUT)
    assert "convert_weight_to_mxfp4_moe_kernel_format sha256:" in why and "matches no build vetted for it" in why
    assert getattr(q.convert_weight_to_mxfp4_moe_kernel_format, "__lucifer_wrapped__", None) is None


def test_load_model_refuses_kernel_layout_on_vllm_without_relayout_wrapper(out_kernel, monkeypatch, shim):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from lucifer_shard.runtime_shim.adapt import compat

    monkeypatch.setitem(compat.VERDICTS, runtimes.RELAYOUT,
                        compat.WrapperVerdict(runtimes.RELAYOUT, False, None, (), "a stand-in reason"))
    loader = get_model_loader(LoadConfig(load_format="lucifer_tp3"))
    vcfg = _vllm_config(out_kernel)
    vcfg.speculative_config = None
    with pytest.raises(ValueError) as e:
        loader.load_model(vcfg, vcfg.model_config)
    _refusal(e, "routed experts in kernel layout (FLASHINFER_CUTLASS_MXFP4_MXFP8)", "wrapper is not installed",
             "a stand-in reason", "--expert-layout model")
    vcfg.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError) as e:
        loader.load_model(vcfg, vcfg.model_config)
    _refusal(e, "tensor_parallel_size 2, but the files were built for 3: start with -tp 3")


@pytest.mark.parametrize("installed,needles", [
    ("0.6.13", ("folded sm90 layout", "flashinfer-python 0.6.13 reads the legacy layout",
                "re-convert with --flashinfer-layout legacy")),
    (None, ("folded sm90 layout", "flashinfer-python is not installed", "install flashinfer-python 0.6.16"))])
def test_load_model_refuses_sm90_kernel_layout_on_a_flashinfer_of_the_other_generation(shim_base, monkeypatch, shim,
                                                                                      installed, needles):
    """sm90 experts in the folded generation (the default) on a FlashInfer that reads the legacy one, or on none:
    refused before vLLM builds the model, since the kernel would not fail on these bytes, only compute wrong
    numbers. The installed version is replaced here (this venv has one FlashInfer, of the folded generation)."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from lucifer_shard.runtime_shim.load import loader as shim_loader

    out = sf.convert_tiny(shim_base, "--arch", "sm90")
    monkeypatch.setattr(shim_loader, "dist_version", lambda name: installed if name == "flashinfer-python" else None)
    loader = get_model_loader(LoadConfig(load_format="lucifer_tp3"))
    vcfg = _vllm_config(out)
    vcfg.speculative_config = None
    with pytest.raises(ValueError) as e:
        loader.load_model(vcfg, vcfg.model_config)
    _refusal(e, *needles)


def test_stock_padding_comes_from_the_manifest_and_refuses_another_config(out_model, shim):
    from lucifer_shard.runtime_shim.adapt import stock_vtp
    from lucifer_shard.runtime_shim.manifest import open_output

    pad = stock_vtp.padding(open_output(out_model))
    assert pad == {"sizes": {"num_attention_heads": (64, 72), "o_groups": (8, 9), "moe_intermediate_size": (2048, 2304)},
                   "vocab": (1000, 1152), "tp": 3}
    cfg = SimpleNamespace(num_attention_heads=64, o_groups=8, moe_intermediate_size=2048)
    assert stock_vtp.pad_config(cfg, pad) is cfg
    assert (cfg.num_attention_heads, cfg.original_num_attention_heads, cfg.o_groups, cfg.moe_intermediate_size) == (
        72, 64, 9, 2304)
    stock_vtp.pad_config(cfg, pad)  # twice: a no-op
    assert cfg.num_attention_heads == 72
    probe = SimpleNamespace()  # the bare config vLLM's get_config probes first
    assert stock_vtp.pad_config(probe, pad) is probe and not vars(probe)
    with pytest.raises(ValueError) as e:
        stock_vtp.pad_config(SimpleNamespace(num_attention_heads=64, o_groups=8, moe_intermediate_size=1024), pad)
    _refusal(e, "config moe_intermediate_size=1024, but the rank files were converted from 2048")


def test_vocab_wrapper_pads_only_lucifer_models_and_checks_the_manifest(out_model, tp_world, monkeypatch):
    import vllm.config as vc
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from lucifer_shard.runtime_shim.adapt.wrappers import stock_vocab

    pad = {"sizes": {}, "vocab": (1000, 1152), "tp": 3}
    text = SimpleNamespace(lucifer_tp3_padding=pad)
    cfg = SimpleNamespace(load_config=SimpleNamespace(load_format="lucifer_tp3"),
                          model_config=SimpleNamespace(hf_text_config=text))
    monkeypatch.setattr(vc, "get_current_vllm_config_or_none", lambda: cfg)
    import vllm.distributed as vd
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    for mod in (vd, vpe):  # rank 0 of 3, where the layer and the wrapper look it up
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 3)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0)
    assert VocabParallelEmbedding.__init__.__lucifer_wrapped__ is not None  # installed on 0.33.0
    emb = VocabParallelEmbedding(1000, 8)
    assert (emb.num_embeddings_padded, emb.num_embeddings_per_partition, emb.org_vocab_size) == (1152, 384, 1000)
    other = VocabParallelEmbedding(960, 8)  # not the model's vocabulary: vLLM's own padding
    assert other.padding_size == 64
    pad["vocab"] = (1000, 1344)  # a manifest that disagrees with lcm(64, 3)
    with pytest.raises(ValueError) as e:
        VocabParallelEmbedding(1000, 8)
    _refusal(e, "vocabulary 1000 padded to a multiple of 192 is 1152, the rank files hold 1344 rows")
    cfg.load_config.load_format = "auto"  # another loader: untouched, and vLLM's own assert fires
    with pytest.raises(AssertionError):
        VocabParallelEmbedding(1000, 8)
    assert stock_vocab.vocab_padded(1000) is None
