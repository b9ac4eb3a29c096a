"""The load plan (src/lucifer_shard/runtime_shim/load/loadplan.py, loadfiles.py) on CPU, without vLLM: every refusal the loader makes before
the first byte, by name, against `tiny` converted at TP3 (sm120 kernel layout with MTP, sm90, model layout), and the
torch side (loadcopy.py) on the same outputs. The vLLM suites (tests/shim/test_loader.py) keep the proofs against
vLLM's real classes; these pin each message where no vLLM is installed.

| old `LuciferTP3Loader` method | new check | test |
| --- | --- | --- |
| `_check_parallel_config` (vLLM settings) | `loadplan.check_engine` | `test_engine_refuses_vllm_settings` |
| `_check_parallel_config` (TP size) | `loadplan.check_engine` | `test_engine_refuses_another_tp_size` |
| `load_model` (re-layout wrapper missing) | `loadplan.check_engine` | `test_engine_refuses_kernel_layout_without_relayout` |
| `load_model` (FlashInfer generation) | `loadplan.check_engine` | `test_engine_refuses_sm90_files_without_their_flashinfer` |
| `_tp_rank` (pipeline parallel) | `loadplan.check_parallel` | `test_refuses_pipeline_parallel` |
| `_tp_rank` (dp / pcp) | `loadplan.check_parallel` | `test_refuses_dp_and_pcp` |
| `load_weights` (`tp_mismatch`) | `loadplan.plan_load` | `test_refuses_another_tp_size_at_load` |
| `load_weights` (`share_problem`) | `loadplan.plan_load` | `test_refuses_a_share_without_this_rank` |
| `_role` (role key) | `loadplan.model_role` | `test_refuses_a_role_key_that_is_not_the_model` |
| `_role` (vLLM's hint) | `loadplan.model_role` | `test_refuses_a_model_that_is_not_what_vllm_loads` |
| `_check_model_class` (target) | `loadplan.check_model_class` | `test_refuses_another_target_class` |
| `_check_model_class` (draft kind) | `loadplan.check_model_class` | `test_refuses_a_draft_class_of_another_kind` |
| `Manifest.rank_entry` (role) | `manifest.rank_entry` | `test_refuses_a_role_the_output_lacks` |
| `Manifest.rank_entry` (rank) | `manifest.rank_entry` | `test_refuses_a_rank_the_manifest_lacks` |
| `_check_files` (no files) | `loadfiles.check_files` | `test_refuses_a_rank_without_files` |
| `_check_files` (`open_rank_file`) | `loadfiles.check_files` | `test_refuses_a_missing_rank_file` |
| `_check_files` (size) | `loadfiles.check_files` | `test_refuses_a_truncated_rank_file` |
| `_check_files` (`read_header`) | `loadfiles.check_files` | `test_refuses_a_corrupt_header` |
| `_check_files` (identity stamp) | `loadfiles.check_files` | `test_refuses_a_file_of_another_conversion_weights_or_place` |
| `_check_files` (tensor set) | `loadfiles.check_files` | `test_refuses_a_header_with_other_tensors` |
| `_check_files` (dtype, shape) | `loadfiles.check_files` | `test_refuses_a_header_tensor_of_another_shape` |
| `_check_keys` (missing) | `loadplan.check_keys` | `test_refuses_missing_and_unexpected_keys` |
| `_check_keys` (unexpected) | `loadplan.check_keys` | `test_refuses_missing_and_unexpected_keys` |
| `_check_tensor` (dtype) | `loadplan.check_tensor` | `test_refuses_another_dtype_unless_declared_view` |
| `_check_tensor` (attn_sink) | `loadplan.check_tensor` | `test_refuses_a_sink_param_shorter_than_the_heads` |
| `_check_tensor` (shape) | `loadplan.check_tensor` | `test_refuses_another_shape_no_narrowing` |
| `load_weights` (`plan_difference`) | `loadplan.plan_load` | `test_refuses_a_virtual_tp_plan_difference` |
| `_expert_modules` (kernel non-expert) | `loadplan.expert_groups` | `test_refuses_kernel_layout_outside_routed_experts` |
| `_expert_modules` (model layout) | `loadplan.expert_groups` | `test_refuses_kernel_tensors_in_a_model_layout_output` |
| `_expert_modules` (incomplete group) | `loadplan.expert_groups` | `test_refuses_an_incomplete_expert_group` |
| `_check_expert_modules` (GPU family) | `loadplan.check_expert_modules` | `test_refuses_kernel_layout_for_another_gpu_family` |
| `_check_expert_modules` (wrapper) | `loadplan.check_expert_modules` | `test_refuses_a_moe_module_without_relayout` |
| `_check_expert_modules` (backend) | `loadplan.check_expert_modules` | `test_refuses_a_moe_module_of_another_backend` |
| `_check_expert_modules` (parallel) | `loadplan.check_expert_modules` | `test_refuses_a_moe_module_of_another_parallel_place` |
| `_copy_file` (file replaced) | `loadcopy.copy_file` | `test_copy_refuses_a_file_replaced_after_its_check` |
| `_copy_file` (attn_sink tail) | `loadcopy.copy_file` | `test_copy_reads_byte_exact_and_refuses_a_sink_tail_not_minus_inf` |
| `_check_digests` | `loadcopy.check_digests` | `test_verify_full_refuses_tampered_bytes` |
| `_check_zero_regions` | `loadcopy.check_zero_regions` | `test_verify_full_refuses_a_nonzero_pad_region` |

The refusals of `load_manifest`, `check_watch` and the cross-node identity are src/lucifer_shard/runtime_shim/manifest.py's and
crossnode.py's, unchanged (tests/test_hostile_inputs.py, tests/shim/test_loader.py).
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lucifer_shard.engine.stage import stage
from lucifer_shard.formats.torch_dtypes import TORCH_DTYPE
from lucifer_shard.model.config import DSPARK, MTP
from lucifer_shard.model.drafts import DRAFT_KINDS
from lucifer_shard.runtime_shim.errors import ShimError
from lucifer_shard.runtime_shim.load import loadcopy, loadfiles, loadplan
from lucifer_shard.runtime_shim.load.loadplan import Engine, ModelView, MoeModule, Param
from lucifer_shard.runtime_shim.manifest import Output, load_manifest, rank_entry

from helpers import rank_tensors

SINK_PARAM_LEN = 32  # vLLM's SM120 attention pads 24 local heads to 32
TARGET = "DeepseekV4ForCausalLM"
PART = "target/rank-0/part-00000.safetensors"
EXPERTS = "model.layers.2.ffn.experts.routed_experts"


@pytest.fixture(scope="module")
def out_kernel(converted) -> Path:
    return converted(arch="sm120", expert_layout="kernel")


@pytest.fixture(scope="module")
def out_model(converted) -> Path:
    return converted(arch="sm120", expert_layout="model")


@pytest.fixture
def out_copy(out_kernel, tmp_path) -> Path:
    """A copy of out_kernel to damage (pytest removes tmp_path)."""
    return Path(shutil.copytree(out_kernel, tmp_path / "out"))


def engine(**kw) -> Engine:
    return Engine(**{"tp": 3, "rank": 0, "sizes": {}, "verify": "headers", **kw})


def view(doc, role: str = "target", rank: int = 0, cls: str | None = None, drop=(), params: dict | None = None,
         moe: dict | None = None) -> ModelView:
    """The model vLLM would build for the files: each tensor's parameter (attn_sink backend-padded), the draft's
    runtime-owned ones, edited by `drop` and `params`."""
    entry = doc.rank(role, rank)
    found = {n: Param((SINK_PARAM_LEN,), t.dtype) if loadplan.is_sink(n, t) else Param(t.shape, t.dtype)
             for n, t in entry.tensors.items()}
    if role == "draft":
        found["model.embed_tokens.weight"] = Param((8, 8), "BF16")  # vLLM aliases it from the target
    for n in drop:
        found.pop(n)
    found.update(params or {})
    name = cls or (TARGET if role == "target" else DRAFT_KINDS[MTP].vllm_class)
    return ModelView(name, found, moe or {})


def refused(fn, *args, needles=(), **kw) -> str:
    with pytest.raises(ShimError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("lucifer_tp3: "), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def with_entry(doc, role: str, rank: int, **changes):
    """`doc` with one rank record changed (the frozen record's dataclasses.replace, one level down)."""
    ranks = list(doc.roles[role])
    ranks[rank] = dataclasses.replace(ranks[rank], **changes)
    return dataclasses.replace(doc, roles={**doc.roles, role: tuple(ranks)})


# --------------------------------------------------------------------- the plan of a good output


def test_the_plan_imports_neither_vllm_nor_torch():
    code = ("import sys, lucifer_shard.runtime_shim.load.loadplan; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


@pytest.mark.parametrize("role", ["target", "draft"])
def test_each_rank_plans_every_tensor_of_its_files(out_kernel, role):
    doc = load_manifest(out_kernel)
    for rank in range(3):
        plan = loadplan.plan_load(Output(out_kernel, doc), engine(rank=rank), view(doc, role, rank))
        entry = doc.rank(role, rank)
        assert plan.role == role and plan.entry == entry
        assert [f.file.declared for f in plan.files] == list(entry.files)
        reads = {r.name: r for f in plan.files for r in f.reads}
        assert set(reads) == set(entry.tensors)
        for f in plan.files:
            for r in f.reads:
                h = f.file.header.tensors[r.name]
                assert r.offset == f.file.header.data_start + h.start and r.param == r.name
        sinks = {n for n, r in reads.items() if r.prefix is not None}
        assert sinks == {n for n, t in entry.tensors.items() if loadplan.is_sink(n, t)}
        assert all(reads[n].prefix == entry.tensors[n].shape[0] for n in sinks)
        if role == "target":
            assert sinks and EXPERTS in plan.expert_groups
            assert sorted(plan.expert_groups[EXPERTS]) == sorted(loadplan.EXPERT_TENSORS)
        else:
            assert "model.embed_tokens.weight" not in reads  # runtime owned: no file holds it


def test_a_model_layout_output_tags_nothing(out_model):
    doc = load_manifest(out_model)
    assert loadplan.plan_load(Output(out_model, doc), engine(), view(doc)).expert_groups == {}


def test_sm90_folded_scales_fill_the_parameter_viewed_in_the_files_shape(converted):
    """SM90's kernel layout folds the scales 5-D at the parameter's byte count: the read views the 3-D parameter."""
    out = converted(arch="sm90", expert_layout="kernel")
    doc = load_manifest(out)
    entry = doc.rank("target", 0)
    folded = {n: t for n, t in entry.tensors.items() if len(t.shape) == 5}
    assert folded, "no folded scale in the sm90 output"
    params = {n: Param(t.model_shape, t.dtype) for n, t in folded.items()}
    plan = loadplan.plan_load(Output(out, doc), engine(arch="sm90", capability="9.0"), view(doc, params=params))
    reads = {r.name: r for f in plan.files for r in f.reads}
    assert all(reads[n].view == t.shape for n, t in folded.items())
    name, t = next(iter(folded.items()))
    bad = Param((t.model_shape[0], t.model_shape[1] + 1, t.model_shape[2]), t.dtype)
    refused(loadplan.plan_load, Output(out, doc), engine(arch="sm90", capability="9.0"), view(doc, params={name: bad}),
            needles=("shape mismatch", name, "no narrowing"))


def test_a_persistent_buffer_may_hold_a_file_tensor_and_need_not(out_kernel):
    doc = load_manifest(out_kernel)
    name, t = next((n, t) for n, t in doc.rank("target", 0).tensors.items() if not t.kernel and len(t.shape) == 2)
    extra = {name: Param(t.shape, t.dtype, buffer=True), "model.some_state": Param((4,), "F32", buffer=True)}
    plan = loadplan.plan_load(Output(out_kernel, doc), engine(), view(doc, params=extra))
    assert name in {r.name for f in plan.files for r in f.reads}


# --------------------------------------------------------------------- before vLLM builds the model


def test_engine_refuses_vllm_settings(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.check_engine, Output(out_kernel, doc), ["expert parallel on"], 3, None, None,
            needles=("cannot load per-TP-rank files with expert parallel on",))


def test_engine_refuses_another_tp_size(out_kernel):
    refused(loadplan.check_engine, Output(out_kernel, load_manifest(out_kernel)), [], 4, None, None,
            needles=("tensor_parallel_size 4, but the files were built for 3", "-tp 3", "--tp 4"))


def test_engine_refuses_kernel_layout_without_relayout(out_kernel, out_model):
    refused(loadplan.check_engine, Output(out_kernel, load_manifest(out_kernel)), [], 3, "matches no build vetted for it",
            None, needles=("has routed experts in kernel layout", "re-layout wrapper is not installed: matches no "
                           "build vetted for it", "--expert-layout model"))
    loadplan.check_engine(Output(out_model, load_manifest(out_model)), [], 3, "matches no build vetted for it", None)


def test_engine_refuses_sm90_files_without_their_flashinfer(converted):
    out = converted(arch="sm90", expert_layout="kernel")
    doc = load_manifest(out)
    assert doc.flashinfer_layout == "folded"
    msg = refused(loadplan.check_engine, Output(out, doc), [], 3, None, None, needles=(f"{out}/lucifer-manifest.json: ",))
    assert "folded sm90 layout" in msg, msg


# --------------------------------------------------------------------- at load: engine, share, role, class


def test_refuses_pipeline_parallel(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(sizes={"pp": 2}), view(doc),
            needles=("pipeline parallel size 2", "--pipeline-parallel-size 1"))


@pytest.mark.parametrize("dim,flag", [("dp", "--data-parallel-size 1"), ("pcp", "--prefill-context-parallel-size 1")])
def test_refuses_dp_and_pcp(out_kernel, dim, flag):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(sizes={dim: 2}), view(doc),
            needles=(f"{dim} size 2; the MoE shard index flattens dp/pcp into TP", flag))


def test_refuses_another_tp_size_at_load(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(tp=2), view(doc),
            needles=("tensor_parallel_size 2, but the files were built for 3",))


def test_refuses_a_share_without_this_rank(out_model, tmp_path):
    share = tmp_path / "node1"
    stage(out_model, share, [1], nnodes=3, node_rank=1)
    doc = load_manifest(share)
    loadplan.plan_load(Output(share, doc), engine(rank=1), view(doc, rank=1))
    refused(loadplan.plan_load, Output(share, doc), engine(rank=2), view(doc, rank=2),
            needles=("node 1's share", "TP rank 2"))


def test_refuses_a_role_key_that_is_not_the_model(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(forced_role="draft"), view(doc),
            needles=("role='draft' but the model being loaded is the target model", "drop the role key"))


def test_refuses_a_model_that_is_not_what_vllm_loads(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(role_hint="draft"), view(doc),
            needles=("vLLM is loading the draft model but its parameters look like the target model",))


def test_refuses_another_target_class(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, cls="LlamaForCausalLM"),
            needles=("model class LlamaForCausalLM is not DeepseekV4ForCausalLM", "config.json"))


