"""A pure-torch numerical reference for the sharded layers (docs/design/kernel-layouts.md §5).

Library code: `check-numerics` uses it on the CPU, and the GPU tests compare FlashInfer's
CUTLASS fused MoE against `moe_reference`. Every function runs on the device of its inputs
(CPU or CUDA) and computes in fp32; BF16 rounding happens only at the documented points.

Dequantisation
  * MXFP4 (`dequant_mxfp4`): E2M1 codes packed two per byte along K, low nibble = even element;
    one E8M0 scale byte per 32 elements, decoded **as the kernel does**:
    `bitcast<float>(uint32(byte) << 23)`, i.e. 2^(e-127) for 1 <= e <= 254, +0.0 for byte 0
    and +inf for byte 255 (a 255 scale therefore yields inf/NaN in the GEMM output, as on the GPU;
    with a swiglu_limit the clamp then turns a NaN gate or up value into the limit, see
    `swiglu_clamped`).
    Dequantised weights are exact in fp32.
  * FP8 block (`dequant_fp8_block`): float8_e4m3fn weights times one E8M0 scale per 128x128
    block, OCP semantics (2^(e-127) for every byte but 255, which is NaN). Exact in fp32
    (down to fp32 subnormals, reached only by the zero-weight tails with scale byte 0).

Rounding points (`r` = round to BF16 and back to fp32)
  * routed MoE (`moe_reference`, the kernel order of §5.2): x is BF16;
    h = r(x @ W13^T); a = r(swiglu_clamped(h)); h2 = r(a @ W2^T) per (token, k);
    out = bf16(sum_k w[t,k] * h2[t,k]) summed in fp32 in k order. Returns BF16.
    The kernel's per-32-group scaled fp32 accumulation equals dequantise-then-fp32-matmul up
    to summation order. Weights come in vLLM model layout, w13 = [w1 (gate) ; w3 (up)]; the
    kernel consumes [w3 ; w1] (up first, after the converter's swap_halves) and reads
    linear = rows [0, I), gate = rows [I, 2I): the reference reads gate from the first half
    and up from the second half of the model layout, the same arithmetic. To check a kernel
    layout, apply the manifest's inverse layout first (`Output.model_tensor`).
    `moe_reference_streamed` is the same computation with experts fetched one at a time.
  * shared expert (`shared_expert_reference`, `mlp_reference`): x is BF16;
    g = r(x @ W1^T), u = r(x @ W3^T) (the BF16 output of the FP8 linear);
    a = r(silu(min(g, L)) * clamp(u, -L, L)); out = a @ W2^T in fp32, **not rounded**, so a
    TP sum of rank partials can be compared with the unsharded result at fp32 precision
    (round with `.bfloat16()` to model the BF16 output of the linear).
  * attention output (`attn_output_reference`): o is BF16 [M, heads, head_dim];
    z_g = r(o_g @ wo_a_g^T) per output group g (grouped BMM, o_lora_rank rows per group);
    out = concat_g(z_g) @ wo_b^T in fp32, not rounded (as above).
The activation quantisation of vLLM's FP8 linears (per-token-group FP8 on some backends) is not
modelled: it is identical on both sides of a TP comparison and outside the converter's scope.
"""
from __future__ import annotations

