"""convert: every rank tensor holds exactly its source bytes, pads are pad, output is deterministic."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from helpers import Source, cli_argv, rank_tensors
from lucifer_shard.formats.dtypes import DTYPE_SIZE
from lucifer_shard.model.layouts import layout_by_name

LAYOUTS = {
    "sm120": dict(arch="sm120"),
    "sm100": dict(arch="sm100"),
    "sm90-folded": dict(arch="sm90", flashinfer_layout="folded"),
    "sm90-legacy": dict(arch="sm90", flashinfer_layout="legacy"),
    "model": dict(expert_layout="model"),
}
W2 = "model.layers.3.ffn.experts.routed_experts.w2_weight"
W2S = "model.layers.3.ffn.experts.routed_experts.w2_weight_scale"
W13 = "model.layers.3.ffn.experts.routed_experts.w13_weight"


def model_layout(info: dict, data: np.ndarray) -> np.ndarray:
    """A stored tensor's bytes back in model layout (inverse of its declared layout)."""
    shape = list(info["model_shape"])
    shape[-1] *= DTYPE_SIZE[info["dtype"]]
    if info["layout"] != "model":
        data = layout_by_name(info["layout"]).inverse(data.reshape(shape[0], *info["shape"][1:]))
    return data.reshape(shape)


