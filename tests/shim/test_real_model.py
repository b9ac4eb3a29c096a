"""The rank files in vLLM's own DeepSeek-V4 models (the venv's vetted stock release), at TP 1, 2 and 4.

Per TP size, one world of gloo processes (`vllm_cpu_model.py`, one process per rank) builds the
models vLLM selects and loads each into a fresh model, before post-load processing:

* the target, vLLM's DeepSeek-V4 CPU class: by vLLM's `DefaultModelLoader` from the original
  checkpoint (the reference), by `lucifer_tp3` from the rank files (`--expert-layout model`: vLLM
  0.33.0 has no kernel-layout path for these files), and by `lucifer_tp3` from a copy with one
  flipped byte, once with `verify=full` and once with the default `verify=headers`;
* the MTP draft, vLLM's NVIDIA `DeepSeekV4MTP` class (the CPU class is a stub that raises in
  `__init__`), from the checkpoint and from the draft rank files.

At TP3 vLLM's own loader cannot run (stock vLLM refuses 64 heads / 3), so there is no such pair:
TP3 is loaded with the plugin's stock virtual TP and compared with the rank files
(`test_stock_tp3.py`), and in the fork's own code with the fork's loader (`test_fork_model.py`).
"""
from __future__ import annotations

from pathlib import Path

import pytest

import shim_fixtures as sf
from lucifer_shard.model.drafts import owned_by_runtime
from vllm_cpu_model import NVIDIA_ENGINE

TP_SIZES = (1, 2, 4)
TAMPERED = "model.layers.1.ffn.experts.routed_experts.w2_weight"
MODEL_CLASS = "vllm.models.deepseek_v4.cpu.model.DeepseekV4ForCausalLM"
DRAFT_CLASS = "vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP"
DRAFT_ENGINE = {**NVIDIA_ENGINE, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
WORLD_TIMEOUT_S = 900


def flip_byte(out: Path, role: str, rank: int, name: str, at: int = 100) -> tuple[Path, int]:
    """Flip one byte of tensor `name` in a private copy of its rank file; (file, absolute offset)."""
    from lucifer_shard.formats.stheader import read_header

    entry = next(e for e in sf.manifest(out)["roles"][role]["ranks"] if int(e["rank"]) == rank)
    path = out / entry["tensors"][name]["file"]
    header = read_header(path)
    offset = header.data_start + header.tensors[name].start + at
    sf.real_copy(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x5A]))
    return path, offset


@pytest.fixture(scope="module")
def source(shim_base) -> Path:
    model = shim_base / "model"
    if not model.exists():
        sf.cli("synth", "tiny", str(model), "--fill", "pattern", "--quiet")
    return model


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{t}" for t in TP_SIZES])
def world(request, source, tmp_path_factory) -> dict:
    tp = request.param
    base = tmp_path_factory.mktemp(f"real-tp{tp}")
    out = base / "out"
    sf.cli("convert", "--tp", str(tp), "--arch", "sm120", str(source), str(out), "--expert-layout", "model", "--quiet")
    tampered = sf.link_copy(out, base / "tampered")
    bad_file, bad_offset = flip_byte(tampered, "target", tp - 1, TAMPERED)
    draft = {"role": "draft", "model_class": DRAFT_CLASS, "engine": DRAFT_ENGINE}
    spec = {
        "tp": tp, "results": str(base / "results"),
        "runs": [
            {"name": "default", "model": str(source), "load_format": "auto"},
            {"name": "lucifer", "model": str(out), "load_format": "lucifer_tp3", "files": str(out / "target"),
             "compare_to": "default"},
            {"name": "tampered_full", "model": str(tampered), "load_format": "lucifer_tp3",
             "extra": {"verify": "full"}},
            {"name": "tampered_headers", "model": str(tampered), "load_format": "lucifer_tp3", "compare_to": "default"},
            {"name": "draft_default", "model": str(source), "load_format": "auto", **draft},
            {"name": "draft_lucifer", "model": str(out), "load_format": "lucifer_tp3", "files": str(out / "draft"),
             "compare_to": "draft_default", **draft},
        ],
    }
    reports = sf.run_world(spec, f"vllm-{sf.vllm_version()}-tp{tp}", timeout=WORLD_TIMEOUT_S)
    return {"tp": tp, "out": out, "reports": reports, "bad_file": bad_file, "bad_offset": bad_offset}


