"""Routed-expert byte layouts: model layout <-> FlashInfer-CUTLASS kernel layout, each step with its inverse.

Every primitive takes a batch of experts as a uint8 array [B, N, C] (N rows, C bytes per row: packed
E2M1 weights or E8M0 scales) in model layout and returns a new C-contiguous uint8 array; its inverse
maps that back. The index formulas are those of docs/design/kernel-layouts.md §2.2-2.7, the steps per arch
§2.1. All of them are bijections, so the padding checks of diff/verify
invert the layout first instead of looking for zeros in kernel layout.

`expert_layout` picks the composition for (arch, --expert-layout, --flashinfer-layout, tensor) from
one table; `layout_by_name` rebuilds it from the name stamped in the manifest.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from .arches import ARCHES, ARCH_TABLE

if TYPE_CHECKING:
    from .options import Options

# Bump when any primitive's byte layout changes: files written with another version must be refused.
LAYOUT_VERSION: int = 1
EXPERT_TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
FLASHINFER_LAYOUTS = ("folded", "legacy")
EXPERT_LAYOUTS = ("kernel", "model")
MODEL = "model"  # name of the identity layout

MatrixShape = tuple[int, ...]


def _check(x: np.ndarray, step: str, ndim: int = 3) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != ndim:
        what = f"{x.dtype} {list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{step}: expected a uint8 array of {ndim} dims, got {what}")


def _require(step: str, shape: MatrixShape, rows: int, cols: int) -> None:
    """Per-expert [N, C] shape preconditions of a step; the message names the offending shape."""
    n, c = shape[-2:]
    if n % rows or c % cols:
        raise ValueError(f"{step}: needs rows % {rows} == 0 and bytes per row % {cols} == 0, "
                         f"got shape {list(shape)}")


# ---------------------------------------------------------------- swap halves (all kernel archs)
# vLLM stores w13 as [w1 (gate) | pad ; w3 (up) | pad]; FlashInfer's gated activation reads
# [up ; gate]. Each half is one padded I_kernel block, so the padding travels with its half.


def swap_halves(x: np.ndarray) -> np.ndarray:
    """[B, 2I, C] -> [B, 2I, C]: rows [I, 2I) first, then rows [0, I). Its own inverse."""
    _check(x, "swap_halves")
    _require("swap_halves", x.shape, 2, 1)
    i = x.shape[1] // 2
    return np.concatenate((x[:, i:], x[:, :i]), axis=1)


unswap_halves = swap_halves


# ---------------------------------------------------------------- 128x4 scale swizzle (sm100/sm120)
# flashinfer.block_scale_interleave: (m, k) lands at flat offset (m//128)*128*C + (k//4)*512
# + (m%32)*16 + ((m%128)//32)*4 + k%4. The 4 scale bytes k%4 always move together, so the
# transposes run on uint32 units.


def swizzle_128x4(x: np.ndarray) -> np.ndarray:
    """[B, N, C] -> [B, N, C] in SWIZZLED_128x4 order (N % 128 == 0, C % 4 == 0)."""
    _check(x, "swizzle_128x4")
    _require("swizzle_128x4", x.shape, 128, 4)
    b, n, c = x.shape
    words = np.ascontiguousarray(x).view(np.uint32).reshape(b, n // 128, 4, 32, c // 4)
    return np.ascontiguousarray(words.transpose(0, 1, 4, 3, 2)).view(np.uint8).reshape(b, n, c)


def unswizzle_128x4(y: np.ndarray) -> np.ndarray:
    _check(y, "unswizzle_128x4")
    _require("unswizzle_128x4", y.shape, 128, 4)
    b, n, c = y.shape
    words = np.ascontiguousarray(y).view(np.uint32).reshape(b, n // 128, c // 4, 32, 4)
    return np.ascontiguousarray(words.transpose(0, 1, 4, 3, 2)).view(np.uint8).reshape(b, n, c)


# ---------------------------------------------------------------- sm90 scale folds
# Again whole uint32 units (4 scale groups = one K128 block of a row) move, so transposes run on uint32.


def fold_scales_sm90(x: np.ndarray) -> np.ndarray:
    """Folded generation: [B, N, C] -> [B, N/64, C/4, 16, 16],
    out[e, R, B, fm, 4*ms + g] = s[e, 64*R + 16*ms + fm, 4*B + g]."""
    _check(x, "fold_scales_sm90")
    _require("fold_scales_sm90", x.shape, 64, 4)
    b, n, c = x.shape
    words = np.ascontiguousarray(x).view(np.uint32).reshape(b, n // 64, 4, 16, c // 4)
    return np.ascontiguousarray(words.transpose(0, 1, 4, 3, 2)).view(np.uint8).reshape(b, n // 64, c // 4, 16, 16)


def unfold_scales_sm90(y: np.ndarray) -> np.ndarray:
    _check(y, "unfold_scales_sm90", ndim=5)
    b, r, k, fm, line = y.shape
    if (fm, line) != (16, 16):
        raise ValueError(f"unfold_scales_sm90: expected [B, N/64, C/4, 16, 16], got shape {list(y.shape)}")
    words = np.ascontiguousarray(y).view(np.uint32).reshape(b, r, k, 16, 4)
    return np.ascontiguousarray(words.transpose(0, 1, 4, 3, 2)).view(np.uint8).reshape(b, r * 64, k * 4)


def fold_scales_sm90_legacy(x: np.ndarray) -> np.ndarray:
    """Legacy generation: [B, N, C] -> [B, C/4, 4*N], out[e, B, 4*r + g] = s[e, r, 4*B + g]."""
    _check(x, "fold_scales_sm90_legacy")
    _require("fold_scales_sm90_legacy", x.shape, 1, 4)
    b, n, c = x.shape
    words = np.ascontiguousarray(x).view(np.uint32).reshape(b, n, c // 4)
    return np.ascontiguousarray(words.transpose(0, 2, 1)).view(np.uint8).reshape(b, c // 4, n * 4)


def unfold_scales_sm90_legacy(y: np.ndarray) -> np.ndarray:
    _check(y, "unfold_scales_sm90_legacy")
    _require("unfold_scales_sm90_legacy", y.shape, 1, 4)
    b, k, n4 = y.shape
    words = np.ascontiguousarray(y).view(np.uint32).reshape(b, k, n4 // 4)
    return np.ascontiguousarray(words.transpose(0, 2, 1)).view(np.uint8).reshape(b, n4 // 4, k * 4)


# ---------------------------------------------------------------- sm90 weight interleaves
# Both generations pair row r with row r+8 of a 16-row tile and move bytes only inside a 32-byte K
# partition. Folded: lane (mma = 2*mh + ml, l4) reads c = mh*16 + ml*8 + l4 and builds its 32-bit word
# from A_h = W[r, c + 4h], B_h = W[r + 8, c + 4h] as bytes [A0, B0, A1, B1]; the permuted word lands in
# row r + 8*ml at partition column mh*16 + l4*4.
#
# Instead of gathering bytes, the code works on uint64 words of 8 source bytes (h, l4) and:
#  1. pairs nibbles of rows r and r+8:  P = lo(A) | lo(B) << 4,  Q = hi(A) | hi(B) << 4.
#     This alone is the legacy per-byte transform (a', b'), and it is an involution.
#  2. transposes 4x4 bytes with delta swaps, so each 32-bit lane gathers one l4 column.
#  3. folded only: the 18-move bit permutation splits into one 16-bit permutation G applied to the
#     low nibbles [A0, B0, A1, B1] and, shifted by 16, to the high ones; after steps 1-2 the 16-bit
#     lanes hold exactly those nibble quadruples, so G is a single 65536-entry table lookup.
# Everything runs on L2-sized slabs of 16-row tiles (tiles are independent, slabs may cross
# experts) with reused work buffers: ~25 array passes then stay in cache and never page-fault.

# docs/design/kernel-layouts.md §2.3, `moe_gemm_mixed_utils.cu`: (mask, shift) pairs of the 32-bit permutation.
SM90_BITPERM = (
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
    (0x01000000, -11), (0x06000000, -15),
)

_U64 = np.uint64
_LO = _U64(0x0F0F0F0F0F0F0F0F)
_HI = _U64(0xF0F0F0F0F0F0F0F0)
_SLAB_BYTES = 1 << 20


def _nibble_lane_tables() -> tuple[np.ndarray, np.ndarray]:
    """G and its inverse as uint16 tables, from the low-nibble half of SM90_BITPERM.
    Lane bit 4k+j is bit j of source byte k, i.e. bit 8k+j of the kernel's 32-bit word."""
    dest = {b: b + s for m, s in SM90_BITPERM for b in range(32) if m >> b & 1}
    lanes = np.arange(1 << 16, dtype=np.uint32)
    g = np.zeros(1 << 16, np.uint32)
    for k in range(4):
        for j in range(4):
            g |= ((lanes >> (4 * k + j)) & 1) << dest[8 * k + j]
    g = g.astype(np.uint16)
    inv = np.empty_like(g)
    inv[g] = np.arange(1 << 16, dtype=np.uint16)
    return g, inv


