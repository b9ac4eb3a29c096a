"""What `verify` refuses, on the kernel: an E8M0 scale byte 0xFF put into a zero-padded scale
region of a rank file (the manifest's first `zero_regions` entry, model layout), on one Flash MoE
layer (256 experts), every rank.

CUTLASS decodes E8M0 255 as +inf, so the padded weights (code 0) become 0 * inf = NaN in that GEMM:
  * w2_weight_scale, first padded K group (22, or 20 on rank 2) of output row 0: NaN in column 0
    of exactly the rows routed to the expert;
  * w13_weight_scale, first padded row of the gate half (rank 0/1: row 704, the kernel's pad to
    768; rank 2: row 640, virtual TP's pad to 704), without a swiglu_limit: the NaN gate passes
    SiLU, and GEMM2 spreads it over the whole of every routed row;
  * the same byte with DeepSeek's swiglu_limit 10: the clamp's fminf (CUTLASS `minimum<float>`)
    replaces the NaN gate by 10, times a padded up value of 0: the output is bit-identical to
    the clean one. Silent here, though the byte is just as wrong, so `verify` still refuses it.
The poisoned scale is laid out with the converter's sm90 functions (byte-equal to FlashInfer's
helpers, test_01) and run with the rank's other tensors as written. Each case: the kernel's NaN
rows equal the expected ones and `moe_reference`'s on the poisoned tensors, and every other row is
bit-identical to the kernel's output on the clean rank file.
"""
from __future__ import annotations

import pytest
import torch

import gpu_harness as H

pytestmark = pytest.mark.gpu

M = 64
CASES = [  # (scale tensor, swiglu_limit applied, NaN expected in the routed rows)
    ("w2_weight_scale", True, True),
    ("w13_weight_scale", False, True),
    ("w13_weight_scale", True, False),
]


def _nan_rows(t: torch.Tensor) -> list[int]:
    return torch.isnan(t.float()).any(dim=1).nonzero().flatten().tolist()


@pytest.mark.parametrize("rank", range(H.TP))
@pytest.mark.parametrize("name, clamp, nan_expected", CASES,
                         ids=[f"{n}-{'limit' if c else 'nolimit'}" for n, c, _ in CASES])
def test_ff_scale_byte_in_padding(name, clamp, nan_expected, rank, fi, geometry):
    _, fmoe = fi
    g = geometry(H.FLASH)
    ck = g.ck
    limit = ck.swiglu_limit if clamp else None
    x, ids, w = H.make_routing(M, ck.hidden, ck.experts, ck.top_k, seed=500 + rank, device=H.DEVICE)
    expert = int(torch.mode(ids.flatten().cpu()).values)  # the most-routed expert: the most rows
    routed = sorted(set((ids.cpu() == expert).any(dim=1).nonzero().flatten().tolist()))
    expected = routed if nan_expected else []

    dim, lo, hi = H.manifest(ck.out)["roles"][H.ROLE]["ranks"][rank]["tensors"][H.PREFIX + name]["zero_regions"][0]
    where = (expert, lo, 0) if dim == 0 else (expert, 0, lo)
    scale = g.model[rank][name].cpu().numpy().copy()
    assert scale[where] == 0, f"rank {rank} {name}{list(where)}: {scale[where]} in a zero region of the manifest"
    scale[where] = 0xFF

    poisoned = dict(g.stored[rank], **H.to_torch(H.lay_out({name: scale}), H.DEVICE))
    changed = int((poisoned[name] != g.stored[rank][name]).sum())
    clean = H.run_kernel(fmoe, x, ids, w, g.stored[rank], rank, H.TP, limit).clone()
    bad = H.run_kernel(fmoe, x, ids, w, poisoned, rank, H.TP, limit)
    H.sync()
    ref = H.reference(x, ids, w, dict(g.model[rank], **{name: torch.from_numpy(scale).to(H.DEVICE)}), limit)

    kernel_rows, ref_rows = _nan_rows(bad), _nan_rows(ref)
    keep = torch.ones(M, dtype=torch.bool)
    keep[expected] = False
    keep = keep.to(bad.device)
    others_identical = bool(torch.equal(bad[keep], clean[keep]))
    nan = torch.isnan(bad.float())
    H.record("ff_padding", test=f"rank {rank} {name} limit {limit}", rank=rank, tensor=name, swiglu_limit=limit,
             M=M, expert=expert, zero_region=[dim, lo, hi], model_index=list(where), kernel_bytes_changed=changed,
             routed_rows=routed, expected_nan_rows=expected, kernel_nan_rows=kernel_rows, reference_nan_rows=ref_rows,
             kernel_rows_all_nan=int(nan.all(dim=1).sum()), kernel_nan_elements=int(nan.sum()),
             reference_nan_elements=int(torch.isnan(ref.float()).sum()),
             clean_finite=bool(torch.isfinite(clean).all()), others_identical=others_identical)
    msg = (f"rank {rank} {name} swiglu_limit {limit}: 0xFF at model index {list(where)} (zero region {[dim, lo, hi]}), "
           f"expert {expert}; routed rows {routed}, expected NaN rows {expected}, kernel NaN rows {kernel_rows}, "
           f"reference NaN rows {ref_rows}")
    assert changed == 1, f"the poisoned byte changed {changed} bytes of the kernel layout. {msg}"
    assert bool(torch.isfinite(clean).all()), f"the clean rank file already gives NaN/Inf. {msg}"
    assert ref_rows == expected, f"the reference does not model the 0xFF byte as expected. {msg}"
    assert kernel_rows == expected, msg
    assert others_identical, f"rows without an expected NaN changed. {msg}"
