"""BLAKE3 of a tensor's bytes, computed on the device that holds them (Triton kernels).

verify=full hashes every tensor. On the host that hash is one more pass over memory per byte, after the
read out of the page cache, the copy into the pinned ring and the DMA's read of it: measured on the H200
host it cost 18-25% of a warm load at every thread, slot, chunk and lane setting (docs/evidence/performance.md,
"verify=full's warm cost"). On the GPU the bytes already sit in the parameter, in memory ten times
faster, and hashing them there checks what the model will use rather than a staging copy.

The digest is BLAKE3's own (the blake3 package gives the same hex for the same bytes; the tests hold it
to that): 1 KiB chunks compressed block by block, one chunk per lane, then a binary tree of parent
compressions. Pairing each level's nodes from the left and carrying an odd last node up unchanged
builds exactly BLAKE3's tree, whose left subtree always holds the largest power-of-two number of chunks
that leaves the right one non-empty; so every aligned run of 128 nodes is a subtree of its own, and a
program folds its 128 lanes into one node (`_fold`) before the next launch takes 128 of those
(`_chunk_kernel`, then `_node_kernel` until one node is left: the root).

Only tensors of more than one chunk whose length and address are whole 4-byte words are hashed here
(`eligible`): the kernels read 32-bit words. The reader hashes the rest on the host, and there are few
of them (norms, biases, small scales).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 1024
ROOT = 8  # BLAKE3's root flag (the kernels write CHUNK_START 1, CHUNK_END 2 and PARENT 4 inline)
LANES, LEVELS = 128, 7  # nodes per program (one per thread at 4 warps), folded there into one: 2**7 = 128


def fits(nbytes: int, address: int) -> bool:
    """Whether the kernels take `nbytes` bytes at `address`: more than one chunk (a lone chunk is the
    root, which the chunk kernel never is), whole 32-bit words at a word-aligned address."""
    return nbytes > CHUNK_BYTES and nbytes % 4 == 0 and address % 4 == 0


def eligible(t: torch.Tensor) -> bool:
    """Whether `t` is hashed here: contiguous on a GPU, and its bytes `fits`."""
    return t.is_cuda and t.is_contiguous() and fits(t.numel() * t.element_size(), t.data_ptr())


@functools.cache
def self_check(device: torch.device) -> str | None:
    """None when the kernels hash on `device` exactly as the blake3 package does, else why not (a
    compile or launch error, or a wrong digest), checked once per device. A sample of 3.5 chunks takes
    every path: full and short chunks, a short last block, a parent level with an odd node carried up."""
    from blake3 import blake3

    sample = torch.arange(3584, dtype=torch.int64).mul(2654435761).remainder(251).to(torch.uint8)
    try:
        got = hexdigest(digest_words(sample.to(device)))
    except Exception as e:  # Triton's compile and launch errors have no common base
        return f"the BLAKE3 kernels do not run on {device}: {type(e).__name__}: {e}"
    want = blake3(sample.numpy().tobytes()).hexdigest()
    return None if got == want else f"the BLAKE3 kernels hash wrong on {device} ({got[:16]}... != {want[:16]}...)"


def digest_words(t: torch.Tensor) -> torch.Tensor:
    """BLAKE3 of `t`'s bytes as 8 little-endian 32-bit words (int32) on `t`'s device, computed on the
    current stream; `t` must be `eligible` (the CPU works too, under TRITON_INTERPRET=1: the tests).
    One launch per 7 tree levels (three for an 805 MB expert tensor): launches, not arithmetic, are
    what a load of a thousand tensors would otherwise wait for."""
    words = t.reshape(-1).view(torch.uint8).view(torch.int32)
    nbytes = words.numel() * 4
    n = -(-nbytes // CHUNK_BYTES)
    up = triton.cdiv(n, LANES)
    nodes = torch.empty(up * 8, dtype=torch.int32, device=t.device)
    _chunk_kernel[(up,)](words, nodes, n, nbytes, ROOT if up == 1 else 0, LANES=LANES, LEVELS=LEVELS)
    while up > 1:
        n, up = up, triton.cdiv(up, LANES)
        above = torch.empty(up * 8, dtype=torch.int32, device=t.device)
        _node_kernel[(up,)](nodes, above, n, ROOT if up == 1 else 0, LANES=LANES, LEVELS=LEVELS)
        nodes = above
    return nodes


def hexdigest(words: torch.Tensor) -> str:
    """The hex digest (as blake3's `hexdigest`) of `digest_words`' 8 words (on the host)."""
    return words.cpu().numpy().astype("<i4").tobytes().hex()


@triton.jit
def _iv(like):
    """BLAKE3's IV (SHA-256's), broadcast to `like`'s shape."""
    return (tl.full(like.shape, 0x6A09E667, tl.uint32), tl.full(like.shape, 0xBB67AE85, tl.uint32),
            tl.full(like.shape, 0x3C6EF372, tl.uint32), tl.full(like.shape, 0xA54FF53A, tl.uint32),
            tl.full(like.shape, 0x510E527F, tl.uint32), tl.full(like.shape, 0x9B05688C, tl.uint32),
            tl.full(like.shape, 0x1F83D9AB, tl.uint32), tl.full(like.shape, 0x5BE0CD19, tl.uint32))