from typing import Callable

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
MXFP4_GROUP = 32
FP8_BLOCK = 128
# byte -> (value of the low nibble, value of the high nibble): one gather decodes a packed byte
_BYTE_LUT = torch.stack([E2M1[torch.arange(256) & 0xF], E2M1[torch.arange(256) >> 4]], dim=-1)


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to BF16 (round-half-even) and back to fp32."""
    return t.to(torch.bfloat16).to(torch.float32)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a one-byte tensor (uint8, int8, float8_*) as uint8, never a value conversion."""
    if t.element_size() != 1:
        raise TypeError(f"expected a one-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def e8m0_to_float(scale: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """E8M0 bytes -> fp32. kernel=True: byte 0 -> +0.0, 255 -> +inf (CUTLASS's bit shift);
    kernel=False: OCP, byte 0 -> 2^-127, 255 -> NaN."""
    e = _u8(scale).to(torch.int32)
    s = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e - 127)
    if kernel:
        s = torch.where(e == 0, torch.zeros_like(s), s)
        s = torch.where(e == 255, torch.full_like(s, float("inf")), s)
    else:
        s = torch.where(e == 255, torch.full_like(s, float("nan")), s)
    return s


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> fp32. packed u8 [..., K/2] (low nibble = element 2j), scale u8 [..., K/32] E8M0
    with kernel semantics (byte 0 -> 0.0, 255 -> +inf). Returns fp32 [..., K]."""
    p = _u8(packed)
    s = e8m0_to_float(scale, kernel=True)
    k = p.shape[-1] * 2
    if s.shape[-1] * MXFP4_GROUP != k or s.shape[:-1] != p.shape[:-1]:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(p.shape)} (K={k}) vs scale {tuple(s.shape)}")
    vals = _BYTE_LUT.to(p.device)[p.long()].flatten(-2)  # [..., K]: element 2j from the low nibble
    return (vals.unflatten(-1, (-1, MXFP4_GROUP)) * s.unsqueeze(-1)).flatten(-2)


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 E4M3 [N, K] with one E8M0 scale (float8_e8m0fnu or uint8 bytes) per block x block tile,
    scale [ceil(N/block), ceil(K/block)] -> fp32 [N, K]. OCP E8M0 semantics (255 -> NaN)."""
    if weight.dtype != torch.float8_e4m3fn:
        weight = _u8(weight).view(torch.float8_e4m3fn)
    n, k = weight.shape
    nb, kb = -(-n // block), -(-k // block)
    if tuple(scale.shape) != (nb, kb):
        raise ValueError(f"FP8 block scale shape {tuple(scale.shape)} != ({nb}, {kb}) for weight [{n}, {k}]")
    s = e8m0_to_float(scale, kernel=False)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return weight.to(torch.float32) * s


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L) in fp32 (kernel `SwigluBias` with alpha=1, beta=0;
    DeepSeek/vLLM `swiglu_limit_func`). limit None or <= 0: no clamping.
    min/max as the kernel takes them: CUTLASS's `minimum<float>`/`maximum<float>` are fminf/fmaxf,
    which return the other operand for a NaN, so a NaN gate becomes L and a NaN up becomes L
    (torch.clamp would propagate the NaN; measured on an H200, docs/evidence/gpu-validation.md)."""
    if limit is not None and limit > 0:
        lim = gate.new_tensor(limit)
        gate = torch.fmin(gate, lim)
        up = torch.fmax(torch.fmin(up, lim), -lim)
    return gate * torch.sigmoid(gate) * up


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                  swiglu_limit: float) -> torch.Tensor:
    """Routed MXFP4 MoE in the W4A16 kernel's order of operations (docs/design/kernel-layouts.md §5.2).

    x bf16 [M, H]; topk_ids int [M, k] (expert ids into w13's first dim; ids < 0 or >= E are
    skipped, as non-local experts are in the kernel); topk_weights fp32 [M, k].
    w13 u8 [E, 2I, H/2] / w13_scale u8 [E, 2I, H/32] in vLLM **model** layout: rows [0, I) are w1
    (gate), rows [I, 2I) are w3 (up), each half padded to I. (The kernel consumes [w3 ; w1], up
    first; this function takes model layout and reads gate/up from the halves accordingly, which
    is the same arithmetic.) w2 u8 [E, H, I/2] / w2_scale u8 [E, H, I/32].
    Returns bf16 [M, H]: one rank's partial when given a rank's tensors.
    Vectorised per expert: one dequantisation and two GEMMs per expert actually routed to.
    """
    e_count = w13.shape[0]
    if w13_scale.shape[0] != e_count or w2.shape[0] != e_count or w2_scale.shape[0] != e_count:
        raise ValueError(f"MoE expert counts disagree: {w13.shape[0]}, {w13_scale.shape[0]}, {w2.shape[0]}, {w2_scale.shape[0]}")
    return moe_reference_streamed(x, topk_ids, topk_weights, e_count,
                                  lambda e: (w13[e], w13_scale[e], w2[e], w2_scale[e]), swiglu_limit)


