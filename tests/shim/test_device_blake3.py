"""src/lucifer_shard/runtime_shim/load/device_blake3.py's Triton kernels against the blake3 package, on the CPU through Triton's
interpreter (the vLLM venv has Triton; tests/gpu/test_08_device_digests.py runs them compiled, on a GPU).

The interpreter is chosen when the kernels are decorated (TRITON_INTERPRET=1 at import), so they run in a
child process of their own. Sizes: every tree shape up to 9 chunks (an odd node carried up once, twice,
at several levels), 16 and 17 chunks, last chunks of one word, one block plus a word, and 63 words, and
trees of two and three programs (a program folds 128 chunks, `_node_kernel` the rest).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SIZES = [1028, 2048, 2052, 3072, 4096 + 64 + 4, 5120, 6144 + 252, 7168, 8192, 9216 - 4, 16 * 1024, 17 * 1024 + 512,
         129 * 1024 + 4, 256 * 1024 + 8]  # two programs and a node launch; three programs

CHILD = """
import json, sys, torch
from blake3 import blake3
from lucifer_shard.runtime_shim.load import device_blake3 as b3
g = torch.Generator().manual_seed(41)
out = {"self_check": b3.self_check(torch.device("cpu")), "sizes": {}}
for n in json.loads(sys.argv[1]):
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    out["sizes"][n] = [b3.hexdigest(b3.digest_words(t)), blake3(t.numpy().tobytes()).hexdigest()]
# a tensor of another dtype is hashed by its bytes, as the rank file stores them
t = torch.randn(3, 700, generator=g).to(torch.bfloat16)
out["bf16"] = [b3.hexdigest(b3.digest_words(t)), blake3(t.view(torch.uint8).numpy().tobytes()).hexdigest()]
print(json.dumps(out))
"""


def _interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SIZES)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _interpreted()


def test_every_tree_shape_hashes_as_the_blake3_package(interpreted):
    wrong = {n: pair for n, pair in interpreted["sizes"].items() if pair[0] != pair[1]}
    assert len(interpreted["sizes"]) == len(SIZES) and not wrong, wrong


def test_a_tensor_is_hashed_by_its_stored_bytes(interpreted):
    got, want = interpreted["bf16"]
    assert got == want


def test_the_self_check_passes_where_the_kernels_are_right(interpreted):
    assert interpreted["self_check"] is None


@pytest.mark.parametrize(("nbytes", "address", "fits"), [
    (1025 * 4, 256, True), (1028, 4, True),  # more than one chunk, whole words, word-aligned
    (1024, 256, False),  # one chunk: the root is a chunk, left to the host
    (2050, 256, False), (4096, 2, False),  # a part of a word, a misaligned address
])
def test_the_kernels_take_whole_words_of_more_than_one_chunk(nbytes, address, fits):
    from lucifer_shard.runtime_shim.load import device_blake3 as b3

    assert b3.fits(nbytes, address) is fits
