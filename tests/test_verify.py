"""verify (no source) passes on every converted output and catches tampering; inspect summarizes."""
from __future__ import annotations

import json
import shutil

import pytest

from lucifer_shard.formats.dtypes import DTYPE_SIZE
from lucifer_shard.formats.stheader import read_header
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import COMPLETE_NAME
from lucifer_shard.proof.verify import verify

from helpers import run
from test_diff import CASES, PART, W2, copy_out, flip, named, tensor_start


@pytest.mark.parametrize("case", list(CASES))
def test_verify_passes(converted, case):
    report = verify(converted(**CASES[case]), progress=False)
    assert report.ok, report.problem_lines()
    assert report.stats["pad_bytes_checked"] > 0


def test_verify_passes_in_small_chunks_and_without_mtp(converted):
    assert verify(converted(arch="sm90", flashinfer_layout="legacy"), progress=False, chunk_bytes=3000).ok
    assert verify(converted(mtp=False), progress=False).ok


def test_cli_verify_ok_and_json(converted):
    out = converted()
    r = run("verify", str(out))
    assert r.exit_code == 0 and "OK: manifest, files, digests" in r.output, r.output
    doc = json.loads(run("verify", "--quiet", "--json", str(out)).stdout)
    assert doc["ok"] and doc["command"] == "verify"
    assert doc["result"]["summary"]["files"] == 6 and doc["result"]["summary"]["tensors"] == 3 * 173