def test_refuses_a_draft_class_of_another_kind(out_kernel):
    """An MTP output whose draft vLLM built as the DSpark class (and the reverse is the same check)."""
    doc = load_manifest(out_kernel)
    dspark = DRAFT_KINDS[DSPARK].vllm_class
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, "draft", cls=dspark),
            needles=(f"vLLM built the draft as {dspark} but {out_kernel}/draft holds a", "--speculative-config",
                     '"method":"mtp"'))


def test_refuses_a_role_the_output_lacks(out_kernel):
    doc = load_manifest(out_kernel)
    target_only = dataclasses.replace(doc, roles={"target": doc.roles["target"]})
    refused(rank_entry, Output(out_kernel, target_only), "draft", 0,
            needles=("has no 'draft' role (roles: target)", "--no-mtp"))


def test_refuses_a_rank_the_manifest_lacks(out_kernel):
    doc = load_manifest(out_kernel)
    short = dataclasses.replace(doc, roles={**doc.roles, "target": doc.roles["target"][:2]})
    refused(rank_entry, Output(out_kernel, short), "target", 2,
            needles=("rank files missing", "lists no target files for rank 2 of tp_size 3"))


# --------------------------------------------------------------------- the files against manifest and header


def test_refuses_a_rank_without_files(out_kernel):
    doc = with_entry(load_manifest(out_kernel), "target", 0, files=())
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc),
            needles=("rank files missing", "lists no files for target rank 0"))