def _runs(world, name):
    return [rep["runs"][name] for rep in world["reports"]]


def test_built_by_vllm_itself(world):
    for rep in world["reports"]:
        assert rep["vllm"] == sf.vllm_version() and rep["platform"] == "CpuPlatform"
        assert rep["tp_rank"] == rep["rank"]
        for name in ("default", "lucifer"):
            run = rep["runs"][name]
            assert run["model_class"] == MODEL_CLASS, run
        assert rep["runs"]["default"]["loader"] == "DefaultModelLoader"
        assert rep["runs"]["lucifer"]["loader"] == "LuciferTP3Loader"


def test_same_names_shapes_dtypes(world):
    man = sf.manifest(world["out"])
    for rep in world["reports"]:
        default, lucifer = rep["runs"]["default"]["params"], rep["runs"]["lucifer"]["params"]
        entry = man["roles"]["target"]["ranks"][rep["rank"]]["tensors"]
        assert set(default) == set(lucifer) == set(entry), (set(default) ^ set(entry), set(lucifer) ^ set(entry))
        for name in default:
            assert default[name][:2] == lucifer[name][:2], name
        assert rep["runs"]["lucifer"]["file_tensors"] == len(entry)


def test_every_parameter_byte_identical(world):
    for rep in world["reports"]:
        lucifer = rep["runs"]["lucifer"]
        assert "error" not in lucifer, lucifer.get("error")
        vs = lucifer["vs_reference"]
        assert vs["only_here"] == vs["only_reference"] == vs["differ"] == [], vs
        assert lucifer["file_problems"] == []
        default = rep["runs"]["default"]["params"]
        assert vs["bytes_compared"] > 0 and all(lucifer["params"][n][2] == d[2] for n, d in default.items())


def test_tampered_rank_file_is_named_in_one_line(world):
    last = world["tp"] - 1
    for rep in world["reports"]:
        run = rep["runs"]["tampered_full"]
        if rep["rank"] != last:
            assert "error" not in run, run["error"]  # the other ranks' files are untouched
            continue
        err = run.get("error", "")
        assert err.startswith("ShimError: lucifer_tp3: verify=full: loaded "), err
        assert TAMPERED in err and str(world["bad_file"]) in err and "\n" not in err, err


def test_tamper_shows_in_the_comparison_with_vllms_loader(world):
    """Without verify=full the byte loads; the comparison with DefaultModelLoader names it."""
    last = world["tp"] - 1
    for rep in world["reports"]:
        differ = rep["runs"]["tampered_headers"]["vs_reference"]["differ"]
        if rep["rank"] != last:
            assert differ == []
            continue
        assert len(differ) == 1 and differ[0].startswith(f"{TAMPERED}: byte 100: "), differ
        assert " (1 of " in differ[0], differ


def test_draft_built_by_vllm_itself_and_byte_identical(world):
    man = sf.manifest(world["out"])
    for rep in world["reports"]:
        default, lucifer = rep["runs"]["draft_default"], rep["runs"]["draft_lucifer"]
        assert default["model_class"] == lucifer["model_class"] == DRAFT_CLASS
        assert "error" not in lucifer, lucifer.get("error")
        entry = man["roles"]["draft"]["ranks"][rep["rank"]]["tensors"]
        # The draft borrows the target's embedding and LM head after loading: neither the checkpoint's
        # MTP layer nor the draft rank files hold them, and neither loader fills them.
        owned = set(default["params"]) - set(entry)
        assert owned == owned_by_runtime("mtp", default["params"]) and len(owned) == 2, owned
        assert set(default["params"]) == set(lucifer["params"])
        for name, d in default["params"].items():
            assert d[:2] == lucifer["params"][name][:2], name
        assert lucifer["file_tensors"] == len(entry) and lucifer["file_problems"] == []
        vs = lucifer["vs_reference"]
        assert vs["only_here"] == vs["only_reference"] == []
        assert {d.split(":")[0] for d in vs["differ"]} <= owned, vs["differ"]
