"""diff: passes on every converted layout and TP size, and catches and locates every kind of tampering."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import run
from lucifer_shard.errors import MismatchError
from lucifer_shard.formats.stheader import read_header
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.proof.diff import diff
from lucifer_shard.proof.verify import verify

CASES = {
    "sm120": dict(arch="sm120"),
    "sm90-folded": dict(arch="sm90", flashinfer_layout="folded"),
    "sm90-legacy": dict(arch="sm90", flashinfer_layout="legacy"),
    "model": dict(expert_layout="model"),
    "tp2": dict(tp=2),
    "tp4": dict(tp=4),
}
W2 = "model.layers.3.ffn.experts.routed_experts.w2_weight"
W2S = "model.layers.3.ffn.experts.routed_experts.w2_weight_scale"
W13S = "model.layers.3.ffn.experts.routed_experts.w13_weight_scale"
PART = "target/rank-{}/part-00000.safetensors"


def copy_out(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return dst


def tensor_start(path: Path, name: str) -> tuple[int, list[int]]:
    """Absolute file offset of a tensor's first byte, and its stored shape."""
    header = read_header(path)
    t = header.tensors[name]
    return header.data_start + t.start, list(t.shape)


def flip(path: Path, offset: int, xor: int = 0x5A) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ xor]))


def named(report, tensor: str, rank: int | None = None, kind: str | None = None) -> list:
    return [p for p in report.problems if p.tensor == tensor and (rank is None or p.rank == rank)
            and (kind is None or p.kind == kind)]


# ---------------------------------------------------------------- passes


@pytest.mark.parametrize("case", list(CASES))
def test_diff_passes(converted, tiny_pattern, case):
    out = converted(**CASES[case])
    report = diff(out, str(tiny_pattern), progress=False)
    assert report.ok, report.problem_lines()
    s = report.stats
    assert s["source_tensors"] == s["source_total"] and s["dropped"] == 0
    tp = json.loads((out / MANIFEST_NAME).read_text())["tp_size"]
    assert s["rank_tensors"] == tp * (134 + 39)
    assert s["source_bytes"] == sum(  # every source byte compared once ...
        f.stat().st_size - read_header(f).data_start for f in tiny_pattern.glob("*.safetensors"))
    assert s["source_bytes_read"] < 1.01 * s["source_bytes"]  # ... and read about once


def test_diff_passes_in_small_chunks(converted, tiny_pattern):
    """Row blocks and expert groups much smaller than the tensors: chunk seams are handled."""
    report = diff(converted(arch="sm90", flashinfer_layout="folded"), str(tiny_pattern), progress=False,
                  chunk_bytes=3000)
    assert report.ok, report.problem_lines()
    assert report.stats["source_bytes"] == sum(  # every source byte compared exactly once
        f.stat().st_size - read_header(f).data_start for f in tiny_pattern.glob("*.safetensors"))


def test_diff_and_verify_pass_on_multi_part_files(converted, tiny_pattern):
    out = converted(max_file_bytes=2 << 20)
    assert len(list((out / "target" / "rank-0").glob("*.safetensors"))) > 3
    report = diff(out, str(tiny_pattern), progress=False)
    assert report.ok, report.problem_lines()
    assert verify(out, progress=False).ok


def test_diff_passes_without_mtp_and_accounts_for_dropped(converted, tiny_pattern):
    out = converted(mtp=False)
    report = diff(out, str(tiny_pattern), progress=False)
    assert report.ok, report.problem_lines()
    assert report.stats["dropped"] > 0
    assert report.stats["source_tensors"] + report.stats["dropped"] == report.stats["source_total"]


def test_cli_diff_ok_summary_and_json(converted, tiny_pattern):
    out = converted()
    r = run("diff", str(out), str(tiny_pattern))
    assert r.exit_code == 0, r.output
    assert "OK: every rank tensor" in r.output and "GiB/s source + rank bytes" in r.output
    r = run("diff", "--quiet", str(out), str(tiny_pattern))
    assert r.exit_code == 0 and r.output == ""  # -q: the exit code is the answer
    r = run("diff", "--quiet", "--json", str(out), str(tiny_pattern))
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["command"] == "diff" and doc["error"] is None
    assert doc["result"]["problem_count"] == 0 and doc["result"]["summary"]["rank_tensors"] == 3 * 173
    assert doc["result"]["content"]["digest"] == json.loads((out / MANIFEST_NAME).read_text())["source"]["content"][
        "digest"]


# ---------------------------------------------------------------- tampering