def test_refuses_a_missing_rank_file(out_copy):
    doc = load_manifest(out_copy)
    (out_copy / PART).unlink()
    refused(loadplan.plan_load, Output(out_copy, doc), engine(), view(doc), needles=("rank files missing", PART, "--resume"))


@pytest.mark.parametrize("verify", ["headers", "none"])
def test_refuses_a_truncated_rank_file(out_copy, verify):
    doc = load_manifest(out_copy)
    data = (out_copy / PART).read_bytes()
    (out_copy / PART).write_bytes(data[:-100])
    if verify == "none":  # the size is not checked, the tensors' spans still are
        refused(loadplan.plan_load, Output(out_copy, doc), engine(verify=verify), view(doc), needles=(str(out_copy / PART),))
        return
    refused(loadplan.plan_load, Output(out_copy, doc), engine(), view(doc),
            needles=(f"{out_copy / PART} is {len(data) - 100} bytes, the manifest says {len(data)}", "re-copy it"))


def test_refuses_a_corrupt_header(out_copy):
    doc = load_manifest(out_copy)
    data = bytearray((out_copy / PART).read_bytes())
    data[8] = ord("[")  # the JSON header no longer an object; the size unchanged
    (out_copy / PART).write_bytes(bytes(data))
    refused(loadplan.plan_load, Output(out_copy, doc), engine(), view(doc),
            needles=(str(out_copy / PART), "the file is corrupt; run lucifer-shard convert again"))