@triton.jit
def _rotr(x, n: tl.constexpr):
    return (x >> n) | (x << (32 - n))


@triton.jit
def _g(a, b, c, d, mx, my):
    """BLAKE3's G: two mixing steps, rotations 16, 12 then 8, 7."""
    a, b, c, d = _mix(a, b, c, d, mx, 16, 12)
    return _mix(a, b, c, d, my, 8, 7)


@triton.jit
def _mix(a, b, c, d, m, r1: tl.constexpr, r2: tl.constexpr):
    a = a + b + m
    d = _rotr(d ^ a, r1)
    c = c + d
    b = _rotr(b ^ c, r2)
    return a, b, c, d


@triton.jit
def _compress(h0, h1, h2, h3, h4, h5, h6, h7,
              m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
              counter, block_len, flags):
    """BLAKE3's compression function, its first 8 output words (a chaining value, or the hash at the root)."""
    s0, s1, s2, s3, s4, s5, s6, s7 = h0, h1, h2, h3, h4, h5, h6, h7
    s8, s9, s10, s11, _, _, _, _ = _iv(h0)
    s12 = counter
    s13 = tl.zeros(h0.shape, tl.uint32)  # the counter's high word: tensors stay far below 4 TiB
    s14 = block_len
    s15 = flags
    for _ in range(7):  # a loop, not unrolled: unrolled, the kernels took over 10 minutes to compile
        s0, s4, s8, s12 = _g(s0, s4, s8, s12, m0, m1)
        s1, s5, s9, s13 = _g(s1, s5, s9, s13, m2, m3)
        s2, s6, s10, s14 = _g(s2, s6, s10, s14, m4, m5)
        s3, s7, s11, s15 = _g(s3, s7, s11, s15, m6, m7)
        s0, s5, s10, s15 = _g(s0, s5, s10, s15, m8, m9)
        s1, s6, s11, s12 = _g(s1, s6, s11, s12, m10, m11)
        s2, s7, s8, s13 = _g(s2, s7, s8, s13, m12, m13)
        s3, s4, s9, s14 = _g(s3, s4, s9, s14, m14, m15)
        # the message permutation between rounds (the last one's result goes unused)
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = \
            m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8
    return s0 ^ s8, s1 ^ s9, s2 ^ s10, s3 ^ s11, s4 ^ s12, s5 ^ s13, s6 ^ s14, s7 ^ s15