ExpertFetch = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def moe_reference_streamed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                           n_experts: int, expert: ExpertFetch, swiglu_limit: float) -> torch.Tensor:
    """`moe_reference` with the experts fetched on demand: `expert(e)` returns expert e's
    (w13 [2I, H/2], w13_scale [2I, H/32], w2 [H, I/2], w2_scale [H, I/32]) uint8 in model layout.
    Called once per distinct routed expert, in increasing id order, so only one expert's
    weights are held at a time (how check-numerics reads the 256-expert checkpoint)."""
    dev = x.device
    m, h = x.shape
    xf = bf16_round(x.to(torch.float32))
    ids = topk_ids.to(dev).long()
    wts = topk_weights.to(dev, torch.float32)
    k = ids.shape[1]
    h2 = torch.zeros(m, k, h, dtype=torch.float32, device=dev)  # BF16-valued GEMM2 rows per (t, k)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < n_experts)
    for e in torch.unique(flat[valid]).tolist():
        w13, w13_scale, w2, w2_scale = expert(e)
        two_i = w13.shape[0]
        i = two_i // 2
        if w13.shape[1] * 2 != h or w2.shape[0] != h or w2.shape[1] * 2 != i:
            raise ValueError(f"MoE shapes disagree (expert {e}): x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                             f"w2 {tuple(w2.shape)}")
        pairs = (flat == e).nonzero().flatten()  # (t, k) pairs routed to e
        rows = pairs // k
        w13f = dequant_mxfp4(w13.to(dev), w13_scale.to(dev))  # [2I, H]: [w1 (gate) ; w3 (up)]
        h1 = bf16_round(xf[rows] @ w13f.T)  # GEMM1, BF16 output
        del w13f
        a = bf16_round(swiglu_clamped(h1[:, :i], h1[:, i:], swiglu_limit))  # activation, BF16
        w2f = dequant_mxfp4(w2.to(dev), w2_scale.to(dev))  # [H, I]
        h2.view(m * k, h)[pairs] = bf16_round(a @ w2f.T)  # GEMM2, BF16 per (t, k)
    out = torch.zeros(m, h, dtype=torch.float32, device=dev)
    for kk in range(k):  # finalize: fp32, k order; skipped experts contribute nothing
        out = out + torch.where(valid.view(m, k)[:, kk:kk + 1], wts[:, kk:kk + 1] * h2[:, kk], 0.0)
    return out.to(torch.bfloat16)


def mlp_reference(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                  swiglu_limit: float | None) -> torch.Tensor:
    """Gated MLP on dequantised fp32 weights: w1 (gate) [I, H], w3 (up) [I, H], w2 (down) [H, I].
    g, u and the activation are rounded to BF16; the output is fp32, unrounded."""
    xf = bf16_round(x.to(torch.float32))
    g = bf16_round(xf @ w1.T)
    u = bf16_round(xf @ w3.T)
    a = bf16_round(swiglu_clamped(g, u, swiglu_limit))
    return a @ w2.T


def shared_expert_reference(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                            down: torch.Tensor, down_scale: torch.Tensor,
                            swiglu_limit: float | None) -> torch.Tensor:
    """Shared-expert MLP from vLLM's fused `gate_up_proj` ([w1 ; w3], each half I rows, FP8 with
    scale rows [gate ; up]) and `down_proj` [H, I]. I must be a multiple of 128 so the halves
    split on a scale block (true per rank: 768, and for the unsharded 2048). fp32 output."""
    dev = x.device
    i = gate_up.shape[0] // 2
    if i % FP8_BLOCK or gate_up_scale.shape[0] * FP8_BLOCK != 2 * i:
        raise ValueError(f"gate_up_proj [{gate_up.shape[0]}, ...]: halves not on {FP8_BLOCK}-row scale blocks")
    sb = i // FP8_BLOCK
    w1 = dequant_fp8_block(gate_up[:i].to(dev), gate_up_scale[:sb].to(dev))
    w3 = dequant_fp8_block(gate_up[i:].to(dev), gate_up_scale[sb:].to(dev))
    w2 = dequant_fp8_block(down.to(dev), down_scale.to(dev))
    return mlp_reference(x, w1, w3, w2, swiglu_limit)


def attn_output_reference(o: torch.Tensor, wo_a: torch.Tensor, wo_a_scale: torch.Tensor,
                          wo_b: torch.Tensor, wo_b_scale: torch.Tensor) -> torch.Tensor:
    """Attention output projection: grouped `wo_a` then `wo_b` (docs/design/tensor-plan.md §3.4).

    o [M, local_heads, head_dim] (rounded to BF16). wo_a FP8 [G*R, hpg*head_dim] holds R =
    o_lora_rank rows per local output group; heads are grouped consecutively, hpg = heads per
    group = wo_a.shape[1] / head_dim, G = local_heads / hpg. z_g = r(o_g @ wo_a_g^T) [M, R];
    out = concat_g(z_g) @ wo_b^T with wo_b FP8 [H, G*R]. fp32 output, unrounded.
    The rows are dequantised with their scales first (exact), so this also works when a group
    of R rows is not 128-aligned.
    """
    dev = o.device
    m, heads, d = o.shape
    hpg = wo_a.shape[1] // d
    if hpg * d != wo_a.shape[1] or heads % hpg:
        raise ValueError(f"wo_a {tuple(wo_a.shape)} does not group o {tuple(o.shape)} by whole heads")
    g = heads // hpg
    r = wo_a.shape[0] // g
    if r * g != wo_a.shape[0] or wo_b.shape[1] != wo_a.shape[0]:
        raise ValueError(f"wo_a {tuple(wo_a.shape)} / wo_b {tuple(wo_b.shape)} disagree with {g} groups")
    a = dequant_fp8_block(wo_a.to(dev), wo_a_scale.to(dev)).view(g, r, hpg * d)
    b = dequant_fp8_block(wo_b.to(dev), wo_b_scale.to(dev))
    of = bf16_round(o.to(torch.float32)).view(m, g, hpg * d)
    z = bf16_round(torch.einsum("mgd,grd->mgr", of, a))
    return z.reshape(m, g * r) @ b.T
