"""The audit's bug on hardware: rank tensors cut with vLLM's stock unit-blind W2 offsets (bytes
0/384/768, scale groups 0/24/48; w13 rows at the correct 0/704/1408) give a large error through
the real kernel, while the converter's offsets (0/352/704, 0/22/44) do not (test_02).

The rank tensors are rebuilt from the source with numpy (gpu_harness.build_rank_model) and laid out
with the converter's own sm90 layout functions. The same construction at the correct offsets must
reproduce the converter's rank files byte for byte, so the stock run differs from the converter's
only by the offsets.
"""
from __future__ import annotations

import numpy as np
import pytest

import gpu_harness as H

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def stock_cuda(moe):
    ranks = []
    for r in range(H.TP):
        correct = H.lay_out(H.build_rank_model(moe.srcx, r, moe.ck.inter, stock=False))
        for n in H.NAMES:
            want = moe.stored[r][n].cpu().numpy()
            assert np.array_equal(correct[n], want), (
                f"rank {r} {n}: the numpy construction at the correct offsets differs from the converter's "
                f"rank file; the stock comparison would not isolate the offsets")
        ranks.append(H.to_torch(H.lay_out(H.build_rank_model(moe.srcx, r, moe.ck.inter, stock=True)), H.DEVICE))
    return ranks


@pytest.mark.parametrize("m", (8, 64))
def test_stock_offsets_give_a_large_error(m, fi, moe, stock_cuda):
    _, fmoe = fi
    ck = moe.ck
    x, ids, w = H.make_routing(m, ck.hidden, ck.experts, ck.top_k, seed=100 + m, device=H.DEVICE)
    ref = H.reference(x, ids, w, moe.full, ck.swiglu_limit)
    stock = sum(H.run_kernel(fmoe, x, ids, w, stock_cuda[r], r, H.TP, ck.swiglu_limit).float() for r in range(H.TP))
    good = sum(H.run_kernel(fmoe, x, ids, w, moe.stored[r], r, H.TP, ck.swiglu_limit).float() for r in range(H.TP))
    H.sync()
    ms, mg = H.metrics(stock, ref), H.metrics(good, ref)
    H.record("stock_offsets", test=f"M={m}", M=m, seed=100 + m, stock=ms, converter=mg, min_rel=H.STOCK_MIN_REL,
             offsets={"w13_rows": [0, 704, 1408], "w2_bytes": [0, 384, 768], "w2_scale_groups": [0, 24, 48]})
    assert mg["rel"] <= H.TOL_SUM_REL, f"M={m}: converter files {H.fmt(mg)}"
    assert ms["rel"] > H.STOCK_MIN_REL, f"M={m}: stock offsets only {H.fmt(ms)}; expected a large error"