def test_flipped_byte(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    path = out / PART.format(1)
    start, shape = tensor_start(path, W2)
    flip(path, start + 5 * shape[1] * shape[2] + 17 * shape[2] + 100)
    report = verify(out, progress=False)
    assert named(report, W2, 1, "data") and "digest" in named(report, W2, 1)[0].message
    assert any(p.kind == "file" and "file digest" in p.message for p in report.problems)
    assert {p.tensor for p in report.problems} == {W2, None}
    r = run("verify", "--quiet", str(out))
    assert r.exit_code == 1 and W2 in r.output.split("error:")[1]


def test_nonzero_byte_in_zero_tail(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    path = out / PART.format(0)
    start, shape = tensor_start(path, W2)
    offset = start + 2 * shape[1] * shape[2] + 3 * shape[2] + 360
    flip(path, offset, 0x01)
    report = verify(out, progress=False)
    (pad,) = named(report, W2, 0, "pad")
    assert pad.detail["region"] == [1, 352, 384] and pad.detail["file_offset"] == [offset]


def test_nonzero_byte_in_swizzled_scale_tail(converted, tmp_path):
    """Zero regions are checked after the inverse layout: the swizzled byte is found and located."""
    name = "model.layers.3.ffn.experts.routed_experts.w2_weight_scale"
    out = copy_out(converted(), tmp_path)
    path = out / PART.format(2)
    start, shape = tensor_start(path, name)
    # model index (e, 5, 22) is in the tail [22, 24) of rank 2... rank 2 holds 20 groups: tail [20, 24)
    m, k = 5, 22
    pos = (m // 128) * 128 * shape[2] + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    offset = start + 1 * shape[1] * shape[2] + pos
    flip(path, offset, 0x01)
    report = verify(out, progress=False)
    (pad,) = named(report, name, 2, "pad")
    assert pad.detail["region"] == [1, 20, 24] and pad.detail["tensor_index"] == [1, 5, 22]
    assert pad.detail["file_offset"] == [offset]


def test_e8m0_nan_scale(converted, tmp_path):
    name = "model.layers.0.attn.wq_b.weight_scale_inv"
    out = copy_out(converted(), tmp_path)
    path = out / PART.format(0)
    start, _ = tensor_start(path, name)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff")
    report = verify(out, progress=False)
    (p,) = named(report, name, 0, "scale")
    assert p.detail["tensor_index"] == [0, 0] and p.detail["file_offset"] == [start]


def test_replicated_tensor_differs_between_ranks(converted, tmp_path):
    name = "model.norm.weight"
    out = copy_out(converted(), tmp_path)
    start, _ = tensor_start(out / PART.format(1), name)
    flip(out / PART.format(1), start + 7)
    report = verify(out, progress=False)
    assert named(report, name, 1, "data") and named(report, name, 1, "replica")


def test_swapped_rank_files(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    a, b = out / PART.format(1), out / PART.format(2)
    tmp = out / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    report = verify(out, max_problems=1000, progress=False)
    assert any("lucifer.rank is '2', expected '1'" in p.message for p in report.problems)
    assert named(report, W2, 1, "data") and named(report, W2, 2, "data")
    assert not named(report, "model.norm.weight")


def test_file_from_another_conversion(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    shutil.copyfile(converted(tp=3, arch="sm90", flashinfer_layout="folded") / PART.format(1), out / PART.format(1))
    report = verify(out, max_problems=1000, progress=False)
    assert any("another conversion" in p.message for p in report.problems)
    assert named(report, W2, 1, "data")  # digest of the interleaved bytes
    assert named(report, W2 + "_scale", 1, "header")


def test_truncated_rank_file(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    path = out / PART.format(2)
    last = list(read_header(path).tensors)[-1]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    report = verify(out, progress=False)
    # one file, one finding (issue 53): its size, not one more per tensor it cuts off
    (p,) = report.problems
    assert report.count == 1 and "the manifest records" in p.message and "truncated" in p.message, p
    assert p.rank == 2 and p.file == PART.format(2) and not named(report, last, 2, "file")


def test_manifest_edited_by_hand(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    doc["roles"]["target"]["ranks"][1]["tensors"][W2]["zero_regions"] = []
    (out / MANIFEST_NAME).write_text(json.dumps(doc, indent=1, sort_keys=True))
    report = verify(out, progress=False)
    assert any("manifest_digest" in p.message for p in report.problems)
    (p,) = named(report, W2, 1, "manifest")
    assert "zero_regions" in p.message
    r = run("verify", "--quiet", str(out))
    assert r.exit_code == 1 and "manifest_digest" in r.output


def test_missing_rank_folder(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    shutil.rmtree(out / "draft" / "rank-1")
    report = verify(out, progress=False)
    (p,) = report.problems
    assert "rank folder draft/rank-1 is missing" in p.message and p.rank == 1 and p.role == "draft"
    assert run("verify", "--quiet", str(out)).exit_code == 1


def test_stray_files_and_complete_marker(converted, tmp_path):
    out = copy_out(converted(), tmp_path)
    (out / "target" / "rank-0" / "part-00001.safetensors").write_bytes(b"junk")
    (out / "target" / "rank-3").mkdir()
    (out / COMPLETE_NAME).write_text("0" * 64 + "\n")
    report = verify(out, progress=False)
    messages = " | ".join(p.message for p in report.problems)
    assert "target/rank-0/part-00001.safetensors: unexpected file" in messages
    assert "target/rank-3: unexpected entry" in messages
    assert "COMPLETE holds" in messages
    (out / COMPLETE_NAME).unlink()
    assert any("no COMPLETE" in p.message for p in verify(out, progress=False).problems)


def test_not_an_output(tmp_path):
    r = run("verify", "--quiet", str(tmp_path))
    assert r.exit_code == 2 and "error:" in r.output


# ---------------------------------------------------------------- inspect


def test_inspect(converted):
    out = converted()
    r = run("inspect", str(out))
    assert r.exit_code == 0, r.output
    for text in ("fingerprint", "FLASHINFER_CUTLASS_MXFP4_MXFP8", "swap_halves+swizzle_128x4", "routed", "2112",
                 "target", "draft", "complete, manifest digest ok"):
        assert text in r.output
    doc = json.loads(run("inspect", "--json", str(out)).stdout)["result"]
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert doc["tp_size"] == 3 and doc["complete"] and doc["manifest_digest_ok"]
    for role in ("target", "draft"):
        for r, entry in enumerate(manifest["roles"][role]["ranks"]):
            got = doc["roles"][role][r]
            assert got["bytes"] == sum((out / f["path"]).stat().st_size for f in entry["files"])
            real = 0  # bytes that hold source data, counted from the pieces
            for info in entry["tensors"].values():
                item = DTYPE_SIZE[info["dtype"]]
                matrix = info["model_shape"][1:] if info["experts"] else info["model_shape"]
                for p in info["sources"]:
                    n = item * p["length"] * (info["experts"] or 1)
                    for d, size in enumerate(matrix):
                        n *= size if d != p["dim"] else 1
                    real += n
            assert got["padding_bytes"] == got["tensor_bytes"] - real
    assert doc["roles"]["target"][2]["padding_bytes"] > doc["roles"]["target"][0]["padding_bytes"]


@pytest.mark.parametrize("case", ["sm90-folded", "sm90-legacy"])
def test_pad_bit_in_interleaved_w2_is_located(converted, tiny_pattern, tmp_path, case):
    """sm90: one bit set in the stored bytes of rank 0's w2 tail partition (model bytes [352, 384) of every
    row) is found through the stored-layout pad mask, and located in model layout by verify and diff."""
    import numpy as np

    from lucifer_shard.model.layouts import layout_by_name
    from lucifer_shard.proof.diff import diff

    out = copy_out(converted(**CASES[case]), tmp_path)
    path = out / PART.format(0)
    start, shape = tensor_start(path, W2)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    layout = layout_by_name(manifest["roles"]["target"]["ranks"][0]["tensors"][W2]["layout"])
    e, row, col = 6, 21, 357
    offset = start + e * shape[1] * shape[2] + row * shape[2] + col
    flip(path, offset, 0x10)
    probe = np.zeros((1, shape[1], shape[2]), np.uint8)
    probe[0, row, col] = 0x10
    want = [e, *(int(i) for i in np.argwhere(layout.inverse(probe)[0])[0])]
    assert 352 <= want[2] < 384
    for report in (verify(out, progress=False), diff(out, str(tiny_pattern), progress=False)):
        (pad,) = named(report, W2, 0, "pad")
        assert pad.detail["tensor_index"] == want and offset in pad.detail["file_offset"]


def test_structurally_broken_manifest_is_one_error_line(converted, tiny_pattern, tmp_path):
    out = copy_out(converted(), tmp_path)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    doc["roles"]["target"]["ranks"][1] = "garbage"
    (out / MANIFEST_NAME).write_text(json.dumps(doc))
    for args in (("verify", str(out)), ("diff", str(out), str(tiny_pattern))):
        r = run(args[0], "--quiet", *args[1:])
        assert r.exit_code in (1, 2) and "error:" in r.output and "Traceback" not in r.output, r.output


def test_a_deleted_file_is_not_counted_among_the_files_checked(converted, tmp_path):
    """Issue 64: verify counted a deleted rank file among "files checked" (the manifest's count, not its own)."""
    out = copy_out(converted(), tmp_path)
    whole = verify(out).stats["files"]
    next(out.glob("target/rank-1/*.safetensors")).unlink()
    report = verify(out)
    assert not report.ok and report.stats["files"] == whole - 1
