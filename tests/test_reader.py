"""The loader's read path (`runtime_shim/reader.py`): positional reads into parameter storage, in place
or through the host-buffer ring a GPU parameter takes, with BLAKE3 computed while reading."""
from __future__ import annotations

import pytest
import torch
from blake3 import blake3
from safetensors.torch import save_file

from lucifer_shard.runtime_shim import reader
from lucifer_shard.runtime_shim.errors import ShimError
from lucifer_shard.spec.stheader import read_header

TENSORS = {  # odd sizes: chunks end inside elements and tensors
    "a.weight": ((300, 77), torch.bfloat16),
    "b.scale": ((1001,), torch.float8_e8m0fnu),
    "c.experts": ((3, 129, 33), torch.uint8),
    "d.sink": ((24,), torch.float32),
}


@pytest.fixture
def shard(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randint(0, 256, (int(torch.tensor(s).prod()) * torch.empty((), dtype=dt).element_size(),),
                                dtype=torch.uint8, generator=g).view(dt).reshape(s) for n, (s, dt) in TENSORS.items()}
    path = tmp_path / "part-00000.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _reads(path, tensors, sink_len: int = 32):
    """Fresh destinations like a model's: attn_sink-style prefix of a longer parameter for d.sink."""
    header = read_header(path)
    params, reads = {}, []
    for name, t in tensors.items():
        p = torch.full((sink_len,), float("-inf")) if name == "d.sink" else torch.empty_like(t)
        params[name] = p
        dst = p[: t.shape[0]] if name == "d.sink" else p
        reads.append(reader.TensorRead(name, header.data_start + header.tensors[name].start, dst))
    return params, reads


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-ring"])
@pytest.mark.parametrize("digests", [False, True], ids=["plain", "hashed"])
def test_reads_every_byte_into_the_parameter(shard, monkeypatch, staged, digests):
    path, tensors = shard
    monkeypatch.setattr(reader, "CHUNK", 4096)  # many chunks per tensor: the ring wraps many times
    params, reads = _reads(path, tensors)
    got = reader.read_tensors(path, reads, digests=digests, staged=staged)
    for name, t in tensors.items():
        p = params[name]
        if name == "d.sink":
            assert torch.isinf(p[24:]).all()  # the padded tail is untouched
            p = p[:24]
        assert _raw(p) == _raw(t), name
    assert got == ({n: blake3(_raw(t)).hexdigest() for n, t in tensors.items()} if digests else {})


@pytest.mark.parametrize("digests", [False, True], ids=["plain", "hashed"])
def test_truncated_file_is_named_in_one_line(shard, digests):
    path, tensors = shard
    params, reads = _reads(path, tensors)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(ShimError) as e:
        reader.read_tensors(path, reads, digests=digests)
    msg = str(e.value)
    assert "\n" not in msg and f"{path} ends inside tensor" in msg and "truncated" in msg, msg


def test_refuses_a_non_contiguous_destination(shard):
    path, tensors = shard
    _, reads = _reads(path, tensors)
    t = torch.empty(77, 300, dtype=torch.bfloat16).t()
    reads[0] = reader.TensorRead("a.weight", reads[0].offset, t)
    with pytest.raises(ShimError, match="a.weight is not contiguous"):
        reader.read_tensors(path, reads)


def test_huge_page_advice_covers_only_whole_huge_pages_inside_each_destination(tmp_path, monkeypatch):
    """The THP advice goes to the 2 MiB-aligned interior of every in-place destination and nowhere
    else (the memory around a parameter belongs to others), and the bytes still land exactly."""
    data = torch.randint(0, 256, (5 * reader.HUGE_PAGE + 12345,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    path = tmp_path / "big.safetensors"
    save_file({"big": data, "small": data[:100].clone()}, str(path))
    header = read_header(path)
    backing = torch.zeros(data.numel() + 3 * reader.HUGE_PAGE, dtype=torch.uint8)
    skew = (-backing.data_ptr() % reader.HUGE_PAGE) + 777  # start 777 bytes past a huge-page boundary
    big, small = backing[skew:skew + data.numel()], torch.empty(100, dtype=torch.uint8)
    advised = []
    real = reader._advise_huge_pages
    monkeypatch.setattr(reader, "_advise_huge_pages", lambda reads: (advised.extend(reads), real(reads)))
    reader.read_tensors(path, [reader.TensorRead(n, header.data_start + header.tensors[n].start, t)
                               for n, t in (("big", big), ("small", small))])
    assert _raw(big) == _raw(data) and _raw(small) == _raw(data[:100])
    assert {r.name for r in advised} == {"big", "small"}
    start, end = reader.huge_page_interior(big.data_ptr(), big.numel())
    assert (start - big.data_ptr(), big.data_ptr() + big.numel() - end) == (reader.HUGE_PAGE - 777,
                                                                           (data.numel() + 777) % reader.HUGE_PAGE)
    assert start % reader.HUGE_PAGE == 0 and (end - start) // reader.HUGE_PAGE == 4
    assert reader.huge_page_interior(small.data_ptr(), 100) is None  # smaller than a huge page: no advice