def test_refuses_a_file_of_another_conversion_weights_or_place(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, dataclasses.replace(doc, conversion_id="0" * 16)), engine(), view(doc),
            needles=("metadata lucifer.conversion_id", "from another conversion",
                     "choose a fresh directory for OUT, then run lucifer-shard convert again"))
    entry = doc.rank("target", 0)
    other = tuple(dataclasses.replace(f, content="blake3:" + "0" * 64) for f in entry.files)
    refused(loadplan.plan_load, Output(out_kernel, with_entry(doc, "target", 0, files=other)), engine(), view(doc),
            needles=("metadata lucifer.content", "other source weights"))
    refused(loadfiles.check_files, Output(out_kernel, doc), "target", 1, entry, identity=True,
            needles=("metadata lucifer.rank='0', manifest expects '1'", "misplaced"))
    assert loadfiles.check_files(Output(out_kernel, doc), "target", 1, entry, identity=False)  # verify=none: not stamped


def test_refuses_a_header_with_other_tensors(out_kernel):
    doc = load_manifest(out_kernel)
    entry = doc.rank("target", 0)
    gone = sorted(n for n, t in entry.tensors.items() if t.file == PART)[0]
    fewer = {n: t for n, t in entry.tensors.items() if n != gone}
    refused(loadfiles.check_files, Output(out_kernel, doc), "target", 0, dataclasses.replace(entry, tensors=fewer),
            identity=True, needles=("holds tensors the manifest does not list", gone, "lacks listed ones (none)"))


