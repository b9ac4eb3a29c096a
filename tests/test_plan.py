"""The virtual-TP plan and per-rank source ranges: the audit's goldens at real Flash size."""
from __future__ import annotations

import pytest

from lucifer_shard.errors import PlanError
from lucifer_shard.model.plan import make_plan, stock_padded
from lucifer_shard.model.tensorspecs import build_specs, expected_sources


def test_audit_tp3_axis_table(flash_cfg):
    p = make_plan(flash_cfg, 3)
    got = {n: (a.original, a.padded, a.local, a.kernel_local) for n, a in p.axes.items()}
    assert got == {
        "heads": (64, 72, 24, 24),
        "groups": (8, 9, 3, 3),
        "routed": (2048, 2112, 704, 768),
        "shared": (2048, 2304, 768, 768),
        "vocab": (129280, 129408, 43136, 43136),
    }
    assert [p.heads.real(r) for r in range(3)] == [24, 24, 16]
    assert [p.routed.real(r) for r in range(3)] == [704, 704, 640]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_plain_split_where_nothing_pads(flash_cfg, tp):
    p = make_plan(flash_cfg, tp)
    for a in p.axes.values():
        assert a.padded == a.original and a.local * tp == a.original, a
    assert p.routed.kernel_local == p.routed.local  # 2048/tp is a multiple of 128 for these sizes
    assert not p.pads


@pytest.mark.parametrize("tp", [0, 9, -1])
def test_unsupported_tp_sizes(flash_cfg, tp):
    with pytest.raises(PlanError, match="outside the supported range"):
        make_plan(flash_cfg, tp)


def _by_name(flash_cfg, tp=3, role="target"):
    ranks = build_specs(flash_cfg, make_plan(flash_cfg, tp), role)
    return [{s.name: s for s in specs} for specs in ranks]


def _ranges(ranks, name, seg=0):
    """Per rank: (src_start, src_end, tail) in stored units."""
    return [(r[name].pieces[seg].src_start, r[name].pieces[seg].src_start + r[name].pieces[seg].length,
             r[name].pieces[seg].seg_len - r[name].pieces[seg].length) for r in ranks]


L = "model.layers.3."
EXP = L + "ffn.experts.routed_experts."


def test_routed_expert_ranges_are_unit_aware(flash_cfg):
    ranks = _by_name(flash_cfg)
    # w1 / w3 rows (unpacked), each half padded to the kernel width 768
    for seg in (0, 1):
        assert _ranges(ranks, EXP + "w13_weight", seg) == [(0, 704, 64), (704, 1408, 64), (1408, 2048, 128)]
        assert _ranges(ranks, EXP + "w13_weight_scale", seg) == [(0, 704, 64), (704, 1408, 64), (1408, 2048, 128)]
    assert [r[EXP + "w13_weight"].pieces[1].dst_start for r in ranks] == [768] * 3
    # w2: packed FP4 bytes along K, and E8M0 groups of 32 along K: the audit's bug, fixed
    assert _ranges(ranks, EXP + "w2_weight") == [(0, 352, 32), (352, 704, 32), (704, 1024, 64)]
    assert _ranges(ranks, EXP + "w2_weight_scale") == [(0, 22, 2), (22, 44, 2), (44, 64, 4)]
    assert ranks[0][EXP + "w13_weight"].shape == (256, 1536, 2048)
    assert ranks[0][EXP + "w2_weight"].shape == (256, 4096, 384)
    assert ranks[0][EXP + "w2_weight_scale"].shape == (256, 4096, 24)
    assert ranks[0][EXP + "w13_weight"].dtype == "U8"


def test_attention_and_shared_ranges(flash_cfg):
    ranks = _by_name(flash_cfg)
    assert _ranges(ranks, L + "attn.wq_b.weight") == [(0, 12288, 0), (12288, 24576, 0), (24576, 32768, 4096)]
    assert _ranges(ranks, L + "attn.wq_b.weight_scale_inv") == [(0, 96, 0), (96, 192, 0), (192, 256, 32)]
    assert _ranges(ranks, L + "attn.wo_a.weight") == [(0, 3072, 0), (3072, 6144, 0), (6144, 8192, 1024)]
    assert _ranges(ranks, L + "attn.wo_a.weight_scale_inv") == [(0, 24, 0), (24, 48, 0), (48, 64, 8)]
    assert _ranges(ranks, L + "attn.wo_b.weight") == [(0, 3072, 0), (3072, 6144, 0), (6144, 8192, 1024)]
    assert ranks[0][L + "attn.wo_b.weight"].pieces[0].dim == 1
    assert _ranges(ranks, L + "attn.wo_b.weight_scale_inv") == [(0, 24, 0), (24, 48, 0), (48, 64, 8)]
    assert _ranges(ranks, L + "attn.attn_sink") == [(0, 24, 0), (24, 48, 0), (48, 64, 8)]
    assert ranks[2][L + "attn.attn_sink"].pad == b"\x00\x00\x80\xff"  # -inf float32
    for seg in (0, 1):
        assert _ranges(ranks, L + "ffn.shared_experts.gate_up_proj.weight", seg) == \
            [(0, 768, 0), (768, 1536, 0), (1536, 2048, 256)]
        assert _ranges(ranks, L + "ffn.shared_experts.gate_up_proj.weight_scale_inv", seg) == \
            [(0, 6, 0), (6, 12, 0), (12, 16, 2)]
    assert _ranges(ranks, L + "ffn.shared_experts.down_proj.weight") == [(0, 768, 0), (768, 1536, 0), (1536, 2048, 256)]
    assert _ranges(ranks, "model.embed_tokens.weight") == [(0, 43136, 0), (43136, 86272, 0), (86272, 129280, 128)]
    assert _ranges(ranks, "lm_head.weight") == [(0, 43136, 0), (43136, 86272, 0), (86272, 129280, 128)]


