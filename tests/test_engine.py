"""Engine internals (issue 8): pooled buffers, direct reads, write-behind and folded swaps change no byte."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lucifer_shard.engine import assemble, stwriter
from lucifer_shard.engine.convert import convert
from lucifer_shard.guarded_io import Tree
from lucifer_shard.model.options import Options


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".lucifer" not in p.parts}


@pytest.mark.parametrize("arch,workers,direct,prefetch", [("sm120", 1, True, 2), ("sm120", 3, False, 0),
                                                          ("sm90", 2, True, 1)])
def test_tiny_chunks_poisoned_buffers_and_write_paths(tiny_pattern, tmp_path, monkeypatch, converted, arch, workers,
                                                      direct, prefetch):
    """Many chunks per tensor, pool buffers that start full of garbage and are reused, a direct-I/O
    stage of two pages or a write-behind window of one page, direct or buffered reads with or without
    prefetching: the output is still byte-identical to the session's conversion with the default engine
    settings (made, if not yet, before the patches below).
    Garbage left anywhere (a byte no piece or pad tail covers) would show up here."""
    reference = converted(arch=arch)
    take = assemble.EngineBufferPool.take

    def poisoned(self, shape):
        buf = take(self, shape)
        buf[...] = 0xA5
        return buf

    monkeypatch.setattr(assemble, "CHUNK_BYTES", 1500)
    monkeypatch.setattr(assemble.EngineBufferPool, "take", poisoned)
    monkeypatch.setattr(stwriter, "WRITE_BEHIND", 4096)
    monkeypatch.setattr(stwriter, "WRITE_DEPTH", 1)
    monkeypatch.setattr(stwriter, "STAGE_BYTES", 2 * stwriter.ALIGN)
    monkeypatch.setattr(stwriter, "DIRECT", direct)
    monkeypatch.setattr(assemble, "DIRECT", direct)
    monkeypatch.setattr(assemble, "PREFETCH", prefetch)
    monkeypatch.setattr(assemble, "READ_BLOCK", 2 * assemble.ALIGN)
    out = tmp_path / "out"
    convert(str(tiny_pattern), out, Options(tp=3, arch=arch), workers=workers, progress=False)
    assert _tree(out) == _tree(reference)


def test_pool_reuses_and_bounds_buffers():
    pool = assemble.EngineBufferPool(capacity=1024, keep=2)
    a = pool.take((4, 16))
    base = a.base
    pool.give(a)
    b = pool.take((8, 8))
    assert b.base is base  # reused, no new allocation
    big = pool.take((2048,))
    assert big.nbytes == 2048  # larger than the capacity: a private array, never pooled
    pool.give(big)
    for x in [pool.take((1,)) for _ in range(5)]:
        pool.give(x)
    assert len(pool._free) == 2


def test_contiguity_rule():
    c = assemble._contiguous
    assert c([(0, 4), (0, 8)], (4, 8))
    assert c([(1, 3), (0, 8)], (4, 8))
    assert c([(2, 3), (2, 5)], (4, 8))
    assert not c([(1, 3), (2, 5)], (4, 8))
    assert not c([(0, 4), (0, 4)], (4, 8))
    assert c([(3, 4), (0, 2), (0, 8)], (5, 4, 8))
    assert not c([(0, 2), (0, 2), (0, 8)], (5, 4, 8))


def test_swap_fold_matches_the_layout_step(tiny_pattern):
    """Assembling w13 with swapped pieces equals assembling it plainly and applying swap_halves."""
    from lucifer_shard.model.layouts import swap_halves
    from lucifer_shard.model.plan import make_plan
    from lucifer_shard.model.tensorspecs import build_specs
    from lucifer_shard.source.checkpoint import open_checkpoint

    ckpt = open_checkpoint(tiny_pattern)
    specs = build_specs(ckpt.config, make_plan(ckpt.config, 3), "target")
    w13 = [next(s for s in rank if s.expert_tensor == "w13_weight") for rank in specs]
    plain = assemble.assemble(ckpt, w13, 0, 2)
    folded = assemble.assemble(ckpt, [assemble.swap_folded(s) for s in w13], 0, 2)
    for p, f in zip(plain, folded):
        assert np.array_equal(swap_halves(np.ascontiguousarray(p)), f)
    w2 = next(s for s in specs[0] if s.expert_tensor == "w2_weight")
    assert assemble.swap_folded(w2) is None


@pytest.mark.parametrize("fallback_at", [None, 0, 3])
def test_direct_writer_matches_buffered_and_falls_back(tmp_path, monkeypatch, fallback_at):
    """Direct-I/O staging (with a stage smaller than one tensor), a fallback to buffered writes part
    way (as when a filesystem refuses O_DIRECT or a short write unaligns the offset) and plain
    buffered writes give the same file, digests included, and safetensors reads it back."""
    from safetensors.numpy import load_file

    monkeypatch.setattr(stwriter, "STAGE_BYTES", 2 * stwriter.ALIGN)
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate([5, 9000, 1, 4096, 12345, 3])}
    headers = [stwriter.TensorHeader(k, "U8", (len(v),)) for k, v in arrays.items()]

    def write(path: Path, direct: bool, switch: int | None):
        w = stwriter.StreamWriter(Tree(path.parent), path.name, headers, {"k": "v"}, direct=direct)
        for i, (k, v) in enumerate(arrays.items()):
            if i == switch and w._direct:
                w._buffered()
            for j in range(0, len(v), 4000):
                w.write(k, v[j:j + 4000])
        return w.close()

    a = write(tmp_path / "a.safetensors", True, fallback_at)
    b = write(tmp_path / "b.safetensors", False, None)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert (a.digest, a.tensor_digests) == (b.digest, b.tensor_digests)
    assert stwriter.hash_file(Tree(tmp_path), "a.safetensors") == (a.digest, a.tensor_digests)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert all(np.array_equal(back[k], v) for k, v in arrays.items())


def test_reads_fall_back_when_direct_io_is_refused(tiny_pattern, tmp_path, monkeypatch, converted):
    """A filesystem that opens with O_DIRECT but refuses the reads (EINVAL): every shard is then read
    buffered and the output does not change."""
    reference = converted(arch="sm120")
    import errno
    import fcntl
    import os

    real = os.preadv
    refused = []

    def preadv(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(stwriter, "DIRECT", False)
    out = tmp_path / "out"
    convert(str(tiny_pattern), out, Options(tp=3, arch="sm120"), progress=False)
    assert refused, "the test did not exercise direct reads"
    assert _tree(out) == _tree(reference)
