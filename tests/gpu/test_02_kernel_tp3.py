"""Kernel at world size 3: FlashInfer's real `cutlass_fused_moe` (SM90, MXFP4 x BF16) run on each
rank file's expert tensors exactly as `lucifer-shard convert --tp 3 --arch sm90` wrote them.

Per M in (1, 8, 16, 64), with the same random BF16 activations and distinct top-6 routing:
  * each rank's partial vs `moe_reference` on that rank's model-layout tensors (Output.model_tensor):
    relative Frobenius <= 2e-3, elementwise max|d| <= 2 ulp_bf16(|ref|) + 1e-3 max|ref| for >= 99.9 %
    of the elements, all finite (kernel-layouts.md §5.4);
  * the three partials summed in fp32 vs `moe_reference` on the UNSHARDED source experts
    ([w1 ; w3], I = 2048, no padding): relative Frobenius <= 5e-3, all finite.
"""
from __future__ import annotations

import pytest
import torch

import gpu_harness as H

pytestmark = pytest.mark.gpu


def _time_ms(fn, reps: int = 5) -> float:
    fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


@pytest.mark.parametrize("m", H.MS)
def test_tp3_partials_sum_to_the_unsharded_reference(m, fi, ckpt, stored_cuda, model_cuda, full_cuda):
    _, fmoe = fi
    x, ids, w = H.make_routing(m, ckpt.hidden, ckpt.experts, ckpt.top_k, seed=100 + m, device=H.DEVICE)
    ref = H.reference(x, ids, w, full_cuda, ckpt.swiglu_limit)
    partials, ranks = [], []
    for r in range(H.TP):
        p = H.run_kernel(fmoe, x, ids, w, stored_cuda[r], r, H.TP, ckpt.swiglu_limit)
        torch.cuda.synchronize()
        rr = H.reference(x, ids, w, model_cuda[r], ckpt.swiglu_limit)
        mr = H.metrics(p, rr)
        mr["rank"] = r
        mr["ok"] = H.rank_ok(mr)
        ranks.append(mr)
        partials.append(p)
    total = partials[0].float() + partials[1].float() + partials[2].float()
    ms = H.metrics(total, ref)
    ms["ok"] = H.sum_ok(ms)
    kernel_ms = _time_ms(lambda: H.run_kernel(fmoe, x, ids, w, stored_cuda[0], 0, H.TP, ckpt.swiglu_limit))
    H.record("kernel_tp3", test=f"M={m}", M=m, seed=100 + m, ranks=ranks, sum=ms, kernel_ms_rank0=round(kernel_ms, 4),
             tol={"rank_rel": H.TOL_RANK_REL, "sum_rel": H.TOL_SUM_REL, "elem_frac": H.ELEM_FRAC,
                  "elem_rule": f"{H.ELEM_ULPS} ulp_bf16(|ref|) + {H.ELEM_REL_MAX} max|ref|"},
             shapes={n: list(stored_cuda[0][n].shape) for n in H.NAMES})
    msg = f"M={m}: " + "; ".join(f"rank {d['rank']} {H.fmt(d)}" for d in ranks) + f"; TP3 sum vs TP1 {H.fmt(ms)}"
    for d in ranks:
        assert d["finite"], f"rank {d['rank']} partial has NaN/Inf. {msg}"
        assert d["rel"] <= H.TOL_RANK_REL, f"rank {d['rank']} vs its reference. {msg}"
        assert d["frac_ok"] >= H.ELEM_FRAC, f"rank {d['rank']} elementwise rule. {msg}"
    assert ms["finite"], f"TP3 sum has NaN/Inf. {msg}"
    assert ms["rel"] <= H.TOL_SUM_REL, f"TP3 sum vs unsharded reference. {msg}"
