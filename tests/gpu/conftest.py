"""GPU tests: FlashInfer's real CUTLASS MoE (SM90, MXFP4 x BF16) on the converter's rank files.

How CPU CI stays green without skips: pyproject's addopts is `-m 'not gpu'`, so every test here
that carries `pytest.mark.gpu` is deselected after collection. Collection itself must therefore
work on a CPU box, so NO module in this folder imports FlashInfer (or lucifer_shard.proof.numerics) at
module level: FlashInfer is imported by the `fi` fixture (gpu_harness.flashinfer_moe), which only
gpu-marked tests request, and deselected tests never set up fixtures. The modules import only
torch, numpy, safetensors and lucifer_shard, which CPU CI has anyway, so collecting them costs
a few milliseconds. (A `collect_ignore` keyed on torch.cuda.is_available() would hide
import errors of these modules from CPU CI; a module-level importorskip would turn a missing
FlashInfer on the GPU machine into skips, i.e. a green run that proved nothing.)

On the GPU machine: `bash tests/gpu/run.sh` (pytest -m gpu tests/gpu -o addopts=''). A gpu test
that cannot run there fails; nothing here skips.

Every gpu test appends its figures to the results JSON (gpu_harness.results_path():
$LUCIFER_GPU_RESULTS, else $OUT/gpu-results.json, else /tmp/gpu-results.json); the hooks below add
one `outcome` record per gpu test and a `session` record at the end, only when gpu tests ran.
`report.py` renders docs/evidence/gpu-validation.md from that file.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpu_harness as H  # noqa: E402  (CPU-importable: no FlashInfer at module level)

_T0 = time.time()
_STATS = {"passed": 0, "failed": 0, "skipped": 0, "error": 0, "ran": False}


_GPU_NODES: set[str] = set()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Remember which running tests carry the gpu marker (report.keywords would also match the
    folder name `gpu`, so the marker is read from the item)."""
    if item.get_closest_marker("gpu") is not None:
        _GPU_NODES.add(item.nodeid)


def _is_gpu(report) -> bool:
    return report.nodeid in _GPU_NODES


def pytest_runtest_logreport(report):
    """One `outcome` record per gpu test (call phase, or a failed/skipped setup or teardown)."""
    if not _is_gpu(report):
        return
    if report.when != "call" and report.outcome == "passed":
        return
    _STATS["ran"] = True
    outcome = report.outcome if report.when == "call" else ("error" if report.outcome == "failed" else report.outcome)
    _STATS[outcome if outcome in _STATS else "error"] += 1
    detail = ""
    if report.outcome != "passed":
        detail = str(report.longrepr)[-3000:]
    try:
        H.record("outcome", test=report.nodeid, when=report.when, outcome=outcome,
                 duration_s=round(float(report.duration), 3), detail=detail)
    except Exception as e:  # never turn a result into a crash of the run
        print(f"[gpu-results] could not record outcome of {report.nodeid}: {e!r}")


def pytest_sessionfinish(session, exitstatus):
    if not _STATS["ran"]:  # CPU CI: no gpu test ran, write nothing
        return
    try:
        H.record("session", wall_s=round(time.time() - _T0, 1), exitstatus=int(exitstatus),
                 passed=_STATS["passed"], failed=_STATS["failed"], errors=_STATS["error"],
                 skipped=_STATS["skipped"], argv=sys.argv[1:])
        print(f"\n[gpu-results] {H.results_path()}")
    except Exception as e:
        print(f"[gpu-results] could not record the session: {e!r}")


# ---------------------------------------------------------------- fixtures (set up only by gpu tests)
@pytest.fixture(scope="session")
def fi():
    """(flashinfer, flashinfer.fused_moe); fails (not skips) without an SM90 GPU and FlashInfer.
    Also pins fp32 matmuls to IEEE (no TF32) so the reference on the GPU is a true fp32 reference."""
    mods = H.flashinfer_moe()
    torch.set_float32_matmul_precision("highest")
    if not H.DRYRUN:
        H.record("device", **H.device_info(mods[0]))
    return mods


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """preset -> H.Checkpoint: synth PRESET --fill random, converted --tp 3 --arch sm90 (folded),
    made once per session on first use (flash-layer: ~5.7 GB of source, ~6.2 GB of rank files)."""
    made: dict[str, H.Checkpoint] = {}

    def get(preset: str) -> H.Checkpoint:
        if preset not in made:
            ck = made[preset] = H.make_checkpoint(tmp_path_factory.mktemp(preset), preset)
            man = H.manifest(ck.out)
            shapes = {n: man["roles"][H.ROLE]["ranks"][0]["tensors"][H.PREFIX + n]["shape"] for n in H.NAMES}
            H.record("fixture", preset=preset, synth_s=round(ck.synth_s, 2), convert_s=round(ck.convert_s, 2),
                     hidden=ck.hidden, inter=ck.inter, experts=ck.experts, top_k=ck.top_k,
                     swiglu_limit=ck.swiglu_limit, arch=man.get("arch"), flashinfer_layout=man.get("flashinfer_layout"),
                     moe_variant=man.get("moe_variant"), layouts={k: v["name"] for k, v in man.get("layouts", {}).items()},
                     rank_shapes=shapes, tool_version=man.get("tool_version"))
        return made[preset]
    return get


@pytest.fixture(scope="session")
def geometry(fi, checkpoints):
    """preset -> H.Geometry (source experts, rank tensors as written and in model layout, on the device)."""
    loaded: dict[str, H.Geometry] = {}

    def get(preset: str) -> H.Geometry:
        if preset not in loaded:
            t0 = time.perf_counter()
            loaded[preset] = H.load_geometry(checkpoints(preset), H.DEVICE)
            H.record("geometry_load", preset=preset, load_s=round(time.perf_counter() - t0, 2))
        return loaded[preset]
    return get


@pytest.fixture(scope="session")
def ckpt(checkpoints) -> H.Checkpoint:
    """The 8-expert flash-moe checkpoint."""
    return checkpoints(H.MOE)


@pytest.fixture(scope="session")
def moe(geometry) -> H.Geometry:
    return geometry(H.MOE)
