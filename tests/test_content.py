"""The source content fingerprint: blocked BLAKE3 from reads in any order, recorded by convert at no
extra read, equal to an independent computation from the shards, and checked by diff."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from blake3 import blake3
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import run, Source
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.source.content import BLOCK, ContentDigests, TensorDigest, checkpoint_digest, shard_digests


def reference_digest(data: bytes) -> str:
    """The definition, written out: BLAKE3 over the length and the BLAKE3 of each 1 MiB block."""
    h = blake3(len(data).to_bytes(8, "little"))
    for i in range(0, len(data), BLOCK):
        h.update(blake3(data[i:i + BLOCK]).digest())
    return h.hexdigest()


@pytest.mark.parametrize("n", [0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 12345])
def test_any_read_order_gives_the_definition(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    rng = random.Random(n)
    for _ in range(5):
        cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(8)))})
        pieces = list(zip(cuts, cuts[1:]))
        rng.shuffle(pieces)
        d = TensorDigest(n)
        for a, b in pieces:
            d.feed(a, data[a:b])
        assert d.done and d.hexdigest() == reference_digest(data.tobytes())


def test_completion_is_reported_once_and_overlaps_are_refused():
    data = np.arange(2 * BLOCK + 10, dtype=np.uint64).view(np.uint8)[: 2 * BLOCK + 10]
    c = ContentDigests({"a": len(data), "empty": 0})
    c.feed("a", 5, data[5:BLOCK + 7])
    assert c.completed() == ["empty"]
    c.feed("a", BLOCK + 7, data[BLOCK + 7:])
    assert c.completed() == [] and c.finished() == {"empty": reference_digest(b"")}
    c.feed("a", 0, data[:5])
    assert c.completed() == ["a"] and c.finished()["a"] == reference_digest(data.tobytes())
    d = TensorDigest(100)
    d.feed(0, data[:60])
    with pytest.raises(ValueError, match="read twice"):
        d.feed(50, data[50:100])
    with pytest.raises(ValueError, match="fed to a tensor of 100"):
        TensorDigest(100).feed(90, data[:20])


def test_convert_records_the_content_of_every_converted_tensor(converted, tiny_pattern):
    out = converted()
    content = json.loads((out / MANIFEST_NAME).read_text())["source"]["content"]
    src = Source(tiny_pattern)
    digests = {k: reference_digest(src.get(k).tobytes()) for k in src.map}
    shards = shard_digests(digests, src.map)
    assert content["files"] == shards and content["digest"] == checkpoint_digest(shards)
    assert content["tensors"] == len(src.map) and content["block_bytes"] == BLOCK
    # --no-mtp drops the mtp.* tensors: the content covers exactly the converted ones
    no_mtp = json.loads((converted(mtp=False) / MANIFEST_NAME).read_text())["source"]["content"]
    kept = {k: v for k, v in digests.items() if not k.startswith("mtp.")}
    assert no_mtp["files"] == shard_digests(kept, src.map) and no_mtp["tensors"] == len(kept)


def test_the_content_is_the_same_for_every_layout_and_tp(converted):
    digests = {json.loads((converted(**kw) / MANIFEST_NAME).read_text())["source"]["content"]["digest"]
               for kw in ({}, {"tp": 2}, {"arch": "sm90", "flashinfer_layout": "legacy"}, {"expert_layout": "model"})}
    assert len(digests) == 1


def test_diff_without_model_and_against_another_checkpoint(converted, tiny_pattern, tiny_random):
    """`diff OUT` uses the recorded source; a checkpoint of the same headers but other bytes stops diff with
    one line naming the shard, or with --keep-going is reported and compared."""
    out = converted()
    r = run("diff", out)
    assert r.exit_code == 0 and "(the source the manifest records)" in r.output, r.output
    assert "source content      blake3:" in r.output and "equal to the converted checkpoint's" in r.output
    r = run("diff", out, tiny_random)
    assert r.exit_code == 1
    (line,) = r.output.splitlines()
    assert line.startswith("error: diff: model-0000") and "its content differs from the shard converted" in line
    assert f"MODEL is not the checkpoint {out} was converted from ({tiny_pattern})" in line
    r = run("diff", out, tiny_random, "--keep-going", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["result"]["fingerprint_ok"]
    content = doc["result"]["content"]
    assert content["differs"] and content["shards_checked"] == content["shards"]
    assert {p["kind"] for p in doc["result"]["problems"]} >= {"data"}


def test_diff_names_what_differs_in_the_fingerprint(converted, tiny_pattern, tmp_path):
    """The same tensors re-saved with other metadata: another header, another size; diff stops at once."""
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_pattern.iterdir():
        (model / f.name).symlink_to(f)
    shard = sorted(model.glob("*.safetensors"))[1]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    shard.unlink()
    save_file(tensors, str(shard), metadata={"format": "pt", "saved_by": "someone else"})
    r = run("diff", converted(), model)
    assert r.exit_code == 1 and r.output.count("\n") == 1
    assert f"shard {shard.name} has " in r.output and "the converted one had" in r.output, r.output


def test_resume_keeps_the_content_digests(tiny_pattern, tmp_path, converted):
    """A conversion finished by --resume records the same content as one run straight through."""
    from lucifer_shard.engine.convert import convert
    from lucifer_shard.engine.owned import JOURNAL
    from lucifer_shard.model.options import Options
    from lucifer_shard.outnames import STATE_DIR

    options = Options(tp=3, max_file_bytes=1 << 20)
    out = tmp_path / "out"
    convert(str(tiny_pattern), out, options, progress=False)
    journal = out / STATE_DIR / JOURNAL
    lines = journal.read_text().splitlines()
    keep = len(lines) // 2 // 3 * 3  # whole parts (3 ranks each)
    journal.write_text("\n".join(lines[:keep]) + "\n")
    (out / "COMPLETE").unlink()
    (out / MANIFEST_NAME).unlink()
    summary = convert(str(tiny_pattern), out, options, resume=True, progress=False)
    assert summary.files_resumed == keep and summary.files_written == len(lines) - keep
    got = json.loads((out / MANIFEST_NAME).read_text())["source"]["content"]
    want = json.loads((converted(max_file_bytes=1 << 20) / MANIFEST_NAME).read_text())["source"]["content"]
    assert got == want
