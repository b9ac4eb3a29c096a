"""CUDA graphs: one `cutlass_fused_moe` call on a rank file's tensors, captured after a warm-up with
a preallocated workspace (`cutlass_fused_moe_workspace_size`), replays bit-identical to eager, also
after new activations are copied into the captured input; replay is timed at M = 64.
"""
from __future__ import annotations

import pytest
import torch

import gpu_harness as H

pytestmark = pytest.mark.gpu

M = 64
RANK = 1


def test_cuda_graph_replay_equals_eager(fi, moe):
    _, fmoe = fi
    ckpt, t = moe.ck, moe.stored[RANK]
    e_local, hidden = t["w2_weight"].shape[0], t["w2_weight"].shape[1]
    inter = t["w2_weight"].shape[2] * 2
    dev = torch.device(H.DEVICE)
    x, ids, w = H.make_routing(M, ckpt.hidden, ckpt.experts, ckpt.top_k, seed=400, device=dev)
    x2, ids2, w2 = H.make_routing(M, ckpt.hidden, ckpt.experts, ckpt.top_k, seed=401, device=dev)
    limit = torch.full((e_local,), ckpt.swiglu_limit, dtype=torch.float32, device=dev)

    ws, ws_bytes = None, 0
    if hasattr(fmoe, "cutlass_fused_moe_workspace_size"):
        ws_bytes = int(fmoe.cutlass_fused_moe_workspace_size(
            M, hidden, inter, e_local, ckpt.top_k, x_dtype=torch.bfloat16, weight_dtype=torch.uint8,
            output_dtype=torch.bfloat16, tp_size=H.TP, tp_rank=RANK, use_w4_group_scaling=True, device=dev))
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)

    def call(xi, idsi, wi, out):
        return H.run_kernel(fmoe, xi, idsi, wi, t, RANK, H.TP, limit, out=out, workspace=ws)

    # eager references (fresh outputs), then a warm-up on a side stream as torch.cuda.graphs requires
    eager1 = call(x, ids, w, torch.empty(M, hidden, dtype=torch.bfloat16, device=dev)).clone()
    eager2 = call(x2, ids2, w2, torch.empty(M, hidden, dtype=torch.bfloat16, device=dev)).clone()
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    out = torch.zeros(M, hidden, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call(sx, sids, sw, out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(sx, sids, sw, out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    same1 = bool(torch.equal(out, eager1))
    maxd1 = float((out.float() - eager1.float()).abs().max().item())

    sx.copy_(x2)
    sids.copy_(ids2)
    sw.copy_(w2)
    g.replay()
    torch.cuda.synchronize()
    same2 = bool(torch.equal(out, eager2))
    maxd2 = float((out.float() - eager2.float()).abs().max().item())
    finite = bool(torch.isfinite(out).all().item())

    for _ in range(10):
        g.replay()
    replay_ms = H.time_ms(g.replay, 100)
    eager_ms = H.time_ms(lambda: call(sx, sids, sw, out), 20)
    H.record("cuda_graph", M=M, rank=RANK, workspace_bytes=ws_bytes, workspace_api=ws is not None,
             bit_identical=same1, bit_identical_new_input=same2, max_abs_diff=[maxd1, maxd2], finite=finite,
             replay_ms=round(replay_ms, 4), eager_ms=round(eager_ms, 4))
    assert finite
    assert same1, f"replay differs from eager (max |d| {maxd1})"
    assert same2, f"replay after copying new inputs differs from eager on those inputs (max |d| {maxd2})"
