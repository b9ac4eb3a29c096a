"""The b12x route (issue 42): `--moe-backend b12x` plans the routed experts at their exact per-rank width
(704 at TP3) for stock vLLM's b12x MoE, which rounds nothing (vLLM's
`mxfp4_round_up_hidden_size_and_intermediate_size` returns B12X widths as they are; FlashInfer-CUTLASS,
Marlin and TRT-LLM round to 128). The files it writes are proven like every other output (diff, verify);
vLLM's own NVIDIA class loading them is tests/shim/test_b12x.py."""
from __future__ import annotations

import json

import pytest

from lucifer_shard.model.options import Options
from lucifer_shard.model.plan import make_plan
from lucifer_shard.model.runtimes import runtime_record, stock_backends
from lucifer_shard.output.manifest import conversion_id
from lucifer_shard.proof.diff import diff
from lucifer_shard.proof.verify import verify

from helpers import CONFIGS, run

EXPERTS = "model.layers.1.ffn.experts.routed_experts"


@pytest.mark.parametrize("tp,local", [(1, 2048), (2, 1024), (3, 704), (4, 512), (8, 256)])
def test_b12x_keeps_the_virtual_tp_width_the_default_rounds_to_128(flash_cfg, tp, local):
    routed = make_plan(flash_cfg, tp, "b12x").routed
    assert (routed.local, routed.kernel_local) == (local, local)
    default = make_plan(flash_cfg, tp).routed
    assert default.local == local and default.kernel_local == -(-local // 128) * 128
    assert make_plan(flash_cfg, tp, "b12x").shared == make_plan(flash_cfg, tp).shared  # block FP8: 128s either way


def test_the_default_routes_conversion_id_is_the_one_it_had():
    """Options.to_dict leaves moe_backend out unless it is set: outputs converted before the field existed keep
    their identity (and `convert --resume` keeps accepting them)."""
    o = Options(tp=3)
    assert "moe_backend" not in o.to_dict() and Options(tp=3, moe_backend="b12x").to_dict()["moe_backend"] == "b12x"
    assert conversion_id("f" * 64, o) != conversion_id("f" * 64, Options(tp=3, moe_backend="b12x"))


def test_the_runtime_record_and_backends_name_b12x():
    o = Options(tp=3, arch=None, expert_layout="model", moe_backend="b12x")
    assert stock_backends(None, "model", "b12x") == stock_backends("sm121", "model", "b12x") == (
        "FLASHINFER_MLA_SPARSE_DSV4", "b12x")
    rec = runtime_record(o)
    assert rec["moe_backend"] == "b12x" and "mlow/vllm" not in rec["vllm_line"] and "sm120/sm121" in rec["vllm_line"]


@pytest.mark.parametrize("args,why", [
    (["--arch", "sm90"], "runs on sm120/sm121 GPUs only"),
    (["--arch", "sm100"], "runs on sm120/sm121 GPUs only"),
    (["--arch", "sm120", "--expert-layout", "kernel"], "takes model layout only"),
])
def test_what_b12x_cannot_serve_is_refused_in_one_line(args, why):
    r = run("plan", "--tp", "3", "--moe-backend", "b12x", *args, CONFIGS / "deepseek-v4-flash.json")
    assert r.exit_code == 2 and why in r.output and r.output.count("\n") <= 2, r.output


def test_plan_shows_the_per_rank_bytes_and_the_saving_against_768():
    """DeepSeek-V4-Flash at TP3: each of the 43 target layers and the MTP layer holds, per rank, 64 fewer routed
    columns of 256 experts: W13 2 x 64 rows of 2048 bytes and 128 scale bytes, W2 4096 rows of 32 bytes and 2
    scale groups (the audit's 704/768 units)."""
    per_layer = 256 * (2 * 64 * (2048 + 128) + 4096 * (32 + 2))
    r = run("plan", "--tp", "3", "--moe-backend", "B12X", "--json", CONFIGS / "deepseek-v4-flash.json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)["result"]
    saving = doc["route_saving"]
    assert (saving["routed_width"], saving["default_routed_width"]) == (704, 768)
    # the files' bytes: the tensors', up to their headers' offsets, which are written as decimal text
    assert all(abs(b - a - 44 * per_layer) < 4096 for a, b in zip(saving["rank_bytes"], saving["default_rank_bytes"]))
    assert doc["plan"]["axes"]["routed"]["kernel_local"] == 704 and doc["moe_backend"] == "b12x"
    text = run("plan", "--tp", "3", "--moe-backend", "b12x", CONFIGS / "deepseek-v4-flash.json").output
    assert "b12x route: routed experts 704 wide per rank (768 on the default route)" in text
    assert "rank 0: 52.06 GiB against 56.45 GiB: 4.38 GiB less (7.8%)" in text


@pytest.mark.parametrize("preset", ["tiny", "forward"])
def test_b12x_outputs_are_their_checkpoint_byte_for_byte(tmp_path, converted, preset):
    """convert --moe-backend b12x on tiny and forward: diff and verify prove the files; the routed experts are 704
    wide per rank with rank 2's last 64 columns zero. (forward's 0.6 GB go with its tmp_path, not the session's
    conversions: no other test reads them.)"""
    from lucifer_shard.engine.convert import convert
    from lucifer_shard.engine.synth import synth

    options = {"arch": None, "expert_layout": "model", "moe_backend": "b12x"}
    if preset == "forward":
        out = tmp_path / "out"
        source = synth("forward", tmp_path / "model", fill="random", seed=1, progress=False)
        convert(str(source), out, Options(tp=3, **options), progress=False)
    else:
        out = converted(**options)
    d, v = diff(out, progress=False), verify(out, progress=False)
    assert d.ok and v.ok, (d.problem_lines(), v.problem_lines())
    man = json.loads((out / "lucifer-manifest.json").read_text())
    assert man["options"]["moe_backend"] == "b12x" and man["runtime"]["moe_backend"] == "b12x"
    t = man["roles"]["target"]["ranks"][2]["tensors"]
    assert t[f"{EXPERTS}.w13_weight"]["shape"][1] == 2 * 704
    assert t[f"{EXPERTS}.w2_weight_scale"]["zero_regions"] == [[1, 20, 22]]


def test_a_scale_tail_that_is_not_0x00_is_refused_by_verify(converted, tmp_path):
    """The E8M0 scale tails' pad value is 0x00 on every route (docs/output-format.md, "Pad values"): the manifest
    records `pad: zero` for the scale tensors, and verify refuses a tail byte of 0x7F (2^0), naming the region."""
    from test_diff import PART, copy_out, flip, named, tensor_start

    name = f"{EXPERTS}.w2_weight_scale"
    out = copy_out(converted(arch=None, expert_layout="model", moe_backend="b12x"), tmp_path)
    man = json.loads((out / "lucifer-manifest.json").read_text())
    assert man["roles"]["target"]["ranks"][2]["tensors"][name]["pad"] == "zero"
    path = out / PART.format(2)
    start, shape = tensor_start(path, name)  # [experts, hidden, 22]: rank 2's groups 20 and 21 are the tail
    offset = start + 0 * shape[1] * shape[2] + 7 * shape[2] + 21
    flip(path, offset, 0x7F)
    (pad,) = named(verify(out, progress=False), name, 2, "pad")
    assert pad.detail["region"] == [1, 20, 22] and pad.detail["file_offset"] == [offset]


def test_serve_asks_vllm_for_b12x_and_refuses_another_moe_backend(converted):
    """serve's command for a b12x output names vLLM's b12x MoE and the SM120 family's attention, whatever GPU
    this box has (none here); a --moe-backend among the vLLM arguments is refused in one line, since only b12x
    takes the 704 width (a default-route model-layout output may take another backend)."""
    from test_serve_cli import run

    out = converted(arch=None, expert_layout="model", moe_backend="b12x")
    r = run("serve", out, "--dry-run", "--json")
    command = json.loads(r.stdout)["result"]["command"]
    assert "--attention-backend FLASHINFER_MLA_SPARSE_DSV4 --moe-backend b12x" in command, command
    r = run("serve", out, "--dry-run", "--", "--moe-backend", "flashinfer_cutlass")
    assert r.exit_code == 2 and "--moe-backend is in the vLLM arguments but lucifer-shard serve sets it" in r.output
    assert r.output.strip().count("\n") == 0, r.output
    default = converted(arch=None, expert_layout="model")
    assert run("serve", default, "--dry-run", "--", "--moe-backend", "marlin").exit_code in (0, 1)


def test_inspect_names_b12x_as_the_moe_variant_of_a_b12x_output(converted):
    """Issue 64: inspect printed "MoE variant any" beside "MoE b12x" for a b12x output, whose width only that
    backend takes."""
    r = run("inspect", converted(arch=None, expert_layout="model", moe_backend="b12x"))
    assert r.exit_code == 0 and "MoE variant b12x only (its routed width)" in r.stdout, r.output
    r = run("inspect", converted(arch=None, expert_layout="model"))
    assert "MoE variant any (vLLM picks it for the GPU)" in r.stdout, r.output