@triton.jit
def _word(ptr, index, mask):
    return tl.load(ptr + index, mask=mask, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _pick(cond, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    """Eight words: a's where `cond`, else b's."""
    return (tl.where(cond, a0, b0), tl.where(cond, a1, b1), tl.where(cond, a2, b2), tl.where(cond, a3, b3),
            tl.where(cond, a4, b4), tl.where(cond, a5, b5), tl.where(cond, a6, b6), tl.where(cond, a7, b7))


@triton.jit
def _fold(h0, h1, h2, h3, h4, h5, h6, h7, live, root, LEVELS: tl.constexpr):
    """A program's nodes (the first `live` of them) paired level by level into one: nodes 2i and 2i+1
    into parent i, an odd last node carried up; the compression that leaves one node is the root's when
    `root` (ROOT, else 0) says this program holds the whole tree. The one node, as [1]-shaped words."""
    for _ in tl.static_range(LEVELS):
        # (the width halves each level: a constexpr cannot be reassigned, so it is read off the shapes)
        l0, r0 = tl.split(tl.reshape(h0, [h0.shape[0] // 2, 2]))
        l1, r1 = tl.split(tl.reshape(h1, [h0.shape[0] // 2, 2]))
        l2, r2 = tl.split(tl.reshape(h2, [h0.shape[0] // 2, 2]))
        l3, r3 = tl.split(tl.reshape(h3, [h0.shape[0] // 2, 2]))
        l4, r4 = tl.split(tl.reshape(h4, [h0.shape[0] // 2, 2]))
        l5, r5 = tl.split(tl.reshape(h5, [h0.shape[0] // 2, 2]))
        l6, r6 = tl.split(tl.reshape(h6, [h0.shape[0] // 2, 2]))
        l7, r7 = tl.split(tl.reshape(h7, [h0.shape[0] // 2, 2]))
        pair = 2 * tl.arange(0, l0.shape[0]) + 1 < live
        zero = tl.zeros(l0.shape, tl.uint32)
        k0, k1, k2, k3, k4, k5, k6, k7 = _iv(zero)
        flags = tl.where(live == 2, 4 | root, 4)  # PARENT (| ROOT)
        o0, o1, o2, o3, o4, o5, o6, o7 = _compress(k0, k1, k2, k3, k4, k5, k6, k7,
                                                   l0, l1, l2, l3, l4, l5, l6, l7, r0, r1, r2, r3, r4, r5, r6, r7,
                                                   zero, zero + 64, zero + flags.to(tl.uint32))
        h0, h1, h2, h3, h4, h5, h6, h7 = _pick(pair, o0, o1, o2, o3, o4, o5, o6, o7, l0, l1, l2, l3, l4, l5, l6, l7)
        live = (live + 1) // 2
    return h0, h1, h2, h3, h4, h5, h6, h7


@triton.jit
def _store_node(ptr, index, h0, h1, h2, h3, h4, h5, h6, h7):
    at = index.to(tl.int64) * 8 + tl.arange(0, 1)
    tl.store(ptr + at, h0.to(tl.int32, bitcast=True))
    tl.store(ptr + at + 1, h1.to(tl.int32, bitcast=True))
    tl.store(ptr + at + 2, h2.to(tl.int32, bitcast=True))
    tl.store(ptr + at + 3, h3.to(tl.int32, bitcast=True))
    tl.store(ptr + at + 4, h4.to(tl.int32, bitcast=True))
    tl.store(ptr + at + 5, h5.to(tl.int32, bitcast=True))
    tl.store(ptr + at + 6, h6.to(tl.int32, bitcast=True))
    tl.store(ptr + at + 7, h7.to(tl.int32, bitcast=True))


# do_not_specialize: Triton would compile a variant per size class (a size of 1, or a multiple of 16)
# of each integer argument; one kernel serves every tensor, compiled once per machine
@triton.jit(do_not_specialize=["n_chunks", "nbytes", "root"])
def _chunk_kernel(words_ptr, out_ptr, n_chunks, nbytes, root, LANES: tl.constexpr, LEVELS: tl.constexpr):
    """Each lane one chunk's chaining value (block by block), the program's chunks then folded into one
    node of the tree (the root when the grid is one program: `root`)."""
    first = tl.program_id(0) * LANES
    chunk = first + tl.arange(0, LANES)
    live = chunk < n_chunks
    counter = chunk.to(tl.uint32)
    start = chunk.to(tl.int64) * 1024
    length = tl.minimum(nbytes - start, 1024)
    last_block = tl.maximum((length + 63) // 64, 1) - 1
    h0, h1, h2, h3, h4, h5, h6, h7 = _iv(counter)
    end = nbytes // 4  # words past the tensor read as 0: the zero padding BLAKE3 gives a short last block
    for b in range(16):
        at = start // 4 + b * 16  # the block's first word
        m0 = _word(words_ptr, at + 0, live & (at + 0 < end))
        m1 = _word(words_ptr, at + 1, live & (at + 1 < end))
        m2 = _word(words_ptr, at + 2, live & (at + 2 < end))
        m3 = _word(words_ptr, at + 3, live & (at + 3 < end))
        m4 = _word(words_ptr, at + 4, live & (at + 4 < end))
        m5 = _word(words_ptr, at + 5, live & (at + 5 < end))
        m6 = _word(words_ptr, at + 6, live & (at + 6 < end))
        m7 = _word(words_ptr, at + 7, live & (at + 7 < end))
        m8 = _word(words_ptr, at + 8, live & (at + 8 < end))
        m9 = _word(words_ptr, at + 9, live & (at + 9 < end))
        m10 = _word(words_ptr, at + 10, live & (at + 10 < end))
        m11 = _word(words_ptr, at + 11, live & (at + 11 < end))
        m12 = _word(words_ptr, at + 12, live & (at + 12 < end))
        m13 = _word(words_ptr, at + 13, live & (at + 13 < end))
        m14 = _word(words_ptr, at + 14, live & (at + 14 < end))
        m15 = _word(words_ptr, at + 15, live & (at + 15 < end))
        block_len = tl.where(b == last_block, length - b * 64, 64).to(tl.uint32)
        flags = tl.where(b == last_block, 2, 0) | tl.where(b == 0, 1, 0)  # CHUNK_END, CHUNK_START
        o0, o1, o2, o3, o4, o5, o6, o7 = _compress(h0, h1, h2, h3, h4, h5, h6, h7,
                                                   m0, m1, m2, m3, m4, m5, m6, m7,
                                                   m8, m9, m10, m11, m12, m13, m14, m15,
                                                   counter, block_len, flags.to(tl.uint32))
        on = b <= last_block  # a short last chunk has fewer blocks
        h0, h1, h2, h3, h4, h5, h6, h7 = _pick(on, o0, o1, o2, o3, o4, o5, o6, o7, h0, h1, h2, h3, h4, h5, h6, h7)
    h0, h1, h2, h3, h4, h5, h6, h7 = _fold(h0, h1, h2, h3, h4, h5, h6, h7, n_chunks - first, root, LEVELS)
    _store_node(out_ptr, tl.program_id(0), h0, h1, h2, h3, h4, h5, h6, h7)


@triton.jit(do_not_specialize=["n_nodes", "root"])
def _node_kernel(in_ptr, out_ptr, n_nodes, root, LANES: tl.constexpr, LEVELS: tl.constexpr):
    """The next LEVELS levels of the tree: each program folds LANES nodes into one."""
    first = tl.program_id(0) * LANES
    node = first + tl.arange(0, LANES)
    live = node < n_nodes
    at = node.to(tl.int64) * 8
    h0, h1, h2, h3, h4, h5, h6, h7 = _fold(
        _word(in_ptr, at + 0, live), _word(in_ptr, at + 1, live), _word(in_ptr, at + 2, live),
        _word(in_ptr, at + 3, live), _word(in_ptr, at + 4, live), _word(in_ptr, at + 5, live),
        _word(in_ptr, at + 6, live), _word(in_ptr, at + 7, live), n_nodes - first, root, LEVELS)
    _store_node(out_ptr, tl.program_id(0), h0, h1, h2, h3, h4, h5, h6, h7)