@pytest.mark.parametrize("case", ["sm120", "sm90-folded"])
def test_flipped_w2_byte_is_located_in_the_source(converted, tiny_pattern, tmp_path, case):
    out = copy_out(converted(**CASES[case]), tmp_path)
    path = out / PART.format(1)
    start, shape = tensor_start(path, W2)
    e, row, col = 5, 17, 100  # stored coordinates; rank 1 holds source bytes [352, 704) in [0, 352)
    per_expert = shape[1] * shape[2]
    offset = start + e * per_expert + row * shape[2] + col
    flip(path, offset)
    report = diff(out, str(tiny_pattern), progress=False)
    assert not report.ok
    hits = named(report, W2, 1, "data")
    assert hits and {p.tensor for p in report.problems} == {W2}
    assert all(p.detail["source"] == "layers.3.ffn.experts.5.w2.weight" for p in hits)
    assert any(offset in p.detail["file_offset"] for p in hits)
    if case == "sm120":  # w2 bytes are unchanged by the sm120 layout: one element, exact index
        assert len(hits) == 1 and report.count == 1
        assert hits[0].detail["source_index"] == [17, 452]
        assert hits[0].detail["tensor_index"] == [5, 17, 100]
        assert hits[0].detail["file_offset"] == [offset]
        assert "layers.3.ffn.experts.5.w2.weight[17, 452]" in hits[0].message
    else:  # the nibble interleave spreads one stored byte over rows r and r+8 of the same partition
        rows = {p.detail["source_index"][0] for p in hits}
        assert rows <= {16, 17, 24, 25, 8, 9} and all(352 <= p.detail["source_index"][1] < 704 for p in hits)
    r = run("diff", str(out), str(tiny_pattern))
    assert r.exit_code == 1 and W2 in r.output and "error: diff:" in r.output
    assert "layers.3.ffn.experts.5.w2.weight[" in r.output and f"byte offset {offset}" in r.output or case != "sm120"
    doc = json.loads(run("diff", "--quiet", "--json", str(out), str(tiny_pattern)).stdout)
    assert not doc["ok"] and doc["error"]["exit_code"] == 1 and doc["result"]["problems"][0]["tensor"] == W2


def test_nonzero_byte_in_zero_tail(converted, tiny_pattern, tmp_path):
    out = copy_out(converted(), tmp_path)
    path = out / PART.format(0)
    start, shape = tensor_start(path, W2)
    offset = start + 2 * shape[1] * shape[2] + 3 * shape[2] + 360  # expert 2, row 3, byte 360: tail [352, 384)
    flip(path, offset, 0x01)
    report = diff(out, str(tiny_pattern), progress=False)
    assert not report.ok and report.count == 1
    (p,) = report.problems
    assert (p.kind, p.tensor, p.rank) == ("pad", W2, 0)
    assert p.detail["region"] == [1, 352, 384] and p.detail["tensor_index"] == [2, 3, 360]
    assert p.detail["file_offset"] == [offset] and p.detail["found"] == "0x01"


def test_neg_inf_tail_of_attn_sink(converted, tiny_pattern, tmp_path):
    out = copy_out(converted(), tmp_path)
    name = "model.layers.2.attn.attn_sink"
    path = out / PART.format(2)
    start, shape = tensor_start(path, name)
    assert shape == [24]  # rank 2 holds heads 48..63 then 8 -inf pads
    flip(path, start + 4 * 20 + 3, 0xFF)  # high byte of pad element 20
    report = diff(out, str(tiny_pattern), progress=False)
    (p,) = report.problems
    assert (p.kind, p.tensor, p.rank, p.detail["region"]) == ("pad", name, 2, [0, 16, 24])
    assert p.detail["tensor_index"] == [20] and p.detail["expected"] == "0xff"


def test_swapped_rank_files(converted, tiny_pattern, tmp_path):
    out = copy_out(converted(), tmp_path)
    a, b = out / PART.format(1), out / PART.format(2)
    tmp = out / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    report = diff(out, str(tiny_pattern), progress=False)
    assert not report.ok
    assert any("lucifer.rank" in p.message for p in report.problems)
    for rank in (1, 2):
        assert f"target rank-{rank} {W2}" in report.by_tensor
        assert f"target rank-{rank} model.embed_tokens.weight" in report.by_tensor
    assert not any("norm.weight" in k for k in report.by_tensor)  # replicated tensors are equal anyway


