"""The loader's read path (`src/lucifer_shard/runtime_shim/load/reader.py`): positional reads into parameter storage, in place
or through the host-buffer ring a GPU parameter takes, with BLAKE3 computed while reading."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from lucifer_shard.formats.stheader import read_header
from lucifer_shard.runtime_shim.errors import ShimError
from lucifer_shard.runtime_shim.load import reader

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


def _lucifer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("lucifer-read", "lucifer-hash"))]


@pytest.mark.parametrize("digests", [False, True], ids=["plain", "hashed"])
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-ring"])
def test_many_reads_in_flight_match_safetensors_own_reading(shard, digests, staged):
    """Several readers, a ring smaller than the reads in flight could use, chunks that end inside
    elements: every byte equals what safetensors itself reads, digests as serial BLAKE3."""
    path, _ = shard
    ref = load_file(str(path))
    params, reads = _reads(path, ref)
    got = reader.read_tensors(path, reads, digests=digests, staged=staged, threads=4, slots=3, chunk=1000)
    for name, t in ref.items():
        assert _raw(params[name][: t.shape[0]] if name == "d.sink" else params[name]) == _raw(t), name
    assert got == ({n: blake3(_raw(t)).hexdigest() for n, t in ref.items()} if digests else {})
    assert not _lucifer_threads()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(1, 70_000), slots=st.integers(1, 9), threads=st.integers(1, 5), staged=st.booleans())
def test_any_chunk_and_ring_size_reads_the_same_bytes(shard, chunk, slots, threads, staged):
    path, _ = shard
    ref = load_file(str(path))
    params, reads = _reads(path, ref)
    got = reader.read_tensors(path, reads, digests=True, staged=staged, threads=threads, slots=slots, chunk=chunk)
    for name, t in ref.items():
        assert _raw(params[name][: t.shape[0]] if name == "d.sink" else params[name]) == _raw(t), name
    assert got == {n: blake3(_raw(t)).hexdigest() for n, t in ref.items()}


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-ring"])
@pytest.mark.parametrize("digests", [False, True], ids=["plain", "hashed"])
def test_a_worker_error_reaches_the_caller_and_no_thread_outlives_it(shard, staged, digests):
    """Truncated in the first tensor's middle with many small reads in flight: the serial reader's
    message (the first short chunk in file order), raised once every worker was joined."""
    path, tensors = shard
    params, reads = _reads(path, tensors)
    header = read_header(path)
    cut = header.data_start + header.tensors["a.weight"].start + 20_000
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ShimError) as e:
        reader.read_tensors(path, reads, digests=digests, staged=staged, threads=4, slots=6, chunk=1024)
    assert str(e.value) == (f"lucifer_tp3: {path} ends inside tensor a.weight (byte {cut} of the file); the file is "
                            f"truncated; run the same convert command with --resume (it keeps what is finished and "
                            f"sound and writes the rest), or re-copy it")
    assert not _lucifer_threads()


# ---------------------------------------------------------------- issue 52, R and S


@pytest.mark.parametrize("errno_", [5, 12], ids=["EIO", "ENOMEM"])
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-ring"])
def test_a_failing_read_names_the_file_and_the_tensor_in_one_line(shard, monkeypatch, errno_, staged):
    """R: an OSError of one positional read (the disk's EIO, the kernel's ENOMEM) was a bare `OSError:
    [Errno 5]` naming nothing; now the shim's one-line ShimError names the file, tensor and byte."""
    path, tensors = shard
    params, reads = _reads(path, tensors)
    real = reader.os.preadv
    victim = reads[2]

    def failing(fd, buffers, offset):
        if offset == victim.offset:
            raise OSError(errno_, os.strerror(errno_))
        return real(fd, buffers, offset)

    monkeypatch.setattr(reader.os, "preadv", failing)
    with pytest.raises(ShimError) as e:
        reader.read_tensors(path, reads, staged=staged, chunk=1 << 20)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and f"tensor {victim.name} at byte {victim.offset}" in msg, msg
    assert os.strerror(errno_) in msg and not _lucifer_threads()


@pytest.mark.parametrize("offset", [2 ** 63, -4096, 1 << 40], ids=["2**63", "-4096", "past-the-end"])
def test_offsets_outside_the_file_are_refused_naming_the_tensor(shard, offset):
    """S: offset 2**63 raised OverflowError, -4096 an OSError naming no file."""
    path, tensors = shard
    params, reads = _reads(path, tensors)
    bad = reader.TensorRead(reads[0].name, offset, reads[0].dst)
    with pytest.raises(ShimError, match=f"tensor {bad.name} starts at byte {offset}, outside the file"):
        reader.read_tensors(path, [bad, *reads[1:]])


@pytest.mark.parametrize("chunk", [0, -1])
def test_a_chunk_below_one_byte_is_refused(shard, chunk):
    """S: chunk=-1 read nothing and returned the digest of empty input for every tensor."""
    path, tensors = shard
    params, reads = _reads(path, tensors)
    with pytest.raises(ShimError, match=f"chunk size {chunk}"):
        reader.read_tensors(path, reads, digests=True, chunk=chunk)