def expected(info: dict, src: Source) -> np.ndarray:
    """Built independently of the engine: pad everywhere, then each piece's source region."""
    item = DTYPE_SIZE[info["dtype"]]
    shape = list(info["model_shape"])
    shape[-1] *= item
    pad = b"\x00\x00\x80\xff" if info["pad"] == "-inf" else b"\x00"
    out = np.frombuffer(pad * (int(np.prod(shape)) // len(pad)), np.uint8).reshape(shape).copy()
    experts = info["experts"] or 0
    for p in info["sources"]:
        for e in range(experts) if experts else [None]:
            key = p["key"].format(e=e) if e is not None else p["key"]
            s = src.get(key)
            if info["dtype"] == "I32":  # tid2eid narrowed from I64
                s = s.view(np.int64).astype(np.int32).view(np.uint8).reshape(*s.shape[:-1], -1)
            view = out[e] if e is not None else out
            scale = item if p["dim"] == view.ndim - 1 else 1
            sl = [slice(None)] * view.ndim
            ss = [slice(None)] * view.ndim
            sl[p["dim"]] = slice(p["dst_start"] * scale, (p["dst_start"] + p["length"]) * scale)
            ss[p["dim"]] = slice(p["src_start"] * scale, (p["src_start"] + p["length"]) * scale)
            view[tuple(sl)] = s[tuple(ss)]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_tensor_equals_its_source_bytes(converted, tiny_pattern, layout):
    out = converted(**LAYOUTS[layout])
    manifest = json.loads((out / "lucifer-manifest.json").read_text())
    src = Source(tiny_pattern)
    assert set(manifest["roles"]) == {"target", "draft"}
    for role, doc in manifest["roles"].items():
        for entry in doc["ranks"]:
            tensors = rank_tensors(out, role, entry["rank"])
            assert set(tensors) == set(entry["tensors"])
            for name, data in tensors.items():
                info = entry["tensors"][name]
                assert list(data.shape[:-1]) == info["shape"][:-1], name
                got = model_layout(info, data)
                assert np.array_equal(got, expected(info, src)), f"{role} rank {entry['rank']} {name}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_audit_w2_rank2_bytes(converted, tiny_pattern, layout):
    """W2 rank 2 holds source bytes [704, 1024) in [0, 320), then 64 zero bytes; scales 44..64 then 4 zero."""
    out = converted(**LAYOUTS[layout])
    manifest = json.loads((out / "lucifer-manifest.json").read_text())
    src = Source(tiny_pattern)
    for rank, (lo, hi) in enumerate([(0, 352), (352, 704), (704, 1024)]):
        info = manifest["roles"]["target"]["ranks"][rank]["tensors"]
        w2 = model_layout(info[W2], rank_tensors(out, "target", rank)[W2])
        w2s = model_layout(info[W2S], rank_tensors(out, "target", rank)[W2S])
        for e in (0, 7):
            n = hi - lo
            assert np.array_equal(w2[e][:, :n], src.get(f"layers.3.ffn.experts.{e}.w2.weight")[:, lo:hi])
            assert not w2[e][:, n:].any() and w2[e].shape[1] == 384
            g0, g1 = lo // 16, hi // 16
            assert np.array_equal(w2s[e][:, : g1 - g0], src.get(f"layers.3.ffn.experts.{e}.w2.scale")[:, g0:g1])
            assert not w2s[e][:, g1 - g0:].any() and w2s[e].shape[1] == 24


def test_kernel_layout_w13_is_swapped(converted, tiny_pattern):
    """sm120: rows [0, 768) hold w3 then pad, rows [768, 1536) hold w1 then pad."""
    out = converted(arch="sm120")
    src = Source(tiny_pattern)
    w13 = rank_tensors(out, "target", 2)[W13]
    assert w13.shape == (8, 1536, 128)
    assert np.array_equal(w13[5, :640], src.get("layers.3.ffn.experts.5.w3.weight")[1408:])
    assert np.array_equal(w13[5, 768:1408], src.get("layers.3.ffn.experts.5.w1.weight")[1408:])
    assert not w13[5, 640:768].any() and not w13[5, 1408:].any()


def test_sm90_scale_shapes(converted):
    out = converted(arch="sm90", flashinfer_layout="folded")
    info = json.loads((out / "lucifer-manifest.json").read_text())["roles"]["target"]["ranks"][0]["tensors"]
    assert info[W13 + "_scale"]["shape"] == [8, 24, 2, 16, 16]
    assert info[W2S]["shape"] == [8, 4, 6, 16, 16]
    legacy = converted(arch="sm90", flashinfer_layout="legacy")
    info = json.loads((legacy / "lucifer-manifest.json").read_text())["roles"]["target"]["ranks"][0]["tensors"]
    assert info[W13 + "_scale"]["shape"] == [8, 2, 6144] and info[W2S]["shape"] == [8, 6, 1024]


@pytest.mark.parametrize("tp", [2, 4])
def test_other_tp_sizes(converted, tiny_pattern, tp):
    out = converted(tp=tp)
    manifest = json.loads((out / "lucifer-manifest.json").read_text())
    src = Source(tiny_pattern)
    assert manifest["tp_size"] == tp
    for entry in manifest["roles"]["target"]["ranks"]:
        tensors = rank_tensors(out, "target", entry["rank"])
        for name in (W2, W2S, W13, "model.embed_tokens.weight", "model.layers.2.attn.wq_b.weight"):
            info = entry["tensors"][name]
            assert np.array_equal(model_layout(info, tensors[name]), expected(info, src)), name


def test_files_read_back_and_carry_identity(converted):
    out = converted()
    manifest = json.loads((out / "lucifer-manifest.json").read_text())
    for path in (out / "target").rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            assert meta["lucifer.conversion_id"] == manifest["conversion_id"]
            assert meta["lucifer.role"] == "target" and meta["lucifer.tp_size"] == "3"
            assert f"rank-{meta['lucifer.rank']}" == path.parent.name
    assert (out / "COMPLETE").read_text().strip() == manifest["conversion_id"]
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (Path(manifest["source"]["path"]) / name).read_bytes()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".lucifer" not in p.parts}


def test_conversion_is_byte_deterministic(tiny_pattern, tmp_path):
    from lucifer_shard.engine.convert import convert
    from lucifer_shard.model.options import Options

    a, b = tmp_path / "a", tmp_path / "b"
    convert(str(tiny_pattern), a, Options(tp=3), progress=False)
    convert(str(tiny_pattern), b, Options(tp=3), workers=3, progress=False)
    assert _tree(a) == _tree(b)


def test_sigkill_then_resume_equals_clean_run(tiny_pattern, tmp_path, converted):
    """Kill convert mid-way: no final-named file is incomplete; --resume then matches a clean run."""
    out = tmp_path / "killed"
    args = ["convert", "--tp", "3", "--arch", "sm120", "--quiet", "--max-file-size", "1M", str(tiny_pattern), str(out)]
    proc = subprocess.Popen(cli_argv(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = out / ".lucifer" / "journal.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and journal.read_text().count("\n") >= 6:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "conversion finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "COMPLETE").exists() and not (out / "lucifer-manifest.json").exists()
    for path in out.rglob("*.safetensors"):  # every final name is a whole, readable file
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    again = subprocess.run(cli_argv(*args), capture_output=True, text=True)
    assert again.returncode == 2 and "--resume" in again.stderr
    done = subprocess.run(cli_argv(*(a for a in args if a != "--quiet"), "--resume"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "kept from an earlier run" in done.stdout and not done.stdout.count(" 0 kept")
    clean = tmp_path / "clean"
    subprocess.run(cli_argv(*args[:-1], str(clean)), check=True, capture_output=True)
    assert _tree(out) == _tree(clean)


def test_align_4096_for_direct_io(converted, tiny_pattern):
    """--align 4096: the data section and every tensor whose size is a multiple of 4096 start on a
    4 KiB boundary; the files still read back and hold the same tensors."""
    from lucifer_shard.formats.stheader import read_header

    out = converted(align=4096)
    plain = converted()
    aligned = 0
    for path in sorted((out / "target").rglob("*.safetensors")):
        header = read_header(path)
        assert header.data_start % 4096 == 0
        for name, t in header.tensors.items():
            if (t.end - t.start) % 4096 == 0:
                assert (header.data_start + t.start) % 4096 == 0, name
                aligned += 1
    assert aligned > 40
    for rank in range(3):
        got, want = rank_tensors(out, "target", rank), rank_tensors(plain, "target", rank)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


# Every block-scaled tensor kind that TP3 pads (docs/output-format.md, "Pad values on vLLM 0.34.0's fast paths")
PADDED_SCALE_KINDS = {"attn.wq_b.weight_scale_inv", "attn.wo_a.weight_scale_inv", "attn.wo_b.weight_scale_inv",
                      "ffn.shared_experts.gate_up_proj.weight_scale_inv", "ffn.shared_experts.down_proj.weight_scale_inv",
                      "ffn.experts.routed_experts.w13_weight_scale", "ffn.experts.routed_experts.w2_weight_scale"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_pad_scale_byte_is_0x00_in_every_padded_block_scaled_tensor(converted, layout):
    """The E8M0 scale the converter writes for every padded block is byte 0x00, recorded `pad: zero`: no path of
    vLLM 0.34.0 or FlashInfer 0.7.4 reads it as anything but a zero block (the docs' table says where each one
    takes it). A change of the pad scale (0x7F, say) must change this test and that table together."""
    out = converted(**LAYOUTS[layout])
    manifest = json.loads((out / "lucifer-manifest.json").read_text())
    kinds, checked = set(), 0
    for role, doc in manifest["roles"].items():
        for entry in doc["ranks"]:
            tensors = rank_tensors(out, role, entry["rank"])
            for name, info in entry["tensors"].items():
                if info["source_dtype"] != "F8_E8M0" or not info["zero_regions"]:
                    continue
                assert info["pad"] == "zero", name
                kinds.add(next(k for k in PADDED_SCALE_KINDS if name.endswith(k)))
                data = model_layout(info, tensors[name])
                for e in range(info["experts"] or 1):
                    block = data[e] if info["experts"] else data
                    for dim, lo, hi in info["zero_regions"]:
                        region = np.take(block, range(lo, hi), axis=dim)
                        assert region.size and not region.any(), f"{role} rank {entry['rank']} {name} {dim, lo, hi}"
                        checked += region.size
    assert kinds == PADDED_SCALE_KINDS and checked > 0