def test_replicated_and_fused(flash_cfg):
    ranks = _by_name(flash_cfg)
    fused = ranks[1][L + "attn.fused_wqa_wkv.weight"]
    assert fused.shape == (1536, 4096) and [(p.source, p.dst_start, p.length) for p in fused.pieces] == [
        ("layers.3.attn.wq_a.weight", 0, 1024), ("layers.3.attn.wkv.weight", 1024, 512)]
    assert ranks[0]["model.layers.0.ffn.gate.tid2eid"].dtype == "I32"
    assert ranks[0][L + "ffn.gate.e_score_correction_bias"].shape == (256,)
    assert ranks[0]["model.layers.2.attn.compressor.fused_wkv_wgate.weight"].shape == (2048, 4096)
    assert ranks[0][L + "attn.compressor.fused_wkv_wgate.weight"].shape == (1024, 4096)


def test_tensor_counts_and_byte_budget(flash_cfg):
    """docs/design/tensor-plan.md §2 and §3.5: 69,187 source tensors; 1,502 + 39 per rank; exact bytes."""
    assert len(expected_sources(flash_cfg)) == 69187
    target = build_specs(flash_cfg, make_plan(flash_cfg, 3), "target")
    draft = build_specs(flash_cfg, make_plan(flash_cfg, 3), "draft")
    assert [len(r) for r in target] == [1502] * 3 and [len(r) for r in draft] == [39] * 3
    assert sum(s.nbytes for s in target[0]) == 59_232_049_084
    assert sum(s.nbytes for s in draft[0]) == 1_376_044_556
    names = {s.name for s in draft[0]}
    assert "model.layers.43.mtp_block.ffn.experts.routed_experts.w2_weight" in names
    assert "model.layers.43.shared_head.norm.weight" in names and "model.layers.43.e_proj.weight_scale_inv" in names


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_logical_element_has_exactly_one_home(flash_cfg, tp):
    """Property: per source key and sharded dim, the ranks' real ranges tile the source exactly once,
    and every destination segment holds its real part first, then pad (never overlapping)."""
    sources = expected_sources(flash_cfg)
    for role in ("target", "draft"):
        ranks = build_specs(flash_cfg, make_plan(flash_cfg, tp), role)
        covered: dict[str, list[tuple[int, int, int]]] = {}
        for specs in ranks:
            for spec in specs:
                dims = spec.matrix_shape
                segs = sorted((p.dst_start, p.seg_len) for p in spec.pieces)
                assert sum(n for _, n in segs) == dims[spec.pieces[0].dim]
                assert all(a + n == b for (a, n), (b, _) in zip(segs, segs[1:]))
                for p in spec.pieces:
                    assert 0 <= p.length <= p.seg_len
                    key = p.source.replace("{e}", "0")
                    covered.setdefault(key, []).append((p.dim, p.src_start, p.length))
        for key, spans in covered.items():
            dim = spans[0][0]
            size = sources[key].shape[dim]
            if all(s == (dim, 0, size) for s in spans):  # replicated: whole tensor on every rank
                assert len(spans) == tp
                continue
            spans = sorted(s for s in spans if s[2])
            pos = 0
            for _, start, length in spans:
                assert start == pos, (key, spans)
                pos += length
            assert pos == size, (key, spans)


# ------------------------------------------- vLLM's own vocabulary padding is not virtual TP

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_vocab_pad_to_64_is_vllms_own_not_virtual_tp(tiny_cfg, tp):
    """tiny's vocabulary 1000 -> 1024 at these sizes is what vLLM's VocabParallelEmbedding pads
    to by itself (a multiple of 64); a vLLM without a virtual-TP plan loads it (issue 13)."""
    from lucifer_shard.runtime_shim.manifest import compare_plan, pads_virtually

    plan = make_plan(tiny_cfg, tp)
    assert plan.vocab.padded == 1024 == stock_padded("vocab", 1000)
    assert not pads_virtually(plan) and compare_plan(None, plan) is None


def test_virtual_vocab_pad_still_needs_the_plan(tiny_cfg):
    """At TP3 the vocabulary is padded to lcm(64, 3) = 192: 1000 -> 1152, beyond vLLM's own 1024.
    With heads, groups, routed and shared widths that split evenly, the vocabulary alone still
    makes a missing runtime plan a refusal."""
    from dataclasses import replace

    from lucifer_shard.runtime_shim.manifest import compare_plan, pads_virtually

    cfg = replace(tiny_cfg, num_heads=48, o_groups=6, moe_intermediate=2304)
    plan = make_plan(cfg, 3)
    assert [n for n, a in plan.axes.items() if a.padded != a.original] == ["vocab"]
    assert pads_virtually(plan)
    assert compare_plan(None, plan) == ("virtual-TP plan missing at runtime, but the files pad axis vocab_size "
                                        "1000 -> 1152 (vLLM alone pads it to 1024)")


def test_flash_vocab_is_a_multiple_of_64(flash_cfg):
    from lucifer_shard.runtime_shim.manifest import compare_plan

    assert stock_padded("vocab", flash_cfg.vocab_size) == 129280
    assert compare_plan(None, make_plan(flash_cfg, 3)).endswith("attention_heads 64 -> 72")
    assert all(compare_plan(None, make_plan(flash_cfg, tp)) is None for tp in (1, 2, 4, 8))