_G, _G_INV = _nibble_lane_tables()


def _pair_nibbles(a: np.ndarray, b: np.ndarray, p: np.ndarray, q: np.ndarray, t: np.ndarray) -> None:
    """p = lo(a) | lo(b) << 4, q = hi(a) | hi(b) << 4 bytewise; applied twice it gives back (a, b)."""
    np.bitwise_and(a, _LO, out=p)
    np.bitwise_and(b, _LO, out=t)
    t <<= _U64(4)
    p |= t
    np.right_shift(a, _U64(4), out=q)
    q &= _LO
    np.bitwise_and(b, _HI, out=t)
    q |= t


def _delta_swap(a: np.ndarray, b: np.ndarray, shift: int, mask: int, t: np.ndarray) -> None:
    """Exchange the bits of b under mask with the bits of a `shift` places higher (a may be b)."""
    np.right_shift(a, _U64(shift), out=t)
    t ^= b
    t &= _U64(mask)
    b ^= t
    t <<= _U64(shift)
    a ^= t


def _transpose_4x4(p: np.ndarray, q: np.ndarray, t: np.ndarray) -> None:
    """Per word pair, 4-byte rows p = [r0, r1], q = [r2, r3] -> 4-byte columns p = [c0, c1], q = [c2, c3]."""
    _delta_swap(p, q, 16, 0x0000FFFF0000FFFF, t)
    _delta_swap(p, p, 24, 0x00000000FF00FF00, t)
    _delta_swap(q, q, 24, 0x00000000FF00FF00, t)


