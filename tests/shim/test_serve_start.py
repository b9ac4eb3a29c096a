"""Issue 43 finding 11: `lucifer-shard serve` inside a vLLM environment (this venv's vLLM, torch and
FlashInfer, a stand-in `vllm` command first on PATH) adds at most 2 s before it execs vLLM, and imports
none of vllm, torch or flashinfer on the way (it imported all of vLLM through find_spec("vllm._version"):
6.6-7.8 s on a 2-core box). The measurement is bench/serve_start.py's, which make bench-serve runs in this
venv."""
from __future__ import annotations

import statistics

from helpers import script_module



def _bench():
    return script_module("bench/serve_start.py")


def test_serve_execs_vllm_within_two_seconds_in_a_vllm_environment(out_model, tmp_path):
    bench = _bench()
    assert bench.installed_vllm() is not None  # the measurement is of a vLLM environment, not a stand-in's
    runs = [bench.time_serve_start(out_model, tmp_path / "standin", "--draft") for _ in range(3)]
    times = [t for t, _, _ in runs]
    assert statistics.median(times) <= 2.0, times
    argv = runs[0][1]
    assert argv[:2] == ["serve", str(out_model.resolve())] and "--speculative-config" in argv, argv


def test_serve_imports_no_vllm_torch_or_flashinfer_before_exec(out_model, tmp_path):
    assert _bench().imported_before_exec(out_model, tmp_path / "standin") == []
