"""DeepSeek-V4-Flash-0731 (a DSpark drafter under `mtp.*`): its config, its plan, and conversions proven
by diff and verify: of the `dspark` synth preset, and of a 0731-shaped checkpoint this file writes from
its own tensor table (the names, shapes and dtypes of the 0731 inventory at small size, the parameter
names of vLLM 0.34.0's `DSparkDeepseekV4ForCausalLM`), not from the converter's rules.

vLLM's own DSpark class loading the rank files is tests/shim/test_dspark_model.py.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import CONFIGS, rank_tensors, raw, run, scratch
from lucifer_shard.errors import SourceError
from lucifer_shard.model.config import DSPARK, parse_config
from lucifer_shard.model.plan import make_plan
from lucifer_shard.model.tensorspecs import build_specs

CONFIG_0731 = CONFIGS / "deepseek-v4-flash-0731.json"
# the pin of the published config (OpenTallas checkpoint_source.json, in the team's checkpoint notes)
SHA256_0731 = "6c8f3d2d3b48707541b88f32f22ef3f0f8a6b57d8523281e2b8d3cdb0ae9a023"
# TP3 rank bytes of the tensors (no headers), from the 0731 tensor inventory: target and drafter
TP3_TARGET_BYTES = 59_232_049_084
TP3_DRAFT_BYTES = 4_215_909_244


def cfg_0731() -> dict:
    return json.loads(CONFIG_0731.read_text())


def test_the_shipped_0731_config_is_the_published_file():
    assert hashlib.sha256(CONFIG_0731.read_bytes()).hexdigest() == SHA256_0731


def test_0731_is_a_dspark_checkpoint_with_three_stages():
    cfg = parse_config(cfg_0731())
    assert (cfg.draft_kind, cfg.num_mtp, cfg.dspark_target_layers, cfg.draft_tokens) == (DSPARK, 3, (40, 41, 42), 5)
    assert cfg.layer_ids("draft") == [43, 44, 45] and cfg.confidence_head


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.pop("dspark_markov_rank"), "has DSpark field(s) dspark_block_size, dspark_noise_token_id, "
                                            "dspark_target_layer_ids but not dspark_markov_rank"),
    (lambda c: c.update(dspark_target_layer_ids=[41, 42, 43]), "name layer(s) [43] of a 43-layer model"),
    (lambda c: c.update(compress_ratios=c["compress_ratios"][:-1]),
     "compress_ratios has 45 entries, expected num_hidden_layers + the 3 DSpark stages"),
    (lambda c: c.update(n_mtp_layers=2), "compress_ratios has 46 entries, expected num_hidden_layers + the 2 DSpark"),
    (lambda c: c.update(dspark_noise_token_id=129280), "dspark_noise_token_id 129280 is outside the vocabulary"),
    (lambda c: c.update(dspark_markov_rank="256"), "field dspark_markov_rank"),
])
def test_a_broken_dspark_config_is_refused_in_one_line(edit, needle):
    raw_cfg = cfg_0731()
    edit(raw_cfg)
    with pytest.raises(SourceError) as e:
        parse_config(raw_cfg)
    assert needle in str(e.value) and "\n" not in str(e.value), e.value


def test_tp3_rank_bytes_are_the_inventorys():
    """Per rank at TP3 the rules give the 0731 inventory's tensor bytes: the target's 55.16 GiB and the
    drafter's 3.93 GiB (the stages shard as target layers; main_proj, context_wkv_proj, the Markov and
    confidence heads are replicated, the confidence head widened to F32)."""
    cfg = parse_config(cfg_0731())
    plan = make_plan(cfg, 3)
    for role, want in (("target", TP3_TARGET_BYTES), ("draft", TP3_DRAFT_BYTES)):
        for specs in build_specs(cfg, plan, role):
            assert sum(s.nbytes for s in specs) == want, role


def test_plan_shows_59_09_gib_per_rank():
    r = run("plan", "--tp", "3", str(CONFIG_0731))
    assert r.exit_code == 0, r.output
    assert "draft: DSpark drafter, 3 stages" in r.output and "method 'dspark'" in r.output
    for node in range(3):
        assert f"node {node}: rank {node}, 59.09 GiB" in r.output
    assert "  draft      0      99     1" in r.output and "3.93 GiB" in r.output


# ------------------------------------------------------------- a 0731-shaped checkpoint written here

H, V, R, E, HEADS, HD, QL, OL, G, I = 256, 1000, 64, 4, 64, 128, 128, 128, 8, 2048
HC, MIX = 4 * H, 24  # hc_mult 4: hc_dim, (2 + hc_mult) * hc_mult
STAGES, LAYERS = 3, 2


def _fp8(name: str, rows: int, cols: int) -> dict:
    return {f"{name}.weight": ("F8_E4M3", (rows, cols)), f"{name}.scale": ("F8_E8M0", (-(-rows // 128), -(-cols // 128)))}


def _layer(p: str, hash_layer: bool) -> dict:
    t = {f"{p}attn_norm.weight": ("BF16", (H,)), f"{p}ffn_norm.weight": ("BF16", (H,)),
         f"{p}attn.attn_sink": ("F32", (HEADS,)), f"{p}attn.q_norm.weight": ("BF16", (QL,)),
         f"{p}attn.kv_norm.weight": ("BF16", (HD,)), f"{p}ffn.gate.weight": ("BF16", (E, H))}
    for x in ("attn", "ffn"):
        t.update({f"{p}hc_{x}_fn": ("F32", (MIX, HC)), f"{p}hc_{x}_base": ("F32", (MIX,)), f"{p}hc_{x}_scale": ("F32", (3,))})
    t.update(_fp8(f"{p}attn.wq_a", QL, H) | _fp8(f"{p}attn.wkv", HD, H) | _fp8(f"{p}attn.wq_b", HEADS * HD, QL)
             | _fp8(f"{p}attn.wo_a", G * OL, HEADS // G * HD) | _fp8(f"{p}attn.wo_b", H, G * OL)
             | _fp8(f"{p}ffn.shared_experts.w1", I, H) | _fp8(f"{p}ffn.shared_experts.w3", I, H)
             | _fp8(f"{p}ffn.shared_experts.w2", H, I))
    t[f"{p}ffn.gate.tid2eid" if hash_layer else f"{p}ffn.gate.bias"] = ("I64", (V, 2)) if hash_layer else ("F32", (E,))
    for e in range(E):
        for w in ("w1", "w3"):
            t[f"{p}ffn.experts.{e}.{w}.weight"] = ("I8", (I, H // 2))
            t[f"{p}ffn.experts.{e}.{w}.scale"] = ("F8_E8M0", (I, H // 32))
        t[f"{p}ffn.experts.{e}.w2.weight"] = ("I8", (H, I // 2))
        t[f"{p}ffn.experts.{e}.w2.scale"] = ("F8_E8M0", (H, I // 32))
    return t


def table_0731() -> dict[str, tuple[str, tuple[int, ...]]]:
    """The 0731 checkpoint's tensors at small size: the original's target, `mtp.{0,1,2}` decoder stages and
    the drafter's heads (mtp.0: main_proj, main_norm; mtp.2: norm, hc_head, Markov and confidence heads)."""
    t = {"embed.weight": ("BF16", (V, H)), "head.weight": ("BF16", (V, H)), "norm.weight": ("BF16", (H,)),
         "hc_head_fn": ("F32", (4, HC)), "hc_head_base": ("F32", (4,)), "hc_head_scale": ("F32", (1,))}
    for i in range(LAYERS):
        t.update(_layer(f"layers.{i}.", i == 0))
    for j in range(STAGES):
        t.update(_layer(f"mtp.{j}.", False))
    t.update(_fp8("mtp.0.main_proj", H, 3 * H))
    t.update({"mtp.0.main_norm.weight": ("BF16", (H,)), "mtp.2.norm.weight": ("BF16", (H,)),
              "mtp.2.hc_head_fn": ("F32", (4, HC)), "mtp.2.hc_head_base": ("F32", (4,)),
              "mtp.2.hc_head_scale": ("F32", (1,)), "mtp.2.markov_head.markov_w1.weight": ("BF16", (V, R)),
              "mtp.2.markov_head.markov_w2.weight": ("BF16", (V, R)),
              "mtp.2.confidence_head.proj.weight": ("BF16", (1, H + R))})
    return t