def test_file_from_another_conversion(converted, tiny_pattern, tmp_path):
    out = copy_out(converted(), tmp_path)
    other = converted(arch="sm90", flashinfer_layout="folded")
    shutil.copyfile(other / PART.format(1), out / PART.format(1))
    report = diff(out, str(tiny_pattern), max_mismatches=30, progress=False)
    assert not report.ok
    assert any("lucifer.conversion_id" in p.message and "another conversion" in p.message for p in report.problems)
    assert named(report, W13S, 1, "header")  # folded scale shape is not the sm120 shape
    assert f"target rank-1 {W2}" in report.by_tensor  # same shape, interleaved bytes: caught by content


def test_truncated_rank_file(converted, tiny_pattern, tmp_path):
    out = copy_out(converted(), tmp_path)
    path = out / PART.format(2)
    last = list(read_header(path).tensors)[-1]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    report = diff(out, str(tiny_pattern), progress=False)
    # one file, one finding (issue 53): its size, not one more per tensor it cuts off
    (p,) = report.problems
    assert report.count == 1 and "the manifest records" in p.message and "truncated" in p.message, p
    assert p.rank == 2 and p.file == PART.format(2) and not named(report, last, 2, "file")


def test_manifest_edited_by_hand(converted, tiny_pattern, tmp_path):
    """Moving rank 1's w2 slice to the stock offset 384 in the manifest is caught and named."""
    out = copy_out(converted(), tmp_path)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    doc["roles"]["target"]["ranks"][1]["tensors"][W2]["sources"][0]["src_start"] = 384
    (out / MANIFEST_NAME).write_text(json.dumps(doc, indent=1, sort_keys=True))
    report = diff(out, str(tiny_pattern), progress=False)
    assert not report.ok
    assert any("manifest_digest" in p.message for p in report.problems)
    assert named(report, W2, 1, "manifest")
    r = run("diff", str(out), str(tiny_pattern))
    assert r.exit_code == 1 and W2 in r.output


def test_missing_rank_folder(converted, tiny_pattern, tmp_path):
    out = copy_out(converted(), tmp_path)
    shutil.rmtree(out / "target" / "rank-2")
    report = diff(out, str(tiny_pattern), progress=False)
    assert not report.ok
    assert any("rank folder target/rank-2 is missing" in p.message for p in report.problems)
    r = run("diff", "--quiet", str(out), str(tiny_pattern))
    assert r.exit_code == 1 and "target/rank-2" in r.output


def test_wrong_source_checkpoint(converted, tiny_random):
    """Same schema and headers, other bytes: the fingerprint (config, headers, sizes) is equal, the content
    digests are not; diff stops at the first shard read in full, or with --keep-going reports it and goes on."""
    with pytest.raises(MismatchError, match=r"diff: model-\d+-of-\d+\.safetensors: its content differs from the "
                                            r"shard converted .*--keep-going"):
        diff(converted(), str(tiny_random), progress=False)
    report = diff(converted(), str(tiny_random), max_mismatches=8, progress=False, keep_going=True)
    assert report.info["fingerprint_ok"] and len(report.info["content"]["differs"]) == 5
    assert [p.kind for p in report.problems] == ["source"] * 5 + ["data"] * 3  # the explanation first
    data = report.problems[5]
    assert data.tensor == "lm_head.weight" and data.detail["source"] == "head.weight"


