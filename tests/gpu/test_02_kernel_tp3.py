"""Kernel at world size 3: FlashInfer's real `cutlass_fused_moe` (SM90, MXFP4 x BF16) run on each
rank file's expert tensors exactly as `lucifer-shard convert --tp 3 --arch sm90` wrote them, on two
checkpoints: `flash-moe` (8 experts) at M = 1, 8, 16, 64, and one real Flash MoE layer
(`flash-layer --layers 1`: 256 experts, top-6, hidden 4096, routed 2048 -> 704 -> 768 per rank) at
M = 1, 8, 64, 256, where the largest M routes every expert at least once.

Per M, with random BF16 activations and distinct top-6 routing:
  * each rank's partial vs `moe_reference` on that rank's model-layout tensors (Output.model_tensor):
    relative Frobenius <= 2e-3, elementwise max|d| <= 2 ulp_bf16(|ref|) + 1e-3 max|ref| for >= 99.9 %
    of the elements, all finite (docs/design/kernel-layouts.md §5.4);
  * the three partials summed in fp32 vs `moe_reference` on the UNSHARDED source experts
    ([w1 ; w3], I = 2048, no padding): relative Frobenius <= 5e-3, all finite.
"""
from __future__ import annotations

import pytest
import torch

import gpu_harness as H

pytestmark = pytest.mark.gpu

CASES = [(p, m) for p in (H.MOE, H.FLASH) for m in H.MS[p]]


@pytest.mark.parametrize("preset, m", CASES, ids=[f"{p}-M{m}" for p, m in CASES])
def test_tp3_partials_sum_to_the_unsharded_reference(preset, m, fi, geometry):
    _, fmoe = fi
    g = geometry(preset)
    ck = g.ck
    cover = preset == H.FLASH and m == max(H.MS[preset])
    x, ids, w = H.make_routing(m, ck.hidden, ck.experts, ck.top_k, seed=100 + m, device=H.DEVICE, cover=cover)
    routed = int(torch.unique(ids).numel())
    ref = H.reference(x, ids, w, g.full, ck.swiglu_limit)
    partials, ranks = [], []
    for r in range(H.TP):
        p = H.run_kernel(fmoe, x, ids, w, g.stored[r], r, H.TP, ck.swiglu_limit)
        H.sync()
        mr = H.metrics(p, H.reference(x, ids, w, g.model[r], ck.swiglu_limit))
        mr["rank"] = r
        mr["ok"] = H.rank_ok(mr)
        ranks.append(mr)
        partials.append(p)
    total = partials[0].float() + partials[1].float() + partials[2].float()
    ms = H.metrics(total, ref)
    ms["ok"] = H.sum_ok(ms)
    call = lambda: H.run_kernel(fmoe, x, ids, w, g.stored[0], 0, H.TP, ck.swiglu_limit)  # noqa: E731
    call()
    kernel_ms = H.time_ms(call, 5)
    H.record("kernel_tp3", test=f"{preset} M={m}", preset=preset, experts=ck.experts, M=m, seed=100 + m,
             experts_routed=routed, ranks=ranks, sum=ms, kernel_ms_rank0=round(kernel_ms, 4),
             tol={"rank_rel": H.TOL_RANK_REL, "sum_rel": H.TOL_SUM_REL, "elem_frac": H.ELEM_FRAC,
                  "elem_rule": f"{H.ELEM_ULPS} ulp_bf16(|ref|) + {H.ELEM_REL_MAX} max|ref|"},
             shapes={n: list(g.stored[0][n].shape) for n in H.NAMES})
    msg = (f"{preset} M={m}: " + "; ".join(f"rank {d['rank']} {H.fmt(d)}" for d in ranks)
           + f"; TP3 sum vs TP1 {H.fmt(ms)}")
    if cover:
        assert routed == ck.experts, f"only {routed} of {ck.experts} experts routed. {msg}"
    for d in ranks:
        assert d["finite"], f"rank {d['rank']} partial has NaN/Inf. {msg}"
        assert d["rel"] <= H.TOL_RANK_REL, f"rank {d['rank']} vs its reference. {msg}"
        assert d["frac_ok"] >= H.ELEM_FRAC, f"rank {d['rank']} elementwise rule. {msg}"
    assert ms["finite"], f"TP3 sum has NaN/Inf. {msg}"
    assert ms["rel"] <= H.TOL_SUM_REL, f"TP3 sum vs unsharded reference. {msg}"