def _tensor(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    n = int(np.prod(shape))
    if dtype == "I64":
        return torch.from_numpy(rng.integers(0, E, n, dtype=np.int64).reshape(shape))
    if dtype in ("I8", "F8_E8M0"):  # E8M0: 2^-8..2^-4, never 0xFF
        data = rng.integers(0, 256, n, dtype=np.uint8) if dtype == "I8" else rng.integers(119, 124, n, dtype=np.uint8)
        return torch.from_numpy(data.reshape(shape)).view({"I8": torch.int8, "F8_E8M0": torch.float8_e8m0fnu}[dtype])
    t = torch.from_numpy(rng.standard_normal(n, dtype=np.float32).reshape(shape))
    return t.to({"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}[dtype])


@pytest.fixture(scope="module")
def ckpt_0731(tmp_path_factory) -> Iterator[Path]:
    with scratch(tmp_path_factory, "shaped-0731") as root:
        yield write_0731(root)


def write_0731(root: Path) -> Path:
    cfg = {**cfg_0731(), "vocab_size": V, "hidden_size": H, "num_hidden_layers": LAYERS, "q_lora_rank": QL,
           "o_lora_rank": OL, "head_dim": HD, "index_head_dim": 128, "n_routed_experts": E, "num_experts_per_tok": 2,
           "num_hash_layers": 1, "compress_ratios": [0] * (LAYERS + STAGES), "dspark_target_layer_ids": [0, 1, 1],
           "dspark_markov_rank": R, "dspark_noise_token_id": V - 1}
    rng = np.random.default_rng(731)
    tensors = {k: _tensor(d, s, rng) for k, (d, s) in table_0731().items()}
    keys = sorted(tensors)
    shards = {f"model-0000{n + 1}-of-00002.safetensors": keys[n::2] for n in range(2)}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(root / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def draft_names_vllm() -> set[str]:
    """The parameters of vLLM 0.34.0's DSparkDeepseekV4ForCausalLM the files must fill at this size
    (`_remap_dspark_name`, the stacked fused_wqa_wkv / gate_up_proj / w13 / w2 of its decoder layers)."""
    names = {"model.main_proj.weight", "model.main_proj.weight_scale_inv", "model.main_norm.weight",
             "model.context_wkv_proj.weight", "model.context_wkv_proj.weight_scale_inv", "model.norm.weight",
             "model.hc_head_fn", "model.hc_head_base", "model.hc_head_scale", "model.markov_head.markov_w1.weight",
             "model.markov_head.markov_w2.weight", "model.confidence_head.proj.weight"}
    for j in range(STAGES):
        p = f"model.layers.{j}."
        names |= {p + n for n in (
            "attn_norm.weight", "ffn_norm.weight", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
            "hc_ffn_base", "hc_ffn_scale", "attn.attn_sink", "attn.q_norm.weight", "attn.kv_norm.weight",
            "attn.fused_wqa_wkv.weight", "attn.fused_wqa_wkv.weight_scale_inv", "attn.wq_b.weight",
            "attn.wq_b.weight_scale_inv", "attn.wo_a.weight", "attn.wo_a.weight_scale_inv", "attn.wo_b.weight",
            "attn.wo_b.weight_scale_inv", "ffn.gate.weight", "ffn.gate.e_score_correction_bias",
            "ffn.shared_experts.gate_up_proj.weight", "ffn.shared_experts.gate_up_proj.weight_scale_inv",
            "ffn.shared_experts.down_proj.weight", "ffn.shared_experts.down_proj.weight_scale_inv",
            *(f"ffn.experts.routed_experts.{w}" for w in ("w13_weight", "w13_weight_scale", "w2_weight",
                                                          "w2_weight_scale")))}
    return names


@pytest.fixture(scope="module")
def out_0731(ckpt_0731, tmp_path_factory) -> Iterator[Path]:
    with scratch(tmp_path_factory, "shaped-0731-out") as root:
        r = run("convert", "--tp", "3", str(ckpt_0731), str(root / "out"), "--quiet")
        assert r.exit_code == 0, r.output
        yield root / "out"


def test_the_shaped_checkpoint_converts_and_proves(out_0731):
    for cmd in ("diff", "verify"):
        r = run(cmd, str(out_0731))
        assert r.exit_code == 0 and "OK" in r.output, (cmd, r.output)
    man = json.loads((out_0731 / "lucifer-manifest.json").read_text())
    assert man["draft"] == {"kind": "dspark", "stages": 3, "tokens": 5}
    for rank in range(3):
        assert set(man["roles"]["draft"]["ranks"][rank]["tensors"]) == draft_names_vllm()


def test_the_drafters_heads_are_the_checkpoints_bytes(ckpt_0731, out_0731):
    """Read back with safetensors: context_wkv_proj is the three stages' wkv stacked (weights and scales),
    the confidence head the BF16 source widened by torch, markov_w2 the source plus zero rows to 64."""
    from safetensors import safe_open

    src = {}
    for f in ckpt_0731.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            src.update({k: h.get_tensor(k) for k in h.keys()})
    for rank in range(3):
        got = rank_tensors(out_0731, "draft", rank)
        want = np.concatenate([raw(src[f"mtp.{j}.attn.wkv.weight"]) for j in range(STAGES)])
        assert np.array_equal(got["model.context_wkv_proj.weight"], want)
        want = np.concatenate([raw(src[f"mtp.{j}.attn.wkv.scale"]) for j in range(STAGES)])
        assert np.array_equal(got["model.context_wkv_proj.weight_scale_inv"], want)
        assert np.array_equal(got["model.confidence_head.proj.weight"],
                              raw(src["mtp.2.confidence_head.proj.weight"].float()))
        w2 = got["model.markov_head.markov_w2.weight"]
        assert w2.shape == (1024, 2 * R) and not w2[V:].any()
        assert np.array_equal(w2[:V], raw(src["mtp.2.markov_head.markov_w2.weight"]))
        assert np.array_equal(got["model.main_proj.weight"], raw(src["mtp.0.main_proj.weight"]))


def test_a_flipped_context_byte_is_found_by_diff(out_0731, tmp_path):
    """The context projection re-reads the stages' wkv (an alias, digested once by its owner): a byte
    changed in it alone is still a difference diff names."""
    import shutil

    from lucifer_shard.formats.stheader import read_header

    out = tmp_path / "out"
    shutil.copytree(out_0731, out)
    path = out / "draft" / "rank-1" / "part-00000.safetensors"
    header = read_header(path)
    at = header.data_start + header.tensors["model.context_wkv_proj.weight"].start + 2 * HD * H + 5  # stage 2
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    r = run("diff", str(out))
    assert r.exit_code == 1 and "model.context_wkv_proj.weight" in r.output, r.output


@pytest.mark.parametrize("max_mib", [1, 64, 1024, 4096])
def test_tensors_reading_one_source_share_a_part_at_any_file_size(max_mib):
    """0731's context projection reads the three stages' wkv, which their fused_wqa_wkv read too: those four
    (weights, and scales) are planned into one draft part, since a part's files are stamped with the digests
    of the source tensors it reads whole. Every other tensor is alone, so the split is the plain one, and
    every source tensor is read by one part only. (With the tensors apart, `convert --max-file-size 8MiB`
    of the dspark preset stopped: "draft part 0: 2 source tensor(s) not read completely".)"""
    from lucifer_shard.engine.job import part_keys, plan_parts, shared_source_groups

    cfg = parse_config(cfg_0731())
    plan = make_plan(cfg, 3)
    for role in ("target", "draft"):
        specs = build_specs(cfg, plan, role)[0]
        groups = [[s.name for s in g] for g in shared_source_groups(specs) if len(g) > 1]
        assert groups == ([] if role == "target" else [
            [f"model.{n}{leaf}" for n in ["context_wkv_proj"] + [f"layers.{j}.attn.fused_wqa_wkv" for j in range(3)]]
            for leaf in (".weight", ".weight_scale_inv")])
        parts = plan_parts(role, specs, max_mib << 20)
        by_name = {s.name: s for s in specs}
        reader = {}
        for part in parts:
            assert part.names == sorted(part.names)
            for key in part_keys(by_name, part):
                assert reader.setdefault(key, part.index) == part.index, (role, key)
        assert sorted(n for part in parts for n in part.names) == sorted(by_name)
        for group in groups:
            assert len({part.index for part in parts if group[0] in part.names and set(group) <= set(part.names)}) == 1


def test_the_dspark_preset_converts_at_a_small_file_size_and_proves(tmp_path):
    model, out = tmp_path / "model", tmp_path / "out"
    assert run("synth", "dspark", str(model), "--quiet").exit_code == 0
    r = run("convert", "--tp", "3", "--arch", "sm90", "--max-file-size", "8MiB", str(model), str(out), "--quiet")
    assert r.exit_code == 0, r.output
    assert len(list((out / "draft" / "rank-0").glob("*.safetensors"))) > 1
    for cmd in ("diff", "verify"):
        r = run(cmd, str(out))
        assert r.exit_code == 0 and "OK" in r.output, (cmd, r.output)


def test_the_dspark_preset_converts_and_serves_with_method_dspark(tmp_path):
    model, out = tmp_path / "model", tmp_path / "out"
    assert run("synth", "dspark", str(model), "--quiet").exit_code == 0
    assert run("convert", "--tp", "3", "--arch", "sm90", str(model), str(out), "--quiet").exit_code == 0
    for cmd in ("diff", "verify"):
        r = run(cmd, str(out))
        assert r.exit_code == 0, (cmd, r.output)
    r = run("serve", str(out), "--draft", "--dry-run", "-q")
    assert """--speculative-config '{"method":"dspark","num_speculative_tokens":5}'""" in r.output, r.output
    r = run("serve", str(out), "--draft", "--draft-tokens", "7", "--dry-run", "-q")
    assert """'{"method":"dspark","num_speculative_tokens":7}'""" in r.output, r.output
    r = run("serve", str(out), "--mtp", "--dry-run")
    assert r.exit_code == 2 and "holds a DSpark drafter, not an MTP layer; use --draft" in r.output, r.output
    r = run("serve", str(out), "--dry-run", "--", "--speculative-config", '{"method":"mtp","num_speculative_tokens":1}')
    assert r.exit_code == 2 and "asks for method 'mtp' but OUT/draft holds a DSpark drafter" in r.output, r.output
    r = run("doctor", str(out), "--draft")
    assert "[  ok] output draft: OUT/draft holds the DSpark drafter (DSparkDeepseekV4ForCausalLM" in r.output