def test_refuses_a_header_tensor_of_another_shape(out_kernel):
    doc = load_manifest(out_kernel)
    entry = doc.rank("target", 0)
    name, t = next((n, t) for n, t in entry.tensors.items() if t.file == PART and len(t.shape) == 2)
    wider = dataclasses.replace(t, shape=(t.shape[0], t.shape[1] + 1))
    want = f"{t.dtype}({t.shape[0]},{t.shape[1] + 1})"
    refused(loadfiles.check_files, Output(out_kernel, doc), "target", 0,
            dataclasses.replace(entry, tensors={**entry.tensors, name: wider}), identity=False,
            needles=(f"tensor {name} is {t.dtype}({t.shape[0]},{t.shape[1]}) but the manifest says {want}",))


# --------------------------------------------------------------------- keys, dtypes, shapes


def test_refuses_missing_and_unexpected_keys(out_kernel):
    doc = load_manifest(out_kernel)
    new = {"model.layers.0.attn.new_thing": Param((2,), "F32")}
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, params=new),
            needles=("key missing: 1 parameter(s) of the target model are not in rank 0", *new))
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, drop=("model.layers.1.attn.wq_b.weight",)),
            needles=("key unexpected: 1 tensor(s) of target rank 0 files", "model.layers.1.attn.wq_b.weight"))
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, "draft", drop=("model.embed_tokens.weight",),
                                                               params={"model.x": Param((1,), "F32")}),
            needles=("key missing", "model.x"))


