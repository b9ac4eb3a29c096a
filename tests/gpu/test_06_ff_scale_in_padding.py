"""What `verify` refuses is what breaks the kernel: an E8M0 scale byte 0xFF put into a zero-padded
scale region of a rank file (the manifest's `zero_regions`, model layout) turns exactly the output
rows routed to that expert into NaN on the real kernel.

One Flash MoE layer (256 experts), every rank, both scale tensors: w13_weight_scale at the first
padded row of the gate half (rank 0/1: row 704, the kernel's pad to 768; rank 2: row 640, virtual
TP's pad to 704), w2_weight_scale at the first padded K group (22, or 20 on rank 2) of output row 0.
The poisoned model-layout scale is laid out with the converter's sm90 functions (byte-equal to
FlashInfer's helpers, test_01) and run with the rank's other tensors as written. Expected, from
CUTLASS's E8M0 decode (byte 255 -> +inf, 0 * inf = NaN) and `moe_reference`, which models it:
  * the rows with a NaN are exactly the tokens routed to the poisoned expert, in the kernel and in
    the reference on the poisoned tensors (w13: whole rows; w2: column 0 of those rows);
  * every other row is bit-identical to the kernel's output on the clean rank file.
"""
from __future__ import annotations

import pytest
import torch

import gpu_harness as H

pytestmark = pytest.mark.gpu

M = 64
SCALES = ("w13_weight_scale", "w2_weight_scale")


def _nan_rows(t: torch.Tensor) -> list[int]:
    return torch.isnan(t.float()).any(dim=1).nonzero().flatten().tolist()


@pytest.mark.parametrize("rank", range(H.TP))
@pytest.mark.parametrize("name", SCALES)
def test_ff_scale_byte_in_padding_gives_nan_rows(name, rank, fi, geometry):
    _, fmoe = fi
    g = geometry(H.FLASH)
    ck = g.ck
    x, ids, w = H.make_routing(M, ck.hidden, ck.experts, ck.top_k, seed=500 + rank, device=H.DEVICE)
    expert = int(torch.mode(ids.flatten().cpu()).values)  # the most-routed expert: the most rows
    routed = sorted(set((ids.cpu() == expert).any(dim=1).nonzero().flatten().tolist()))

    dim, lo, hi = H.manifest(ck.out)["roles"][H.ROLE]["ranks"][rank]["tensors"][H.PREFIX + name]["zero_regions"][0]
    where = (expert, lo, 0) if dim == 0 else (expert, 0, lo)
    scale = g.model[rank][name].cpu().numpy().copy()
    assert scale[where] == 0, f"rank {rank} {name}{list(where)}: {scale[where]} in a zero region of the manifest"
    scale[where] = 0xFF

    poisoned = dict(g.stored[rank], **H.to_torch(H.lay_out({name: scale}), H.DEVICE))
    changed = int((poisoned[name] != g.stored[rank][name]).sum())
    clean = H.run_kernel(fmoe, x, ids, w, g.stored[rank], rank, H.TP, ck.swiglu_limit).clone()
    bad = H.run_kernel(fmoe, x, ids, w, poisoned, rank, H.TP, ck.swiglu_limit)
    H.sync()
    ref = H.reference(x, ids, w, dict(g.model[rank], **{name: torch.from_numpy(scale).to(H.DEVICE)}), ck.swiglu_limit)

    kernel_rows, ref_rows = _nan_rows(bad), _nan_rows(ref)
    keep = torch.ones(M, dtype=torch.bool)
    keep[routed] = False
    others_identical = bool(torch.equal(bad[keep.to(bad.device)], clean[keep.to(clean.device)]))
    nan = torch.isnan(bad.float())
    H.record("ff_padding", test=f"rank {rank} {name}", rank=rank, tensor=name, M=M, expert=expert,
             zero_region=[dim, lo, hi], model_index=list(where), kernel_bytes_changed=changed,
             routed_rows=routed, kernel_nan_rows=kernel_rows, reference_nan_rows=ref_rows,
             kernel_rows_all_nan=int(nan.all(dim=1).sum()), kernel_nan_elements=int(nan.sum()),
             reference_nan_elements=int(torch.isnan(ref.float()).sum()),
             clean_finite=bool(torch.isfinite(clean).all()), others_identical=others_identical)
    msg = (f"rank {rank} {name}: 0xFF at model index {list(where)} (zero region {[dim, lo, hi]}), expert {expert}; "
           f"routed rows {routed}, kernel NaN rows {kernel_rows}, reference NaN rows {ref_rows}")
    assert changed == 1, f"the poisoned byte changed {changed} bytes of the kernel layout. {msg}"
    assert bool(torch.isfinite(clean).all()), f"the clean rank file already gives NaN/Inf. {msg}"
    assert ref_rows == routed, f"the reference does not model the 0xFF byte as expected. {msg}"
    assert kernel_rows == routed, msg
    assert others_identical, f"rows not routed to expert {expert} changed. {msg}"
