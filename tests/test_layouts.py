"""Expert layouts: round trips, padding behaviour, and the docs/design/kernel-layouts.md formulas checked literally."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from lucifer_shard.model import layouts as L
from lucifer_shard.model.layouts import (EXPERT_TENSORS, FLASHINFER_LAYOUTS, LAYOUT_VERSION, Layout, expert_layout,
                                         layout_by_name)

RNG = np.random.default_rng(20250)

# Per-rank DeepSeek-V4-Flash TP3 matrices (I_kernel = 768, H = 4096), B = 2 experts.
REAL = {
    "w13_weight": (1536, 2048),
    "w13_weight_scale": (1536, 128),
    "w2_weight": (4096, 384),
    "w2_weight_scale": (4096, 24),
}
PRIMITIVES = [
    (L.swap_halves, L.unswap_halves),
    (L.swizzle_128x4, L.unswizzle_128x4),
    (L.interleave_sm90, L.deinterleave_sm90),
    (L.interleave_sm90_legacy, L.deinterleave_sm90_legacy),
    (L.fold_scales_sm90, L.unfold_scales_sm90),
    (L.fold_scales_sm90_legacy, L.unfold_scales_sm90_legacy),
]
ALL_LAYOUTS = sorted({expert_layout(a, e, f, t) for a, e, f, t in itertools.product(
    L.ARCHES, L.EXPERT_LAYOUTS, FLASHINFER_LAYOUTS, EXPERT_TENSORS)}, key=lambda lay: lay.name)


def rand(*shape: int) -> np.ndarray:
    return RNG.integers(0, 256, shape, dtype=np.uint8)


def tensor_of(layout: Layout) -> str:
    """One tensor a layout is used for, to get a real shape it accepts."""
    return next(t for a, e, f, t in itertools.product(L.ARCHES, L.EXPERT_LAYOUTS, FLASHINFER_LAYOUTS, EXPERT_TENSORS)
                if expert_layout(a, e, f, t) == layout)


# ---------------------------------------------------------------- the table


def test_table():
    names = {(a, f): {t: expert_layout(a, "kernel", f, t).name for t in EXPERT_TENSORS}
             for a in L.ARCHES for f in FLASHINFER_LAYOUTS}
    sm100 = {"w13_weight": "swap_halves", "w13_weight_scale": "swap_halves+swizzle_128x4",
             "w2_weight": "model", "w2_weight_scale": "swizzle_128x4"}
    for f in FLASHINFER_LAYOUTS:
        assert names[("sm120", f)] == sm100 and names[("sm100", f)] == sm100
    assert names[("sm90", "folded")] == {
        "w13_weight": "swap_halves+interleave_sm90", "w13_weight_scale": "swap_halves+fold_scales_sm90",
        "w2_weight": "interleave_sm90", "w2_weight_scale": "fold_scales_sm90"}
    assert names[("sm90", "legacy")] == {
        "w13_weight": "swap_halves+interleave_sm90_legacy", "w13_weight_scale": "swap_halves+fold_scales_sm90_legacy",
        "w2_weight": "interleave_sm90_legacy", "w2_weight_scale": "fold_scales_sm90_legacy"}
    for a, f, t in itertools.product(L.ARCHES, FLASHINFER_LAYOUTS, EXPERT_TENSORS):
        assert expert_layout(a, "model", f, t) == Layout("model", (), LAYOUT_VERSION)
    for lay in ALL_LAYOUTS:
        assert layout_by_name(lay.name) == lay and lay.version == LAYOUT_VERSION


def test_kernel_shapes():
    def shape(arch, fl, t):
        return expert_layout(arch, "kernel", fl, t).kernel_shape(REAL[t])
    for t in EXPERT_TENSORS:
        assert shape("sm120", "folded", t) == REAL[t] == shape("sm100", "legacy", t)
        assert expert_layout("sm90", "model", "folded", t).kernel_shape(REAL[t]) == REAL[t]
    assert shape("sm90", "folded", "w13_weight") == (1536, 2048)
    assert shape("sm90", "folded", "w13_weight_scale") == (24, 32, 16, 16)  # docs/design/kernel-layouts.md §2.4
    assert shape("sm90", "folded", "w2_weight_scale") == (64, 6, 16, 16)
    assert shape("sm90", "legacy", "w13_weight_scale") == (32, 6144)  # docs/design/kernel-layouts.md §2.5
    assert shape("sm90", "legacy", "w2_weight_scale") == (6, 16384)


@pytest.mark.parametrize("args", [
    ("sm89", "kernel", "folded", "w13_weight"), ("sm90", "level-b", "folded", "w13_weight"),
    ("sm90", "kernel", "newest", "w13_weight"), ("sm90", "kernel", "folded", "w13_bias")])
def test_unknown_options_raise(args):
    with pytest.raises(ValueError, match=repr(next(a for a in args if a not in (
            *L.ARCHES, *L.EXPERT_LAYOUTS, *FLASHINFER_LAYOUTS, *EXPERT_TENSORS)))):
        expert_layout(*args)


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="'swizzle_256x4'"):
        layout_by_name("swap_halves+swizzle_256x4")


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("fwd, inv", PRIMITIVES, ids=lambda f: f.__name__)
def test_primitive_round_trip(fwd, inv):
    shapes = [(3, 128, 32), (1, 256, 64), (2, 64, 4)] + [(2, *s) for s in REAL.values()]
    tried = 0
    for shape in shapes:
        x = rand(*shape)
        try:
            y = fwd(x)
        except ValueError:
            continue  # precondition not met for this shape (tested below)
        tried += 1
        assert y.dtype == np.uint8 and y.flags.c_contiguous and y.size == x.size
        assert np.array_equal(inv(y), x), shape
    assert tried >= 3


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda lay: lay.name)
def test_layout_round_trip(layout):
    shapes = [(2, *REAL[tensor_of(layout)]), (3, 128, 32), (1, 256, 4)]
    for shape in shapes:
        x = rand(*shape)
        try:
            kshape = layout.kernel_shape(shape[1:])
        except ValueError:
            continue
        y = layout.forward(x)
        assert y.shape == (shape[0], *kshape) and y.dtype == np.uint8 and y.flags.c_contiguous
        assert np.array_equal(layout.inverse(y), x), shape


def test_non_contiguous_input():
    x = rand(2, 128, 256)[:, :, ::2]
    for fwd, _ in PRIMITIVES:
        assert np.array_equal(fwd(x), fwd(x.copy())), fwd.__name__


# ---------------------------------------------------------------- TP3 zero padding
# Real bytes have both nibble magnitudes (bits 0-2) non-zero: then no byte of a real 16x32 tile can turn
# zero under either sm90 interleave (every output byte holds a whole nibble magnitude), so the zero-byte
# count must be preserved by every layout, not just by the byte permutations.

NONZERO_NIBBLES = np.array([h << 4 | lo for h in range(16) for lo in range(16) if h & 7 and lo & 7], np.uint8)


def padded(tensor: str, real: int) -> tuple[np.ndarray, np.ndarray]:
    """Model-layout [2, N, C] with TP3 padding for `real` of 768 intermediate rows, and its zero mask."""
    n, c = REAL[tensor]
    x = RNG.choice(NONZERO_NIBBLES, (2, n, c))
    zero = np.zeros((n, c), bool)
    if tensor.startswith("w13"):
        zero[real:768] = zero[768 + real:] = True
    else:  # w2 pads K: elements [real, 768) = bytes [real/2, 384) = scale groups [real/32, 24)
        zero[:, real * c // 768:] = True
    x[:, zero] = 0
    return x, zero


@pytest.mark.parametrize("real", [704, 640], ids=["rank01", "rank2"])
@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda lay: lay.name)
def test_zero_padding(layout, real):
    tensor = tensor_of(layout)
    x, zero = padded(tensor, real)
    y = layout.forward(x)
    back = layout.inverse(y)
    assert not back[:, zero].any() and np.array_equal(back, x)
    assert np.count_nonzero(y == 0) == np.count_nonzero(x == 0) == 2 * zero.sum()
    if "interleave" in layout.name:
        # docs/design/kernel-layouts.md §2.7: pad rows are whole 16-row blocks and W2's pad bytes whole 32-byte
        # partitions, so they stay in place (the w13 half swap moves equal pads onto each other).
        assert np.array_equal(y == 0, np.broadcast_to(zero, y.shape))


def test_sm90_scale_pads_land_where_the_spec_says():
    for real, groups in ((704, [2, 3]), (640, [0, 1, 2, 3])):
        x, _ = padded("w2_weight_scale", real)
        f = expert_layout("sm90", "kernel", "folded", "w2_weight_scale").forward(x)  # [2, 64, 6, 16, 16]
        cols = [4 * ms + g for ms in range(4) for g in groups]  # docs/design/kernel-layouts.md §2.7: B = 5, bytes 4*ms + 2..3 (rank 2: all)
        assert not f[:, :, 5][..., cols].any() and np.count_nonzero(f == 0) == f[:, :, 5][..., cols].size
        lg = expert_layout("sm90", "kernel", "legacy", "w2_weight_scale").forward(x)  # [2, 6, 16384]
        lcols = [4 * r + g for r in range(4096) for g in groups]
        assert not lg[:, 5, lcols].any() and np.count_nonzero(lg == 0) == lg[:, 5, lcols].size
    x, _ = padded("w13_weight_scale", 704)
    f = expert_layout("sm90", "kernel", "folded", "w13_weight_scale").forward(x)  # [2, 24, 32, 16, 16]
    assert not f[:, [11, 23]].any() and np.count_nonzero(f == 0) == f[:, [11, 23]].size  # rows 704.., 1472..


# ---------------------------------------------------------------- 128x4 swizzle formula


def swizzle_offset(m, k, c):
    """docs/design/kernel-layouts.md §2.6."""
    return (m // 128) * 128 * c + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


@pytest.mark.parametrize("c, m128", [(128, 16384), (24, 3072)])
def test_swizzle_spot_values(c, m128):
    for (m, k), want in {(1, 0): 16, (32, 0): 4, (0, 4): 512, (128, 0): m128, (0, 0): 0}.items():
        x = np.zeros((1, 256, c), np.uint8)
        x[0, m, k] = 1
        assert np.flatnonzero(L.swizzle_128x4(x)).tolist() == [want]
        assert swizzle_offset(m, k, c) == want


@pytest.mark.parametrize("n, c", [(1536, 128), (4096, 24)])
def test_swizzle_formula_everywhere(n, c):
    m, k = np.meshgrid(np.arange(n), np.arange(c), indexing="ij")
    # Swizzle the coordinates themselves, one byte at a time, and read where each (m, k) landed.
    planes = [(v >> s & 255).astype(np.uint8)[None] for v, s in ((m, 0), (m, 8), (k, 0))]
    got_m, got_m_hi, got_k = (L.swizzle_128x4(p).reshape(-1).astype(np.int64) for p in planes)
    got_m |= got_m_hi << 8
    assert np.array_equal(swizzle_offset(got_m, got_k, c), np.arange(n * c))


# ---------------------------------------------------------------- sm90: literal kernel emulations


def bitperm(raw: int) -> int:
    """docs/design/kernel-layouts.md §2.3: OR of (raw & mask) shifted by s over the 18 pairs."""
    out = 0
    for mask, s in L.SM90_BITPERM:
        v = raw & mask
        out |= (v << s) if s >= 0 else (v >> -s)
    return out & 0xFFFFFFFF


def emulate_interleave(w: np.ndarray) -> np.ndarray:
    """docs/design/kernel-layouts.md §2.3 pseudo-code, scalar, per expert."""
    out = np.zeros_like(w)
    for e in range(w.shape[0]):
        W, Wp = w[e].tolist(), out[e]
        n, kb = w.shape[1:]
        for block_id in range(n // 2):
            r = (block_id // 8) * 16 + block_id % 8
            for p in range(kb // 32):
                for lane in range(16):
                    mma, l4 = lane // 4, lane % 4
                    c = p * 32 + mma * 8 + l4
                    raw = W[r][c] | W[r + 8][c] << 8 | W[r][c + 4] << 16 | W[r + 8][c + 4] << 24
                    o = bitperm(raw)
                    dr = r + (mma % 2) * 8
                    dc = p * 32 + (lane // 8) * 16 + l4 * 4
                    for i in range(4):
                        Wp[dr, dc + i] = (o >> (8 * i)) & 0xFF
    return out


def emulate_interleave_legacy(w: np.ndarray) -> np.ndarray:
    """docs/design/kernel-layouts.md §2.5 pseudo-code, scalar, per expert."""
    out = np.zeros_like(w)
    for e in range(w.shape[0]):
        W, Wp = w[e].tolist(), out[e]
        n, kb = w.shape[1:]
        for block_id in range(n // 2):
            r = (block_id // 8) * 16 + block_id % 8
            for p in range(kb // 32):
                for lane in range(32):
                    c = p * 32 + lane
                    a, b = W[r][c], W[r + 8][c]
                    a2 = (a & 0x0F) | (b & 0x0F) << 4
                    b2 = (b & 0xF0) | (a >> 4)
                    dr = r + ((lane // 8) % 2) * 8
                    dc = p * 32 + (lane // 16) * 16 + (lane % 4) * 4 + ((lane % 8) // 4) * 2
                    Wp[dr, dc], Wp[dr, dc + 1] = a2, b2
    return out


SM90_EMULATIONS = [
    (L.interleave_sm90, L.deinterleave_sm90, emulate_interleave),
    (L.interleave_sm90_legacy, L.deinterleave_sm90_legacy, emulate_interleave_legacy),
]


@pytest.mark.parametrize("fwd, inv, emulate", SM90_EMULATIONS, ids=["folded", "legacy"])
@pytest.mark.parametrize("n, kb", [(16, 32), (32, 64), (48, 128)])
def test_sm90_interleave_equals_kernel(fwd, inv, emulate, n, kb):
    x = rand(2, n, kb)
    y = emulate(x)
    assert np.array_equal(fwd(x), y)
    assert np.array_equal(inv(y), x)


@pytest.mark.parametrize("fwd, inv, emulate", SM90_EMULATIONS, ids=["folded", "legacy"])
def test_sm90_interleave_slabs_cross_experts(fwd, inv, emulate, monkeypatch):
    monkeypatch.setattr(L, "_SLAB_BYTES", 2 * 16 * 64)  # 2 tiles per slab; 3 tiles per expert; last slab short
    x = rand(3, 48, 64)
    y = emulate(x)
    assert np.array_equal(fwd(x), y)
    assert np.array_equal(inv(y), x)


def test_sm90_bitperm_is_a_permutation():
    bits = [bitperm(1 << b) for b in range(32)]
    assert sorted(bits) == [1 << b for b in range(32)]


# ---------------------------------------------------------------- sm90 scale folds, elementwise


def test_fold_scales_formula():
    s = rand(2, 128, 8)
    out = L.fold_scales_sm90(s)
    assert out.shape == (2, 2, 2, 16, 16)
    for e, R, B, fm, ms, g in itertools.product(range(2), range(2), range(2), range(16), range(4), range(4)):
        assert out[e, R, B, fm, 4 * ms + g] == s[e, 64 * R + 16 * ms + fm, 4 * B + g]


def test_fold_scales_legacy_formula():
    s = rand(2, 24, 12)
    out = L.fold_scales_sm90_legacy(s)
    assert out.shape == (2, 3, 96)
    for e, B, r, g in itertools.product(range(2), range(3), range(24), range(4)):
        assert out[e, B, 4 * r + g] == s[e, r, 4 * B + g]


# ---------------------------------------------------------------- preconditions


@pytest.mark.parametrize("fn, shape", [
    (L.swap_halves, (1, 7, 4)),
    (L.swizzle_128x4, (1, 100, 4)),
    (L.swizzle_128x4, (2, 4096, 22)),  # I = 704 without the kernel padding
    (L.unswizzle_128x4, (1, 128, 6)),
    (L.interleave_sm90, (1, 8, 32)),
    (L.interleave_sm90, (1, 16, 48)),
    (L.deinterleave_sm90, (1, 24, 32)),
    (L.interleave_sm90_legacy, (1, 16, 16)),
    (L.deinterleave_sm90_legacy, (3, 40, 64)),
    (L.fold_scales_sm90, (2, 4096, 22)),  # docs/design/kernel-layouts.md §2.4: 22 % 4 raises
    (L.fold_scales_sm90, (1, 96, 4)),
    (L.fold_scales_sm90_legacy, (2, 4096, 22)),
    (L.unfold_scales_sm90_legacy, (1, 4, 10)),
    (L.unfold_scales_sm90, (1, 2, 2, 16, 8)),
])
def test_precondition_errors_name_the_shape(fn, shape):
    with pytest.raises(ValueError, match=str(list(shape)).replace("[", r"\[").replace("]", r"\]")):
        fn(np.zeros(shape, np.uint8))


def test_bad_inputs_raise():
    lay = expert_layout("sm90", "kernel", "folded", "w2_weight_scale")
    with pytest.raises(ValueError, match=r"\[4096, 22\]"):
        lay.kernel_shape((4096, 22))
    with pytest.raises(ValueError, match="uint8"):
        lay.forward(np.zeros((1, 64, 4), np.int8))
    with pytest.raises(ValueError, match="3 dims"):
        L.swizzle_128x4(np.zeros((128, 4), np.uint8))