def test_refuses_another_dtype_unless_declared_view(out_kernel):
    doc = load_manifest(out_kernel)
    entry = doc.rank("target", 0)
    name, t = next((n, t) for n, t in entry.tensors.items() if t.dtype == "BF16")
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, params={name: Param(t.shape, "F32")}),
            needles=(f"dtype mismatch: tensor {name} is BF16 in the files, param is F32", "no casting"))
    name, t = next((n, t) for n, t in entry.tensors.items() if t.dtype == "U8" and t.view_as is None)
    e8m0 = {name: Param(t.shape, "F8_E8M0")}
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, params=e8m0),
            needles=("dtype mismatch", name, "U8 in the files, param is F8_E8M0"))

    def declared(as_: str):
        return with_entry(doc, "target", 0, tensors={**entry.tensors, name: dataclasses.replace(t, view_as=as_)})

    loadplan.plan_load(Output(out_kernel, declared("F8_E8M0")), engine(), view(doc, params=e8m0))  # the one reinterpretation
    refused(loadplan.plan_load, Output(out_kernel, declared("BF16")), engine(), view(doc, params={name: Param(t.shape, "BF16")}),
            needles=("dtype mismatch", name, "U8 in the files, param is BF16"))


def test_refuses_a_sink_param_shorter_than_the_heads(out_kernel):
    doc = load_manifest(out_kernel)
    name, t = next((n, t) for n, t in doc.rank("target", 0).tensors.items() if loadplan.is_sink(n, t))
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, params={name: Param((t.shape[0] - 1,), t.dtype)}),
            needles=("shape mismatch", name, "attn_sink is copied into a prefix only"))


def test_refuses_another_shape_no_narrowing(out_kernel):
    doc = load_manifest(out_kernel)
    name, t = next((n, t) for n, t in doc.rank("target", 0).tensors.items() if not t.kernel and len(t.shape) == 2)
    bigger = (t.shape[0] + 8, t.shape[1])
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, params={name: Param(bigger, t.dtype)}),
            needles=("shape mismatch", name, f"({t.shape[0]},{t.shape[1]}) != param ({bigger[0]},{bigger[1]})"))


