"""Numerical proof on the CPU: rank files summed over ranks compute what the unsharded source computes."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import run, Source
from lucifer_shard.engine.convert import convert
from lucifer_shard.engine.synth import synth
from lucifer_shard.errors import SourceError
from lucifer_shard.formats.stheader import read_header
from lucifer_shard.model.options import Options
from lucifer_shard.proof.check_numerics import (ATTN, ROUTED, SHARED, TOLERANCE, VIRTUAL, attn_rank_partials,
                                                check_numerics, compare, evaluate, load_layer, make_inputs, moe_tp_sum,
                                                source_experts)
from lucifer_shard.proof.numerics import (E2M1, attn_output_reference, bf16_round, dequant_fp8_block, dequant_mxfp4,
                                          moe_reference)
from lucifer_shard.proof.outdir import Output
from lucifer_shard.source.checkpoint import open_checkpoint

LAYOUTS = {
    "sm120": dict(arch="sm120"),
    "sm90-folded": dict(arch="sm90", flashinfer_layout="folded"),
    "sm90-legacy": dict(arch="sm90", flashinfer_layout="legacy"),
}
LAYER = 3  # tiny: a score-routed (bias) layer, C128 attention
P = f"model.layers.{LAYER}."
LIMIT = 10.0


# ---------------------------------------------------------------- dequantisation


def test_e2m1_table_matches_the_bit_encoding():
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        exp, man = (code >> 1) & 3, code & 1
        mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
        assert E2M1[code].item() == sign * mag
        assert torch.signbit(E2M1[code]).item() == bool(code & 8)


def test_dequant_mxfp4_hand_values():
    # byte 0x21: element 0 = low nibble 1 (0.5), element 1 = high nibble 2 (1.0)
    # byte 0xF7: element 2 = 7 (6.0), element 3 = 0xF (-6.0); byte 0xB8: -0.0, then 0xB (-1.5)
    packed = torch.tensor([[0x21, 0xF7, 0xB8] + [0x00] * 13], dtype=torch.uint8)
    want = torch.tensor([[0.5, 1.0, 6.0, -6.0, -0.0, -1.5] + [0.0] * 26])
    for byte, factor in ((127, 1.0), (128, 2.0), (120, 2.0 ** -7), (254, 2.0 ** 127), (1, 2.0 ** -126)):
        got = dequant_mxfp4(packed, torch.tensor([[byte]], dtype=torch.uint8))
        assert got.dtype == torch.float32 and got.shape == (1, 32)
        assert torch.equal(got, want * factor), byte
    # kernel E8M0 semantics: byte 0 -> +0.0 (not 2^-127), byte 255 -> +inf (so 0 * inf = NaN)
    zero = dequant_mxfp4(packed, torch.tensor([[0]], dtype=torch.uint8))
    assert torch.equal(zero.abs(), torch.zeros(1, 32))
    inf = dequant_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert inf[0, 0].item() == float("inf") and inf[0, 3].item() == float("-inf") and inf[0, 7].isnan()
    # float8_e8m0fnu / int8 inputs are read as raw bytes, never converted by value
    e8 = torch.tensor([[120]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(dequant_mxfp4(packed.view(torch.int8), e8), want * 2.0 ** -7)
    # groups of 32 along K, leading dims kept
    two = dequant_mxfp4(packed.repeat(3, 2).view(3, 1, 32), torch.tensor([[127, 128]] * 3, dtype=torch.uint8).view(3, 1, 2))
    assert two.shape == (3, 1, 64) and torch.equal(two[:, 0, 32:], two[:, 0, :32] * 2)


def test_dequant_fp8_block_hand_values():
    w = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, -0.25]]).to(torch.float8_e4m3fn)
    wide = torch.zeros(130, 3).to(torch.float8_e4m3fn)
    wide[:2] = w
    wide[129, 2] = 1.0
    scale = torch.tensor([[126], [130]], dtype=torch.uint8)  # 2^-1 for rows 0..127, 2^3 for 128..129
    got = dequant_fp8_block(wide, scale)
    assert torch.equal(got[:2], w.float() * 0.5)
    assert got[129, 2].item() == 8.0 and got[128].abs().sum() == 0
    assert torch.equal(dequant_fp8_block(wide.view(torch.uint8), scale.view(torch.float8_e8m0fnu)), got)
    with pytest.raises(ValueError):
        dequant_fp8_block(wide, scale[:1])


# ---------------------------------------------------------------- routed MoE reference


def _random_experts(g, e, n, k):
    """e experts of an MXFP4 [n, k] matrix: random codes, scales 2^-8..2^-4."""
    return (torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8),
            torch.randint(119, 124, (e, n, k // 32), generator=g, dtype=torch.uint8))


def _loop_reference(x, ids, w, w13, w13s, w2, w2s, limit):
    """Straightforward per-token, per-slot fp32 loop, with its own bit-level dequantisation."""
    def deq(packed, scale):
        p = packed.numpy()
        codes = np.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], -1)
        sign = np.where(codes & 8, -1.0, 1.0)
        exp, man = (codes >> 1) & 3, codes & 1
        mag = np.where(exp == 0, man * 0.5, 2.0 ** (exp - 1) * (1 + man / 2))
        s = 2.0 ** (scale.numpy().astype(np.float64) - 127)
        return torch.from_numpy((sign * mag * np.repeat(s, 32, axis=-1)).astype(np.float32))

    e_count, two_i, _ = w13.shape
    i = two_i // 2
    r = bf16_round
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xt = x[t].float()
        acc = torch.zeros(x.shape[1])
        for kk in range(ids.shape[1]):
            e = int(ids[t, kk])
            if e >= e_count:
                continue
            w13f, w2f = deq(w13[e], w13s[e]), deq(w2[e], w2s[e])
            gate, up = r(w13f[:i] @ xt), r(w13f[i:] @ xt)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            a = r(gate * torch.sigmoid(gate) * up)
            acc = acc + w[t, kk] * r(w2f @ a)
        out[t] = acc
    return out.to(torch.bfloat16)


def test_moe_reference_matches_a_per_token_loop():
    g = torch.Generator().manual_seed(1)
    e, i, h, m, k = 4, 64, 96, 12, 3
    w13, w13s = _random_experts(g, e, 2 * i, h)
    w2, w2s = _random_experts(g, e, h, i)
    x = (torch.randn(m, h, generator=g) * 4).to(torch.bfloat16)  # large enough that the clamp at 10 bites
    ids = torch.stack([torch.randperm(e + 2, generator=g)[:k] for _ in range(m)])  # ids >= e are skipped
    w = torch.rand(m, k, generator=g)
    got = moe_reference(x, ids, w, w13, w13s, w2, w2s, LIMIT)
    want = _loop_reference(x, ids, w, w13, w13s, w2, w2s, LIMIT)
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    assert (ids >= e).any() and torch.isfinite(got.float()).all()
    diff = (got.float() - want.float()).abs()
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=1e-3)
    assert (diff <= 2 * ulp + 1e-6).float().mean() >= 0.999
    assert compare(want.float(), got.float())[2] <= 2e-3
    # a token whose experts are all non-local gets exactly 0
    none = moe_reference(x[:1], torch.full((1, k), e), w[:1], w13, w13s, w2, w2s, LIMIT)
    assert torch.equal(none.float(), torch.zeros(1, h))


def test_moe_reference_reads_gate_from_the_first_half():
    """Model layout [w1 (gate) ; w3 (up)]: swapping the halves changes the result."""
    g = torch.Generator().manual_seed(2)
    w13, w13s = _random_experts(g, 1, 64, 64)
    w2, w2s = _random_experts(g, 1, 64, 32)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    ids, w = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    a = moe_reference(x, ids, w, w13, w13s, w2, w2s, LIMIT)
    b = moe_reference(x, ids, w, w13.roll(32, 1), w13s.roll(32, 1), w2, w2s, LIMIT)
    assert compare(a.float(), b.float())[2] > 0.1


# ---------------------------------------------------------------- TP3 sums vs the unsharded source


@pytest.fixture(scope="module")
def layer_weights(converted, tiny_random):
    cache = {}

    def get(layout: str):
        if layout not in cache:
            out = converted(source=tiny_random, **LAYOUTS[layout])
            ckpt = open_checkpoint(tiny_random)
            cache[layout] = load_layer(ckpt, Output(out), LAYER, cache=True)
        return cache[layout]

    return get


@pytest.mark.parametrize("tokens", [1, 8, 16, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_sums_equal_unsharded(layer_weights, tiny_cfg, layout, tokens):
    lw = layer_weights(layout)
    inp = make_inputs(tiny_cfg.hidden_size, tiny_cfg.n_experts, tiny_cfg.top_k, 72, tiny_cfg.head_dim, tokens,
                      seed=100 + tokens)
    results = {r.component: r for r in evaluate(lw, inp)}
    assert set(results) == {ROUTED, SHARED, ATTN, VIRTUAL}
    for r in results.values():
        assert r.ok, r
        assert np.isfinite([r.max_abs, r.rel_fro]).all()
    assert results[ROUTED].rel_fro <= 5e-3  # docs/design/kernel-layouts.md §5.4: TP3 sum vs TP1
    assert results[SHARED].rel_fro <= 1e-5 and results[ATTN].rel_fro <= 1e-5  # exact up to summation order
    assert results[VIRTUAL].max_abs == 0.0
    assert results[VIRTUAL].detail == "heads 64..71, groups 8"  # one group: not "8..8" (issue 53)


def test_virtual_heads_and_group_8_contribute_exactly_zero(layer_weights, tiny_cfg):
    lw = layer_weights("sm120")
    assert lw.local_heads == 24 and len(lw.rank_attn) == 3
    g = torch.Generator().manual_seed(3)
    o = torch.randn(16, 72, tiny_cfg.head_dim, generator=g).to(torch.bfloat16)
    # only rank 2's virtual heads 64..71 (its local heads 16..23, local group 2 = global group 8) non-zero
    o_virtual = torch.zeros_like(o)
    o_virtual[:, 64:] = o[:, 64:]
    assert (o_virtual[:, 64:] != 0).float().mean() > 0.99
    for part in attn_rank_partials(o_virtual, lw):
        assert torch.equal(part, torch.zeros_like(part))
    # after wo_a alone: group 8's o_lora_rank outputs are exactly 0 (zero wo_a rows)
    wo_a, wo_as, wo_b, wo_bs = lw.rank_attn[2]
    r = tiny_cfg.o_lora_rank
    a = dequant_fp8_block(wo_a, wo_as)
    z8 = o[:, 64:].float().reshape(16, -1) @ a[2 * r:3 * r].T
    assert torch.equal(z8, torch.zeros_like(z8)) and torch.equal(a[2 * r:], torch.zeros_like(a[2 * r:]))
    b = dequant_fp8_block(wo_b, wo_bs)
    assert torch.equal(b[:, 2 * r:], torch.zeros_like(b[:, 2 * r:]))  # zero wo_b columns of group 8
    # with every head non-zero, rank 2's partial is bit-identical whatever its virtual heads hold
    o_real = o.clone()
    o_real[:, 64:] = 0
    assert torch.equal(attn_rank_partials(o, lw)[2], attn_rank_partials(o_real, lw)[2])
    # and the full rank sum equals the source over the 64 real heads
    ref = attn_output_reference(o[:, :64], *lw.src_attn)
    assert compare(ref, sum(attn_rank_partials(o, lw)))[2] <= TOLERANCE[ATTN]


# ---------------------------------------------------------------- the check has teeth


def _rank_experts_numpy(src: Source, layer: int, n_experts: int, w2_offsets, w2s_offsets):
    """Per-rank model-layout expert tensors built from the source with numpy, with the given w2
    byte / w2-scale group offsets (w13 always at the correct 0/704/1408 rows, 768-row halves)."""
    ranks = []
    for r in range(3):
        n = min(704, 2048 - 704 * r)
        w13 = np.zeros((n_experts, 1536, 128), np.uint8)
        w13s = np.zeros((n_experts, 1536, 8), np.uint8)
        w2 = np.zeros((n_experts, 256, 384), np.uint8)
        w2s = np.zeros((n_experts, 256, 24), np.uint8)
        for e in range(n_experts):
            k = f"layers.{layer}.ffn.experts.{e}."
            for half, name in ((0, "w1"), (768, "w3")):
                w13[e, half:half + n] = src.get(k + name + ".weight")[704 * r:704 * r + n]
                w13s[e, half:half + n] = src.get(k + name + ".scale")[704 * r:704 * r + n]
            b, s = src.get(k + "w2.weight"), src.get(k + "w2.scale")
            chunk = b[:, w2_offsets[r]:w2_offsets[r] + 384]
            w2[e, :, :chunk.shape[1]] = chunk
            chunk = s[:, w2s_offsets[r]:w2s_offsets[r] + 24]
            w2s[e, :, :chunk.shape[1]] = chunk
        ranks.append(tuple(torch.from_numpy(t) for t in (w13, w13s, w2, w2s)))
    return ranks


def test_stock_unit_blind_offsets_give_a_large_error(tiny_random, tiny_cfg):
    src = Source(tiny_random)
    ckpt = open_checkpoint(tiny_random)
    e = tiny_cfg.n_experts
    unsharded = source_experts(ckpt, f"layers.{LAYER}.", list(range(e)))
    inp = make_inputs(tiny_cfg.hidden_size, e, tiny_cfg.top_k, 72, tiny_cfg.head_dim, 16, seed=5)
    ref = moe_reference(inp.x, inp.topk_ids, inp.topk_weights, *unsharded, LIMIT).float()
    stock = _rank_experts_numpy(src, LAYER, e, w2_offsets=(0, 384, 768), w2s_offsets=(0, 24, 48))
    correct = _rank_experts_numpy(src, LAYER, e, w2_offsets=(0, 352, 704), w2s_offsets=(0, 22, 44))
    bad = compare(ref, moe_tp_sum(inp.x, inp.topk_ids, inp.topk_weights, stock, LIMIT))[2]
    good = compare(ref, moe_tp_sum(inp.x, inp.topk_ids, inp.topk_weights, correct, LIMIT))[2]
    assert good <= TOLERANCE[ROUTED]
    assert bad > 0.3, bad  # O(1): ranks 1 and 2 pair w2 columns with the wrong intermediate rows
    assert bad > 50 * TOLERANCE[ROUTED]


def test_check_numerics_command_passes_and_fails(converted, tiny_random, tmp_path):
    out = converted(source=tiny_random, arch="sm120")
    res = run("check-numerics", out, tiny_random, "--tokens", "8", "--json")
    assert res.exit_code == 0, res.output
    envelope = json.loads(res.stdout)
    doc = envelope["result"]
    assert envelope["ok"] and envelope["command"] == "check-numerics"
    assert doc["ok"] and doc["tp_size"] == 3 and doc["layers"] == [0, 1]
    assert {r["component"] for r in doc["results"]} == {ROUTED, SHARED, ATTN, VIRTUAL}
    res = run("check-numerics", out, "--layers", "4", "--tokens", "2")  # MODEL: recorded
    assert res.exit_code == 0 and "output projection" in res.output and "all within tolerance" in res.output
    # tamper: rank 1's w2 (and shared down_proj) replaced by rank 0's -> the command fails with exit 1
    bad = tmp_path / "out"
    shutil.copytree(out, bad)
    rank0, rank1 = bad / "target/rank-0/part-00000.safetensors", bad / "target/rank-1/part-00000.safetensors"
    # in place, at the same offsets: the files keep their size, header and identity (what check-numerics
    # checks before any layer), only the numbers change
    h0, h1 = read_header(rank0), read_header(rank1)
    with open(rank0, "rb") as f0, open(rank1, "r+b") as f1:
        for name in ("ffn.experts.routed_experts.w2_weight", "ffn.shared_experts.down_proj.weight"):
            t0, t1 = h0.tensors[P + name], h1.tensors[P + name]
            f0.seek(len(h0.block) + t0.start)
            f1.seek(len(h1.block) + t1.start)
            f1.write(f0.read(t0.end - t0.start))
    report = check_numerics(bad, str(tiny_random), layers=[LAYER], tokens=4, progress=False)
    failed = {r.component for r in report.results if not r.ok}
    assert failed == {ROUTED, SHARED}
    res = run("check-numerics", bad, tiny_random, "--layers", LAYER)
    assert res.exit_code == 1 and "FAIL" in res.output
    assert "error: numerics past tolerance" in res.output


# ---------------------------------------------------------------- padding, 0x00 and 0xFF scales


def _stacked(fetch):
    """Every expert of an expert fetch as stacked (w13, w13_scale, w2, w2_scale)."""
    return tuple(torch.stack(t) for t in zip(*(fetch(e) for e in range(fetch.n_experts))))


def test_zero_padding_with_scale_byte_0_contributes_exactly_zero(layer_weights, tiny_cfg):
    lw = layer_weights("sm120")
    w13, w13s, w2, w2s = _stacked(lw.rank_moe[2])  # rank 2: 640 real rows per half, 128 zero rows; w2 320 real bytes
    pad13 = torch.cat([w13[:, 640:768], w13[:, 1408:]], 1)
    pad13s = torch.cat([w13s[:, 640:768], w13s[:, 1408:]], 1)
    assert not pad13.any() and not pad13s.any() and not w2[:, :, 320:].any() and not w2s[:, :, 20:].any()
    d13 = dequant_mxfp4(pad13, pad13s)
    assert torch.equal(d13, torch.zeros_like(d13)) and not torch.signbit(d13).any()  # +0.0, never NaN
    # the padded partial equals the partial of the same rank trimmed to its 640 real columns
    inp = make_inputs(tiny_cfg.hidden_size, 8, tiny_cfg.top_k, 72, tiny_cfg.head_dim, 16, seed=9)
    padded = moe_reference(inp.x, inp.topk_ids, inp.topk_weights, w13, w13s, w2, w2s, LIMIT)
    trimmed = moe_reference(inp.x, inp.topk_ids, inp.topk_weights,
                            torch.cat([w13[:, :640], w13[:, 768:1408]], 1), torch.cat([w13s[:, :640], w13s[:, 768:1408]], 1),
                            w2[:, :, :320].contiguous(), w2s[:, :, :20].contiguous(), LIMIT)
    assert compare(trimmed.float(), padded.float())[2] <= 1e-6
    # whatever sits in the pad's weight bytes, scale byte 0 makes it contribute exactly 0
    noisy = w2.clone()
    noisy[:, :, 320:] = torch.randint(1, 256, noisy[:, :, 320:].shape, dtype=torch.uint8)
    assert torch.equal(moe_reference(inp.x, inp.topk_ids, inp.topk_weights, w13, w13s, noisy, w2s, LIMIT), padded)


def test_planted_0xff_scale_yields_nan_in_the_reference(layer_weights, tiny_cfg):
    """As the kernel on an H200 (docs/evidence/gpu-validation.md): a 0xFF scale makes its GEMM output NaN
    (inf * 0); in W2 that reaches the output, in W13 the clamped SwiGLU's fminf turns the NaN gate
    into the limit (a finite, wrong row), and only without a limit does it reach the output."""
    w13, w13s, w2, w2s = (t.clone() for t in _stacked(layer_weights("sm120").rank_moe[0]))
    ids = torch.tensor([[5, 1], [2, 3]])
    x = torch.randn(2, tiny_cfg.hidden_size).to(torch.bfloat16)
    run = lambda *t, limit=LIMIT: moe_reference(x, ids, torch.full((2, 2), 0.5), *t, limit).float()  # noqa: E731
    clean = run(w13, w13s, w2, w2s)
    bad13, bad13s = w13.clone(), w13s.clone()
    bad13[5, 10, :16] = 0x00  # a zero code in the group, so inf * 0 = NaN for certain
    bad13s[5, 10, 0] = 0xFF   # row 10: a gate row of expert 5
    out = run(bad13, bad13s, w2, w2s)
    assert torch.isfinite(out).all() and not torch.equal(out[0], clean[0]) and torch.equal(out[1], clean[1])
    assert run(bad13, bad13s, w2, w2s, limit=None)[0].isnan().all()
    bad2, bad2s = w2.clone(), w2s.clone()
    bad2[5, 7, :16] = 0x00
    bad2s[5, 7, 0] = 0xFF     # output column 7 of expert 5
    out = run(w13, w13s, bad2, bad2s)
    assert out[0, 7].isnan() and out[0].isnan().sum() == 1  # the token routed to expert 5
    assert torch.equal(out[1], clean[1])  # the other token is untouched


def test_converter_refuses_a_0xff_expert_scale(tmp_path):
    model = synth("tiny", tmp_path / "model", layers=2, fill="random", seed=3, mtp=False, progress=False)
    key = "layers.1.ffn.experts.2.w2.scale"
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard = model / index[key]
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    raw = tensors[key].view(torch.uint8).clone()
    raw[7, 3] = 0xFF
    tensors[key] = raw.view(torch.float8_e8m0fnu)
    save_file(tensors, str(shard), metadata=meta)
    with pytest.raises(SourceError, match=r"layers\.1\.ffn\.experts\.2\.w2\.scale.*0xFF"):
        convert(str(model), tmp_path / "out", Options(tp=3, mtp=False), progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))


# ---------------------------------------------------------------- a reference that is not numbers (issue 27)


def _strict(text: str):
    """json.loads that refuses NaN and Infinity, as JSON.parse does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_pattern_checkpoint_is_refused_as_the_source_naming_its_tensors(converted, tiny_pattern):
    """`synth --fill pattern` bytes are not a model's numbers: check-numerics says so (kind source,
    exit 2) with the layer and the source tensors, instead of 'numerics past tolerance'."""
    out = converted()
    res = run("check-numerics", out, tiny_pattern, "--tokens", "4", "--json")
    assert res.exit_code == 2, res.output
    envelope = _strict(res.stdout)
    message = envelope["error"]["message"]
    assert envelope["error"]["kind"] == "source" and not envelope["ok"]
    assert message.startswith("layer 0 routed MoE: the unsharded reference is not finite"), message
    assert "layers.0.ffn.experts." in message and "synth --fill pattern" in message, message
    assert "past tolerance" not in res.output
    res = run("check-numerics", out, tiny_pattern, "--tokens", "4", "--quiet")
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: layer 0 "), res.output