def test_source_fingerprint_must_match(converted, tiny_pattern, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_pattern.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    (model / "config.json").write_text((tiny_pattern / "config.json").read_text() + "\n")
    with pytest.raises(MismatchError, match="its config.json differs from the one converted"):
        diff(converted(), str(model), progress=False)
    report = diff(converted(), str(model), progress=False, keep_going=True)
    kinds = sorted(p.kind for p in report.problems)
    assert kinds == ["file", "source"], report.problem_lines()
    assert "fingerprint" in named_kind(report, "source").message
    assert "config.json" in named_kind(report, "file").message
    assert report.info["content"]["digest"] and not report.info["content"]["differs"]  # same tensors


def named_kind(report, kind: str):
    return next(p for p in report.problems if p.kind == kind)


def test_not_an_output_is_trouble_exit_2(tiny_pattern, tmp_path):
    r = run("diff", "--quiet", str(tmp_path), str(tiny_pattern))
    assert r.exit_code == 2 and "lucifer-manifest.json: missing" in r.output


# ---------------------------------------------------------------- the bug the project exists for


def _stock_slice(src: np.ndarray, rank: int, width: int) -> np.ndarray:
    """vLLM's stock loader: start = rank * param width in the wrong units, narrowed to the source, zero padded."""
    out = np.zeros((src.shape[0], width), np.uint8)
    lo = rank * width
    hi = min(lo + width, src.shape[1])
    if hi > lo:
        out[:, : hi - lo] = src[:, lo:hi]
    return out


def test_stock_vllm_slicing_is_rejected(converted, tiny_pattern, tmp_path):
    """Rank files whose W2 bytes start at 0/384/768 and scale groups at 0/24/48 (instead of 0/352/704
    and 0/22/44), everything else intact and the file metadata carried over: only the bytes are wrong."""
    out = copy_out(converted(expert_layout="model"), tmp_path)
    index = json.loads((tiny_pattern / "model.safetensors.index.json").read_text())["weight_map"]

    def source(key: str) -> np.ndarray:
        with safe_open(str(tiny_pattern / index[key]), "pt") as f:
            return f.get_tensor(key).view(torch.uint8).numpy()

    for rank in range(3):
        path = out / PART.format(rank)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for name in list(tensors):
            if not name.endswith(("w2_weight", "w2_weight_scale")):
                continue
            layer = name.split(".")[2]
            kind = "weight" if name.endswith("w2_weight") else "scale"
            width = tensors[name].shape[2]  # 384 bytes / 24 groups
            assert width == (384 if kind == "weight" else 24)
            stacked = np.stack([_stock_slice(source(f"layers.{layer}.ffn.experts.{e}.w2.{kind}"), rank, width)
                                for e in range(tensors[name].shape[0])])
            tensors[name] = torch.from_numpy(stacked)
        save_file(tensors, str(path), metadata=meta)
    report = diff(out, str(tiny_pattern), max_mismatches=50, progress=False)
    assert not report.ok
    for rank in (1, 2):
        assert f"target rank-{rank} {W2}" in report.by_tensor
        assert f"target rank-{rank} {W2S}" in report.by_tensor
    assert f"target rank-0 {W2}" in report.by_tensor  # stock rank 0 fills our pad [352, 384) with source bytes
    # the files safetensors rewrote have other sizes than recorded: diff says so as verify does (issue 52 P)
    sized = {p.file for p in report.problems if p.kind == "file" and "the manifest records" in p.message}
    assert all(k.endswith(("w2_weight", "w2_weight_scale")) or k in sized for k in report.by_tensor), report.by_tensor
    first = next(p for p in report.problems if p.kind == "data" and p.rank == 1 and p.tensor.endswith("w2_weight"))
    assert first.detail["source"].endswith("w2.weight") and first.detail["source_index"][1] >= 352
    assert first.detail["tensor_index"][2] + 352 == first.detail["source_index"][1]
    r = run("diff", "--quiet", str(out), str(tiny_pattern))
    assert r.exit_code == 1 and "bytes, the manifest records" in r.output.split("error:")[1]  # the sizes come first


def test_an_edited_source_file_size_is_a_finding_of_diff(converted, tiny_pattern, tmp_path):
    """Issue 52 V: source.files (the shard sizes inspect prints) can be derived only from MODEL, so diff
    compares them; on main a re-sealed size passed."""
    from lucifer_shard.output.manifest import manifest_text

    out = copy_out(converted(), tmp_path)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    shard = sorted(doc["source"]["files"])[0]
    doc["source"]["files"][shard] += 1
    (out / MANIFEST_NAME).write_text(manifest_text({k: v for k, v in doc.items() if k != "manifest_digest"}))
    report = diff(out, str(tiny_pattern), progress=False)
    assert [p.message for p in report.problems] == [
        f"source.files: shard {shard} has {doc['source']['files'][shard] - 1:,} bytes, the converted one had "
        f"{doc['source']['files'][shard]:,}; the manifest was edited"]


def test_61h_a_resealed_file_digest_is_a_finding_naming_the_file(converted, tiny_pattern, tmp_path):
    """Issue 61 H: the bytes equal the source's, but the manifest records another file digest (re-sealed):
    before the fix diff said OK (exit 0) while verify, stage and fetch refused it."""
    from test_output_check import edited  # its edit-and-re-seal (the self-digest is public)

    rel = "target/rank-0/part-00000.safetensors"

    def edit(doc: dict) -> None:
        f = doc["roles"]["target"]["ranks"][0]["files"][0]
        assert f["path"] == rel
        f["digest"] = "blake3:" + "1" * 64

    bad = edited(converted(), tmp_path / "out", edit)
    r = run("diff", bad, tiny_pattern)
    assert r.exit_code == 1 and "OK" not in r.stdout, r.output
    assert f"{rel}: file digest " in r.output and "differs from the manifest's 1111111111111111..." in r.output
    assert run("diff", converted(), tiny_pattern).exit_code == 0  # the same bytes, the recorded digest: OK