def _untranspose_4x4(p: np.ndarray, q: np.ndarray, t: np.ndarray) -> None:
    _delta_swap(p, p, 24, 0x00000000FF00FF00, t)
    _delta_swap(q, q, 24, 0x00000000FF00FF00, t)
    _delta_swap(p, q, 16, 0x0000FFFF0000FFFF, t)


def _source_words(w: np.ndarray) -> np.ndarray:
    """[T, 16, C] bytes -> uint64 [T, rh, ml, r8, partition, mh]: row 8*rh + r8, 8-byte group (mh, ml)."""
    t, _, c = w.shape
    return w.view(np.uint64).reshape(t, 2, 8, c // 32, 2, 2).transpose(0, 1, 5, 2, 3, 4)


def _kernel_words(w: np.ndarray) -> np.ndarray:
    """[T, 16, C] bytes -> uint64 [T, ml, r8, partition, mh, word pair] (output row 8*ml + r8)."""
    t, _, c = w.shape
    return w.view(np.uint64).reshape(t, 2, 8, c // 32, 2, 2)


def _interleave_tiles(src: np.ndarray, dst: np.ndarray, work: np.ndarray, folded: bool) -> None:
    words = _source_words(src)
    p, q, t = (w.reshape(words.shape[:1] + words.shape[2:]) for w in work)
    _pair_nibbles(words[:, 0], words[:, 1], p, q, t)
    if not folded:  # legacy lanes are [P_h0, Q_h0, P_h1, Q_h1] per l4 instead of [P_h0, P_h1, Q_h0, Q_h1]
        _delta_swap(p, q, 32, 0x00000000FFFFFFFF, t)
    _transpose_4x4(p, q, t)
    out = _kernel_words(dst)
    for i, z in enumerate((p, q)):
        if folded:
            np.take(_G, z.view(np.uint16), out=t.view(np.uint16), mode="clip")
            z = t
        out[..., i] = z


def _deinterleave_tiles(src: np.ndarray, dst: np.ndarray, work: np.ndarray, folded: bool) -> None:
    words = _kernel_words(src)
    p, q, t = (w.reshape(words.shape[:-1]) for w in work)
    for i, z in enumerate((p, q)):
        if folded:
            t[...] = words[..., i]
            np.take(_G_INV, t.view(np.uint16), out=z.view(np.uint16), mode="clip")
        else:
            z[...] = words[..., i]
    _untranspose_4x4(p, q, t)
    if not folded:
        _delta_swap(p, q, 32, 0x00000000FFFFFFFF, t)
    out = _source_words(dst)
    _pair_nibbles(p, q, out[:, 0], out[:, 1], t)


def _over_tiles(x: np.ndarray, step: str, kernel: Callable[..., None], folded: bool) -> np.ndarray:
    _check(x, step)
    _require(step, x.shape, 16, 32)
    c = x.shape[2]
    src = np.ascontiguousarray(x).reshape(-1, 16, c)
    dst = np.empty_like(src)
    per_slab = max(1, _SLAB_BYTES // (16 * c))
    work = np.empty((3, min(per_slab, len(src)) * c), np.uint64)  # p, q, t: 8 rows x C bytes per tile
    for i in range(0, len(src), per_slab):
        j = min(i + per_slab, len(src))
        kernel(src[i:j], dst[i:j], work[:, : (j - i) * c], folded)
    return dst.reshape(x.shape)


def interleave_sm90(x: np.ndarray) -> np.ndarray:
    """Folded generation (FlashInfer 0.6.16, >= 0.6.18, 0.7.x) nibble interleave; N % 16 == 0, C % 32 == 0."""
    return _over_tiles(x, "interleave_sm90", _interleave_tiles, folded=True)


def deinterleave_sm90(y: np.ndarray) -> np.ndarray:
    return _over_tiles(y, "deinterleave_sm90", _deinterleave_tiles, folded=True)


def interleave_sm90_legacy(x: np.ndarray) -> np.ndarray:
    """Legacy generation (FlashInfer 0.6.10-0.6.15, 0.6.17): per tile and 32-byte partition,
    a' = lo(a) | lo(b) << 4 and b' = hi(a) | hi(b) << 4 for a = W[r, c], b = W[r + 8, c]."""
    return _over_tiles(x, "interleave_sm90_legacy", _interleave_tiles, folded=False)


def deinterleave_sm90_legacy(y: np.ndarray) -> np.ndarray:
    return _over_tiles(y, "deinterleave_sm90_legacy", _deinterleave_tiles, folded=False)


# ---------------------------------------------------------------- named layouts


@dataclass(frozen=True)
class _Step:
    forward: Callable[[np.ndarray], np.ndarray]
    inverse: Callable[[np.ndarray], np.ndarray]
    shape: Callable[[MatrixShape], MatrixShape]  # per-expert [N, C] -> shape after forward; raises on bad shapes


def _same_shape(step: str, rows: int, cols: int) -> Callable[[MatrixShape], MatrixShape]:
    def shape(s: MatrixShape) -> MatrixShape:
        _require(step, s, rows, cols)
        return s
    return shape


def _folded_shape(s: MatrixShape) -> MatrixShape:
    _require("fold_scales_sm90", s, 64, 4)
    return (s[0] // 64, s[1] // 4, 16, 16)


def _legacy_folded_shape(s: MatrixShape) -> MatrixShape:
    _require("fold_scales_sm90_legacy", s, 1, 4)
    return (s[1] // 4, s[0] * 4)


STEPS: dict[str, _Step] = {
    "swap_halves": _Step(swap_halves, unswap_halves, _same_shape("swap_halves", 2, 1)),
    "swizzle_128x4": _Step(swizzle_128x4, unswizzle_128x4, _same_shape("swizzle_128x4", 128, 4)),
    "interleave_sm90": _Step(interleave_sm90, deinterleave_sm90, _same_shape("interleave_sm90", 16, 32)),
    "interleave_sm90_legacy": _Step(interleave_sm90_legacy, deinterleave_sm90_legacy,
                                    _same_shape("interleave_sm90_legacy", 16, 32)),
    "fold_scales_sm90": _Step(fold_scales_sm90, unfold_scales_sm90, _folded_shape),
    "fold_scales_sm90_legacy": _Step(fold_scales_sm90_legacy, unfold_scales_sm90_legacy, _legacy_folded_shape),
}

# What FlashInfer-CUTLASS's post-load processing does per tensor, per (arch, --flashinfer-layout): model/arches.py
# (docs/design/kernel-layouts.md §2.1).
KERNEL_STEPS: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {
    (a.name, g): steps for a in ARCH_TABLE for g, steps in a.kernel_steps.items()}


@dataclass(frozen=True)
class Layout:
    """A composition of steps; the name ("model" or the steps joined by "+") is what the manifest stores."""

    name: str
    steps: tuple[str, ...]
    version: int

    def forward(self, x: np.ndarray) -> np.ndarray:
        """[B, N, C] uint8 model layout -> [B, *kernel_shape((N, C))]. The identity may return x itself."""
        _check(x, self.name)
        for s in self.steps:
            x = STEPS[s].forward(x)
        return np.ascontiguousarray(x)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """Kernel layout [B, ...] -> [B, N, C] model layout. The identity may return y itself."""
        for s in reversed(self.steps):
            y = STEPS[s].inverse(y)
        _check(y, self.name)
        return np.ascontiguousarray(y)

    def kernel_shape(self, model_matrix_shape: tuple[int, int]) -> MatrixShape:
        """Per-expert shape after forward; ValueError when the shape breaks a step's preconditions."""
        shape = tuple(model_matrix_shape)
        if len(shape) != 2:
            raise ValueError(f"{self.name}: expected a per-expert [N, C] shape, got {list(shape)}")
        for s in self.steps:
            shape = STEPS[s].shape(shape)
        return shape


@functools.lru_cache(maxsize=None)
def layout_by_name(name: str) -> Layout:
    """The layout a manifest names ("model" or steps joined by "+")."""
    steps = () if name == MODEL else tuple(name.split("+"))
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"unknown expert layout {name!r}: no step {', '.join(map(repr, unknown))}")
    return Layout(name, steps, LAYOUT_VERSION)


def expert_layout(arch: str | None, expert_layout: str, flashinfer_layout: str, tensor: str) -> Layout:
    """The layout of one routed-expert tensor for --arch, --expert-layout and --flashinfer-layout
    (arch None: model layout for any arch, which is the same for every arch)."""
    archs = ARCHES + (None,) if expert_layout == MODEL else ARCHES
    for what, value, allowed in (("arch", arch, archs), ("expert layout", expert_layout, EXPERT_LAYOUTS),
                                 ("flashinfer layout", flashinfer_layout, FLASHINFER_LAYOUTS),
                                 ("expert tensor", tensor, EXPERT_TENSORS)):
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(map(str, allowed))}")
    steps = KERNEL_STEPS[(arch, flashinfer_layout)][tensor] if expert_layout == "kernel" else ()
    return layout_by_name("+".join(steps) or MODEL)


def tensor_layouts(options: Options) -> dict[str, Layout]:
    """The layout of each routed-expert tensor for these options."""
    return {t: expert_layout(options.arch, options.expert_layout, options.flashinfer_layout, t)
            for t in EXPERT_TENSORS}