def test_refuses_a_virtual_tp_plan_difference(out_kernel):
    doc = load_manifest(out_kernel)
    diff = "virtual-TP plan mismatch on axis moe_intermediate_size (runtime padded_size 2160, manifest 2112)"
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(plan_difference=diff), view(doc),
            needles=(diff, f"then run lucifer-shard serve {out_kernel} (it starts vLLM with the plugin's virtual-TP"))


# --------------------------------------------------------------------- expert groups and MoE modules


def test_refuses_kernel_layout_outside_routed_experts(out_kernel):
    doc = load_manifest(out_kernel)
    entry = doc.rank("target", 0)
    kernel = next(t for t in entry.tensors.values() if t.kernel)
    name, t = next((n, t) for n, t in entry.tensors.items() if ".experts." not in f".{n}")
    odd = dataclasses.replace(entry, tensors={**entry.tensors, name: dataclasses.replace(t, layout=kernel.layout)})
    refused(loadplan.expert_groups, Output(out_kernel, doc), odd,
            needles=(f"tensor {name} has layout {kernel.layout!r}", "only the four routed-expert tensors"))


def test_refuses_kernel_tensors_in_a_model_layout_output(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.expert_groups, Output(out_kernel, dataclasses.replace(doc, expert_layout="model")), doc.rank("target", 0),
            needles=("expert_layout is 'model' but", "has layout"))


def test_refuses_an_incomplete_expert_group(out_kernel):
    doc = load_manifest(out_kernel)
    entry = doc.rank("target", 0)
    gone = f"{EXPERTS}.{loadplan.EXPERT_TENSORS[0]}"
    fewer = dataclasses.replace(entry, tensors={n: t for n, t in entry.tensors.items() if n != gone})
    refused(loadplan.expert_groups, Output(out_kernel, doc), fewer, needles=(f"{EXPERTS} has only", "run the same convert command with --force"))


def moe(doc, **kw) -> dict[str, MoeModule]:
    return {EXPERTS: MoeModule(**{"backend": doc.moe_variant, "parallel": (0, 3, 1), **kw})}


def test_refuses_kernel_layout_for_another_gpu_family(out_kernel):
    doc = load_manifest(out_kernel)
    loadplan.plan_load(Output(out_kernel, doc), engine(arch="sm120", capability="12.0"), view(doc, moe=moe(doc)))
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(arch="sm90", capability="9.0"), view(doc),
            needles=("GPU capability 9.0 but files were laid out for sm120", "--arch sm90"))


def test_refuses_a_moe_module_without_relayout(out_kernel):
    doc = load_manifest(out_kernel)
    loadplan.plan_load(Output(out_kernel, doc), engine(relayout_missing="no"), view(doc))  # no MoE module: nothing re-lays
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(relayout_missing="matches no build vetted for it"),
            view(doc, moe=moe(doc)), needles=(f"{EXPERTS}: experts arrive in kernel layout", "--expert-layout model",
                                              "re-layout wrapper is not installed (matches no build vetted for it)"))


def test_refuses_a_moe_module_of_another_backend(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, moe=moe(doc, backend="MARLIN")),
            needles=(f"MoE backend resolved to MARLIN on layer {EXPERTS}", f"files require {doc.moe_variant}",
                     "--moe-backend flashinfer_cutlass"))


def test_refuses_a_moe_module_of_another_parallel_place(out_kernel):
    doc = load_manifest(out_kernel)
    refused(loadplan.plan_load, Output(out_kernel, doc), engine(), view(doc, moe=moe(doc, parallel=(0, 1, 3))),
            needles=(f"{EXPERTS}: MoE parallel (tp_rank, tp_size, ep_size)=(0, 1, 3), files need (0, 3, 1)",))


# --------------------------------------------------------------------- the plan carried out (torch, no vLLM)


