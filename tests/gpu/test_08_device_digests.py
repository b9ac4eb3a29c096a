"""verify=full's hashing on the GPU (src/lucifer_shard/runtime_shim/load/device_blake3.py, Triton) against the blake3 package.

  * the kernels, compiled for the GPU: every tree shape up to 17 chunks, and large tensors (one Flash
    TP3 layer's w13 experts, 805 MB) with a short last chunk; the per-device self check;
  * the reader: a rank-file-like safetensors file read onto the GPU with digests gives, for every
    tensor, the blake3 package's digest of the file's bytes, hashed on the GPU where the kernels take
    the tensor and on the host for the rest (and the same as with `hash_on_device=False`); a flipped
    byte changes that tensor's digest and no other;
  * the kernels' speed on the 805 MB tensor (CUDA events), recorded, not asserted (bench/gpu_load.py
    measures what it costs a load).
"""
from __future__ import annotations

import pytest
import torch
from blake3 import blake3
from safetensors.torch import save_file

import gpu_harness as H

# the kernels are Triton's, compiled for the GPU: nothing to run in the suite's CPU dry run
pytestmark = [pytest.mark.gpu] + [pytest.mark.skip(reason="needs CUDA (Triton kernels)")] * H.DRYRUN

SHAPES = [1028, 2048, 2052, 3072, 4164, 5120, 6396, 7168, 8192, 9212, 16 * 1024, 17 * 1024 + 512]
W13 = 256 * 1536 * 2048  # bytes of one Flash TP3 layer's routed w13 (MXFP4, packed), per rank


def _host(t: torch.Tensor) -> str:
    return blake3(t.cpu().reshape(-1).view(torch.uint8).numpy(), max_threads=blake3.AUTO).hexdigest()


def test_kernels_hash_as_the_blake3_package_on_the_gpu():
    from lucifer_shard.runtime_shim.load import device_blake3 as b3

    assert b3.self_check(torch.device(H.DEVICE)) is None
    g = torch.Generator().manual_seed(8)
    for n in SHAPES + [(1 << 20) + 4, (128 * 128 << 10) + 4, W13 + 1028]:  # + three launches, the last of 2 nodes
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert b3.hexdigest(b3.digest_words(t.to(H.DEVICE))) == _host(t), n


def test_kernels_speed_recorded():
    from lucifer_shard.runtime_shim.load import device_blake3 as b3

    t = torch.randint(0, 256, (W13,), dtype=torch.uint8, device=H.DEVICE)
    b3.digest_words(t)  # compiled before it is timed
    ms = H.time_ms(lambda: b3.digest_words(t), reps=10)
    H.record("device_blake3", bytes=W13, ms=round(ms, 3), gb_per_s=round(W13 / ms / 1e6, 1))
    print(f"device BLAKE3: {W13 / 1e6:.0f} MB in {ms:.2f} ms, {W13 / ms / 1e6:.1f} GB/s")


@pytest.fixture
def rank_like(tmp_path):
    """Tensors the reader meets in a rank file: large U8 experts, bf16 weights, a short odd-length one, a
    one-chunk one (the last two hashed on the host)."""
    g = torch.Generator().manual_seed(9)
    tensors = {
        "layers.0.ffn.experts.w13_weight": torch.randint(0, 256, (16, 1536, 2048), dtype=torch.uint8, generator=g),
        "layers.0.attn.wq_b.weight": torch.randn(1024, 1537, generator=g).to(torch.bfloat16),
        "layers.0.ffn.experts.w13_weight_scale": torch.randint(0, 256, (3, 999, 7), dtype=torch.uint8, generator=g),
        "layers.0.attn_norm.weight": torch.randn(200, generator=g).to(torch.bfloat16),
    }
    path = tmp_path / "part-00000.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _read(path, tensors, hash_on_device=True):
    from lucifer_shard.formats.stheader import read_header
    from lucifer_shard.runtime_shim.load import reader

    header = read_header(path)
    dst = {n: torch.empty_like(t, device=H.DEVICE) for n, t in tensors.items()}
    reads = [reader.TensorRead(n, header.data_start + header.tensors[n].start, dst[n]) for n in tensors]
    got = reader.read_tensors(path, reads, digests=True, hash_on_device=hash_on_device, chunk=1 << 20)
    return dst, got


def test_reader_hashes_on_the_gpu_as_the_host_does(rank_like, monkeypatch):
    from lucifer_shard.runtime_shim.load import device_blake3 as b3

    path, tensors = rank_like
    assert b3.self_check(torch.empty(0, device=H.DEVICE).device) is None  # done (and cached) before counting
    hashed_here = []
    kernel = b3.digest_words
    monkeypatch.setattr(b3, "digest_words", lambda t: hashed_here.append(t.numel()) or kernel(t))
    dst, got = _read(path, tensors)
    # the experts and wq_b; the odd-length scale and the one-chunk norm on the host
    assert sorted(hashed_here) == sorted(tensors[n].numel() for n in tensors if "wq_b" in n or n.endswith("w13_weight"))
    want = {n: _host(t) for n, t in tensors.items()}
    assert got == want
    assert all(torch.equal(dst[n].cpu(), t) for n, t in tensors.items())
    assert _read(path, tensors, hash_on_device=False)[1] == want


def test_a_flipped_byte_changes_that_tensors_device_digest_only(rank_like):
    from lucifer_shard.formats.stheader import read_header

    path, tensors = rank_like
    _, before = _read(path, tensors)
    header = read_header(path)
    experts = "layers.0.ffn.experts.w13_weight"  # hashed on the GPU
    data = bytearray(path.read_bytes())
    data[header.data_start + header.tensors[experts].start + 12_345_678] ^= 0x01
    path.write_bytes(bytes(data))
    _, after = _read(path, tensors)
    assert {n for n in before if before[n] != after[n]} == {experts}