def test_nan_in_the_rank_files_is_a_failure_with_null_figures(converted, tiny_random, tmp_path):
    """The reference is finite, a rank's shared down_proj is NaN: that component fails (exit 1) and
    the --json report holds null, never NaN, where a figure is not a finite number."""
    bad = tmp_path / "out"
    shutil.copytree(converted(source=tiny_random, arch="sm120"), bad)
    rank1 = bad / "target/rank-1/part-00000.safetensors"
    # in place: the file keeps its size, header and identity (checked before any layer is read)
    h = read_header(rank1)
    t = h.tensors[P + "ffn.shared_experts.down_proj.weight"]
    with open(rank1, "r+b") as f:
        f.seek(len(h.block) + t.start)
        f.write(b"\x7f" * (t.end - t.start))  # E4M3 NaN
    res = run("check-numerics", bad, tiny_random, "--layers", LAYER, "--tokens", "4", "--json")
    assert res.exit_code == 1, res.output
    envelope = _strict(res.stdout)
    assert envelope["error"]["kind"] == "mismatch" and "shared expert" in envelope["error"]["message"]
    shared = [r for r in envelope["result"]["results"] if r["component"] == SHARED]  # the report rides along
    assert shared[0]["ok"] is False and shared[0]["rel_fro"] is None
    report = check_numerics(bad, str(tiny_random), layers=[LAYER], tokens=4, progress=False)
    shared = [r for r in report.results if r.component == SHARED][0]
    assert not shared.ok and shared.rel_fro is None and shared.max_abs is None and "NaN/Inf" in shared.detail
    assert _strict(json.dumps(report.to_dict())) and "NaN/Inf" in "\n".join(report.lines())


def test_the_first_proof_passes_on_synth_default_fill(tmp_path):
    """README's first proof as a new user types it: `synth tiny model` (no --fill), convert, diff,
    check-numerics: every step exits 0 (the default fill is numbers)."""
    model, out = tmp_path / "model", tmp_path / "out"
    assert run("synth", "tiny", model, "-q").exit_code == 0
    assert run("convert", "--tp", "3", "--arch", "sm120", model, out, "-q").exit_code == 0
    assert run("diff", out, "-q").exit_code == 0
    res = run("check-numerics", out, "--layers", "0", "--tokens", "4")
    assert res.exit_code == 0 and "all within tolerance" in res.output, res.output
    assert "[default: random]" in run("synth", "--help").output
