"""CPU unit tests of the GPU results pipeline: gpu_harness.record (the writer) and report.py (the
renderer and its go/no-go verdict), on fabricated figures. Not marked gpu: CPU CI runs them."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

import gpu_harness as H

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("lucifer_gpu_report", HERE / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

MACHINE = """date: 2026-12-01T10:00:00Z
gpu: NVIDIA H200 (143771 MiB)
gpu_count: 1
driver: 580.95.05
nvcc: Cuda compilation tools, release 13.0, V13.0.88
python: 3.12.3 /usr/bin/python3
torch: 2.11.0+cu130
cuda_runtime_torch: 13.0
compute_capability: 9.0
flashinfer: 0.7.2.post1 /x/flashinfer/__init__.py
--- nvidia-smi
| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0 |
"""


def _m(rel, frac=1.0, finite=True, max_abs=0.5, max_ref=200.0):
    return {"rel": rel, "frac_ok": frac, "finite": finite, "max_abs": max_abs, "max_ref": max_ref, "n": 4096}


def _good_records() -> list[tuple[str, dict]]:
    recs = [("device", {"name": "NVIDIA H200", "capability": [9, 0], "count": 1, "torch": "2.11.0+cu130", "cuda": "13.0",
                        "flashinfer": "0.7.2.post1", "fp32_matmul_precision": "highest"}),
            ("fixture", {"synth_s": 4.1, "convert_s": 3.2, "hidden": 4096, "inter": 2048, "experts": 8, "top_k": 6,
                         "swiglu_limit": 10.0, "flashinfer_layout": "folded", "moe_variant": "FLASHINFER_CUTLASS_MXFP4_BF16",
                         "layouts": {"w2_weight": "interleave_sm90"}, "rank_shapes": {"w2_weight": [8, 4096, 384]}})]
    for case in report.LAYOUT_CASES:
        recs.append(("layout_identity", {"case": case, "ours": "f", "flashinfer": "g", "shape": [4, 1536, 128],
                                         "out_shape": [4, 1536, 128], "equal": True, "mismatches": 0, "nbytes": 786432}))
    for preset, experts, ms in (("flash-moe", 8, (1, 8, 16, 64)), ("flash-layer", 256, (1, 8, 64, 256))):
        for m in ms:
            recs.append(("kernel_tp3", {"preset": preset, "experts": experts, "M": m,
                                        "experts_routed": min(experts, 6 * m),
                                        "ranks": [dict(_m(1.1e-4), rank=r) for r in range(3)],
                                        "sum": _m(3.3e-3, frac=0.995), "kernel_ms_rank0": 0.1}))
    for r in range(3):
        for t, lim, nan in (("w2_weight_scale", 10.0, [3, 9]), ("w13_weight_scale", None, [3, 9]),
                            ("w13_weight_scale", 10.0, [])):
            recs.append(("ff_padding", {"rank": r, "tensor": t, "swiglu_limit": lim, "model_index": [7, 704, 0],
                                        "zero_region": [0, 704, 768], "routed_rows": [3, 9], "expected_nan_rows": nan,
                                        "kernel_nan_rows": nan, "reference_nan_rows": nan, "kernel_rows_all_nan": 2,
                                        "kernel_nan_elements": 8192, "reference_nan_elements": 8192,
                                        "clean_finite": True, "others_identical": True}))
    paths = ("rank file -> cuda()", "source -> runtime preparation")
    recs.append(("load_side", {"preset": "flash-layer", "experts": 256, "rank": 0, "reps": 3, "cache_drop": "drop_caches+fadvise",
                               "bytes_read": dict(zip(paths, (1_208_000_000, 3_422_552_064))),
                               "median_s": dict(zip(paths, ({"cold": 0.61, "warm": 0.25}, {"cold": 3.9, "warm": 1.7}))),
                               "storage_read_bytes": {p: {"cold": [1.2e9] * 3, "warm": [0] * 3} for p in paths},
                               "times_s": {p: {"cold": [1.0] * 3, "warm": [0.5] * 3} for p in paths},
                               "speedup": {"cold": 6.4, "warm": 6.8},
                               "equal_by_rank": {str(r): {"w13_weight": True, "w2_weight": True} for r in range(3)}}))
    for m in (8, 64):
        recs.append(("stock_offsets", {"M": m, "stock": _m(1.12), "converter": _m(3.3e-3)}))
    recs.append(("cuda_graph", {"M": 64, "rank": 1, "workspace_bytes": 12_700_000, "bit_identical": True,
                                "bit_identical_new_input": True, "replay_ms": 0.122, "eager_ms": 0.3}))
    recs.append(("tp3_nccl", {"mode": "gloo", "label": "single-GPU fallback, gloo", "gpus": 1, "ok": True, "wall_s": 30,
                              "tol": {"vs_ref_rel": 6e-3, "vs_emul_rel": 4e-3},
                              "rows": [{"M": 1, "vs_ref": _m(4.1e-3), "vs_emul": _m(2.4e-3), "emul_vs_ref": _m(3.4e-3),
                                        "ranks_identical": True, "partials_bit_identical_to_single_process": [True] * 3}]}))
    for t in ("test_01_layout_identity.py::x", "test_02_kernel_tp3.py::y", "test_05_tp3_nccl.py::z"):
        recs.append(("outcome", {"test": t, "when": "call", "outcome": "passed", "duration_s": 1.0}))
    recs.append(("session", {"wall_s": 95.0, "exitstatus": 0, "passed": 3, "failed": 0, "errors": 0}))
    return recs


def _write(path: Path, recs) -> Path:
    for kind, fields in recs:
        H.record(kind, path=path, **copy.deepcopy(fields))
    return path


def _render(tmp_path, recs) -> tuple[bool, str]:
    path = _write(tmp_path / "r.json", recs)
    loaded = report.load_records(path)
    go, _ = report.evaluate(loaded)
    return go, report.render(loaded, MACHINE, "1 passed\n", {"wall_s": 1042, "phases": {"compile_link": 1020}})


def test_record_appends_json(tmp_path):
    p = tmp_path / "sub" / "res.json"
    H.record("a", path=p, x=1.5, bad=float("inf"), arr=(1, 2))
    H.record("b", path=p, y={"z": float("nan")})
    data = json.loads(p.read_text())
    assert [r["kind"] for r in data["records"]] == ["a", "b"]
    assert data["records"][0]["bad"] == "inf" and data["records"][0]["arr"] == [1, 2]
    assert data["records"][1]["y"]["z"] == "nan"
    assert data["records"][0]["session"] == data["records"][1]["session"] == H.SESSION


def test_results_path_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LUCIFER_GPU_RESULTS", raising=False)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert H.results_path() == tmp_path / "gpu-results.json"
    monkeypatch.setenv("LUCIFER_GPU_RESULTS", str(tmp_path / "x.json"))
    assert H.results_path() == tmp_path / "x.json"
    monkeypatch.delenv("LUCIFER_GPU_RESULTS")
    monkeypatch.delenv("OUT")
    assert H.results_path() == Path("/tmp/gpu-results.json")


def test_all_good_is_go_and_shows_every_figure(tmp_path):
    go, md = _render(tmp_path, _good_records())
    assert go
    assert "**GO.**" in md and "NO-GO" not in md
    assert "a small CUTLASS hardware test matches a reference at world size 3" in md
    assert "| gpu | NVIDIA H200 (143771 MiB) |" in md and "| flashinfer | 0.7.2.post1" in md
    assert "| driver | 580.95.05 |" in md and "| torch | 2.11.0+cu130 |" in md
    assert "**3.30e-03**" in md            # TP3 sum rel
    assert "1.10e-04" in md                # per-rank rel
    assert "1.12e+00" in md                # stock
    assert "0.1220" in md                  # replay ms
    assert "1042 s" in md                  # build time
    assert "single-GPU fallback, gloo" in md and "**not** run" in md
    verdict = md.split("## Verdict")[1].split("## Machine")[0]
    assert verdict.count("| pass |") == 9 and "FAIL" not in verdict
    assert "### flash-layer (256 experts)" in md and "| 256 | 256 | **TP3 sum vs unsharded** |" in md
    assert "W2 scale: 6 NaN rows, W13 scale without swiglu_limit: 6, exactly the routed rows; W13 scale with swiglu_limit 10: 0" in md
    assert "| 3.423 GB | 3.900 s | 1.700 s |" in md          # runtime path: bytes, cold and warm medians
    assert "faster by 6.4x cold and 6.8x warm" in md and "identical on ranks 0, 1, 2 of 3" in md
    assert "device seen by the tests | NVIDIA H200, capability [9, 0]" in md


@pytest.mark.parametrize("breakage, needle", [
    (lambda r: r[("kernel_tp3", 16)]["sum"].update(rel=6e-3), "M=16 TP3 sum"),
    (lambda r: r[("kernel_tp3", 1)]["ranks"][2].update(rel=3e-3), "M=1 rank 2"),
    (lambda r: r[("kernel_tp3", 8)]["ranks"][0].update(frac_ok=0.99), "M=8 rank 0"),
    (lambda r: r[("kernel_tp3", 64)]["sum"].update(finite=False), "M=64 TP3 sum"),
    (lambda r: r[("layout_identity", "scales-fold-w2")].update(equal=False, mismatches=7), "differ: ['scales-fold-w2']"),
    (lambda r: r[("stock_offsets", 8)]["stock"].update(rel=0.1), "M=8 rel 1.00e-01"),
    (lambda r: r[("cuda_graph", 64)].update(bit_identical_new_input=False), "identical True/False"),
    (lambda r: r[("outcome", "test_02_kernel_tp3.py::y")].update(outcome="failed", detail="boom"), "test_02_kernel_tp3.py::y"),
    (lambda r: r[("outcome", "test_02_kernel_tp3.py::y")].update(outcome="skipped"), "test_02_kernel_tp3.py::y"),
    (lambda r: r[("device", None)].update(capability=[12, 0], name="RTX PRO 6000"), "RTX PRO 6000, capability [12, 0]"),
    (lambda r: r[("kernel_tp3", 256)].update(experts_routed=250), "M=256: 250 of 256 experts routed"),
    (lambda r: r[("kernel_tp3", 256)].update(experts=8), "M=256: 8 experts, expected 256"),
    (lambda r: r[("ff_padding", (1, "w2_weight_scale", 10.0))].update(kernel_nan_rows=[]),
     "rank 1 w2_weight_scale swiglu_limit 10.0: NaN rows 0 []"),
    (lambda r: r[("ff_padding", (0, "w13_weight_scale", 10.0))].update(kernel_nan_rows=[3, 9]),
     "rank 0 w13_weight_scale swiglu_limit 10.0: NaN rows 2 [3, 9]"),
    (lambda r: r[("ff_padding", (0, "w13_weight_scale", 10.0))].update(expected_nan_rows=[3], kernel_nan_rows=[3],
                                                                       reference_nan_rows=[3]), "vs expected 1 [3]"),
    (lambda r: r[("ff_padding", (2, "w13_weight_scale", None))].update(others_identical=False), "others identical False"),
    (lambda r: r[("load_side", None)]["equal_by_rank"]["1"].update(w2_weight=False), "3 ranks compared, differ: {'1': ['w2_weight']}"),
])
def test_any_broken_figure_is_no_go(tmp_path, breakage, needle):
    recs = _good_records()
    key = {}
    for kind, f in recs:
        ident = report._ff_key(f) if kind == "ff_padding" else f.get("M", f.get("case", f.get("test")))
        key.setdefault((kind, ident), f)  # kernel_tp3 M=1/8/64: flash-moe's (listed first)
    breakage(key)
    go, md = _render(tmp_path, recs)
    assert not go
    assert "**NO-GO.**" in md and "**FAIL**" in md
    assert needle in md


@pytest.mark.parametrize("drop", ["kernel_tp3", "layout_identity", "stock_offsets", "cuda_graph", "outcome", "device",
                                  "ff_padding", "load_side"])
def test_missing_results_are_no_go(tmp_path, drop):
    recs = [(k, f) for k, f in _good_records() if k != drop]
    go, md = _render(tmp_path, recs)
    assert not go and "**NO-GO.**" in md


@pytest.mark.parametrize("preset, m", [("flash-moe", 16), ("flash-layer", 256), ("flash-layer", 1)])
def test_missing_one_m_is_no_go(tmp_path, preset, m):
    recs = [(k, f) for k, f in _good_records() if not (k == "kernel_tp3" and f["preset"] == preset and f["M"] == m)]
    go, md = _render(tmp_path, recs)
    assert not go and f"M={m} missing" in md


def test_one_missing_ff_case_is_no_go(tmp_path):
    recs = [(k, f) for k, f in _good_records() if not (k == "ff_padding" and report._ff_key(f) == (2, "w13_weight_scale", None))]
    go, md = _render(tmp_path, recs)
    assert not go and "rank 2 w13_weight_scale swiglu_limit None: missing" in md


def test_tp3_nccl_failure_is_reported_but_not_gated(tmp_path):
    recs = _good_records()
    for k, f in recs:
        if k == "tp3_nccl":
            f.update(ok=False, error="TimeoutError: workers still running")
        if k == "outcome" and "tp3_nccl" in f["test"]:
            f.update(outcome="failed")
    go, md = _render(tmp_path, recs)
    assert go
    assert "result **FAIL**" in md and "TimeoutError" in md


def test_only_the_latest_session_counts(tmp_path):
    path = tmp_path / "r.json"
    old = {"format": "lucifer-shard/gpu-results", "version": 1,
           "records": [{"session": "old", "kind": "kernel_tp3", "M": 1, "ranks": [], "sum": _m(9.0)}]}
    path.write_text(json.dumps(old))
    _write(path, _good_records())
    recs = report.load_records(path)
    assert recs and all(r["session"] == H.SESSION for r in recs)
    assert report.evaluate(recs)[0]


def test_cli_writes_the_markdown(tmp_path, capsys):
    res = _write(tmp_path / "r.json", _good_records())
    mach = tmp_path / "machine.txt"
    mach.write_text(MACHINE)
    out = tmp_path / "docs" / "gpu-validation.md"
    notes = tmp_path / "notes.md"
    notes.write_text("An earlier call failed on purpose.\n")
    assert report.main([str(res), str(mach), "-o", str(out), "--command", "bash tests/gpu/run.sh", "--notes", str(notes)]) == 0
    text = out.read_text()
    assert text.startswith("# GPU validation") and "bash tests/gpu/run.sh" in text
    assert "## Notes on this run\n\nAn earlier call failed on purpose." in text and "## How to run it" in text
    assert "verdict: GO" in capsys.readouterr().err


def test_the_committed_record_line_heads_the_evidence_page():
    """The page is evidence (docs/evidence/README.md): tests/gpu/results/record.md renders before the verdict, and the
    committed page holds it."""
    record = (HERE / "results" / "record.md").read_text()
    text = report.render([], MACHINE, record=record)
    assert text.index(record.strip()) < text.index("## Verdict")
    assert record.strip() in (HERE.parents[1] / "docs" / "evidence" / "gpu-validation.md").read_text()