def targets_for(doc, role: str = "target", rank: int = 0) -> dict[str, torch.Tensor]:
    """Parameters as vLLM builds them for the files: zeros; attn_sink a -inf vector longer than the heads."""
    out = {}
    for n, t in doc.rank(role, rank).tensors.items():
        shape = (SINK_PARAM_LEN,) if loadplan.is_sink(n, t) else t.shape
        fill = float("-inf") if loadplan.is_sink(n, t) else 0
        out[n] = torch.full(shape, fill, dtype=TORCH_DTYPE[t.dtype])
    return out


def carry_out(out: Path, targets: dict, verify: str = "full", tamper=None) -> None:
    doc = load_manifest(out)
    model = ModelView(TARGET, {n: loadcopy.describe(p) for n, p in targets.items()}, {})
    plan = loadplan.plan_load(Output(out, doc), engine(verify=verify), model)
    for f in plan.files:
        if tamper:
            tamper(f)
        digests = loadcopy.copy_file(out, "target", 0, f, targets, digests=verify == "full")
        if verify == "full":
            loadcopy.check_digests(f.file, plan.entry, digests)
    if verify == "full":
        loadcopy.check_zero_regions(plan.entry, targets)


def test_copy_reads_byte_exact_and_refuses_a_sink_tail_not_minus_inf(out_kernel):
    doc = load_manifest(out_kernel)
    targets = targets_for(doc)
    carry_out(out_kernel, targets)
    files = rank_tensors(out_kernel, "target", 0)
    for n, t in doc.rank("target", 0).tensors.items():
        got = targets[n][: t.shape[0]] if loadplan.is_sink(n, t) else targets[n]
        assert got.contiguous().view(torch.uint8).numpy().tobytes() == files[n].tobytes(), n
    name = next(n for n, t in doc.rank("target", 0).tensors.items() if loadplan.is_sink(n, t))
    targets = targets_for(doc)
    targets[name][-1] = 0.0
    with pytest.raises(ShimError, match=r"are not -inf after loading the \d+ logical heads"):
        carry_out(out_kernel, targets, verify="headers")


def test_copy_refuses_a_file_replaced_after_its_check(out_copy):
    def replace(f):
        if f.file.declared.path == PART:  # the same bytes under another inode, made while the first still exists
            twin = out_copy / "twin"
            twin.write_bytes((out_copy / PART).read_bytes())
            twin.replace(out_copy / PART)

    with pytest.raises(ShimError, match="was replaced while vLLM loaded it"):
        carry_out(out_copy, targets_for(load_manifest(out_copy)), verify="headers", tamper=replace)


def test_verify_full_refuses_tampered_bytes(out_copy):
    doc = load_manifest(out_copy)
    name, t = next((n, t) for n, t in doc.rank("target", 0).tensors.items() if t.file == PART and not t.kernel)
    f = next(f for f in loadfiles.check_files(Output(out_copy, doc), "target", 0, doc.rank("target", 0), True)
             if f.declared.path == PART)
    at = f.header.data_start + f.header.tensors[name].start
    data = bytearray((out_copy / PART).read_bytes())
    data[at] ^= 0xFF
    (out_copy / PART).write_bytes(bytes(data))
    with pytest.raises(ShimError, match=rf"verify=full: loaded {name} digest"):
        carry_out(out_copy, targets_for(doc))


def test_verify_full_refuses_a_nonzero_pad_region(out_kernel):
    doc = load_manifest(out_kernel)
    entry = doc.rank("target", 0)
    name, t = next((n, t) for n, t in entry.tensors.items() if t.zero_regions and not t.kernel and t.pad == "zero")
    targets = targets_for(doc)
    carry_out(out_kernel, targets)
    dim, start, end = t.zero_regions[0]
    targets[name].narrow(dim + (1 if t.stacked else 0), start, end - start).view(torch.uint8).fill_(1)
    with pytest.raises(ShimError, match=rf"verify=full: {name} pad region dim {dim} \[{start}:{end}\) is not zero"):
        loadcopy.check_zero_regions(entry, targets)
