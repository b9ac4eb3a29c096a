"""The GPU serving run's own logic, on the CPU (tests/gpu/serve_run.py runs on the device; these parts
decide what it reports): the comparison of two servers' generations, which phases may run, and that the
command it gives `lucifer-shard serve` passes the real CLI's check of the flags it owns."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

import report
import serve_run as S
from test_gpu_report import MACHINE, _good_records, _write


def _gen(tokens: list[int], lp: float) -> dict:
    one = {"tokens": tokens, "token_logprobs": [lp] * len(tokens), "top_logprobs": [{f"token_id:{t}": lp} for t in tokens]}
    return {"short": [one], "short_again": [one], "long": [one]}


def test_same_is_bitwise_and_reports_the_largest_logprob_difference():
    a = _gen([1, 2, 3], -0.5)
    assert S.same(a, copy.deepcopy(a)) == {"tokens_equal": True, "identical": True, "max_abs_logprob_diff": 0.0}
    b = _gen([1, 2, 3], -0.25)
    r = S.same(a, b)
    assert r["tokens_equal"] and not r["identical"] and r["max_abs_logprob_diff"] == 0.25
    assert not S.same(a, _gen([1, 2, 4], -0.5))["tokens_equal"]


@pytest.mark.parametrize("phase,results,why", [
    ("prepare", {"probe": {"import_ok": False}}, "does not import"),
    ("eager", {}, "does not import"),
    ("graphs", {"probe": {"import_ok": True}, "eager": {"runs": {"ref_eager": {"started": False}}}}, "did not start"),
    ("startup", {"probe": {"import_ok": True}}, "did not start"),
])
def test_phases_wait_for_what_they_need(phase, results, why):
    assert why in S._missing_prerequisite(phase, results)


def test_phases_run_when_their_prerequisites_held():
    ok = {"probe": {"import_ok": True}, "eager": {"runs": {"ref_eager": {"started": True}}}}
    assert all(S._missing_prerequisite(p, ok) is None for p in S.PHASES)


@pytest.mark.parametrize("layout,moe", [("model", None), ("model", S.FI), ("kernel", None)])
def test_lucifer_serve_command_passes_the_clis_owned_flag_check(converted, layout, moe):
    """`serve --dry-run` with exactly the arguments the serving run passes: the CLI must not refuse a
    flag it owns (the run leaves the attention backend, and for kernel layout the MoE backend, to the
    manifest); without vLLM here it stops at the environment check, after the argument check. The
    command it prints has the run's MoE backend once."""
    out = converted(tp=1, arch="sm90", expert_layout=layout)
    argv = S.lucifer_serve(out, S.EAGER, verify="full", moe=moe)
    assert argv[:3] == [sys.executable, "-m", "lucifer_shard.cli"]
    r = subprocess.run([*argv[:4], argv[4], "--dry-run", *argv[5:]], capture_output=True, text=True)
    assert "in the vLLM arguments" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.returncode in (0, 1), r.stderr
    assert "--attention-backend" not in argv and argv.count("--moe-backend") == (moe is not None)
    command = r.stdout.strip().splitlines()[-1]
    want = moe or ("flashinfer_cutlass" if layout == "kernel" else "marlin")
    assert command.count("--moe-backend") == 1 and f"--moe-backend {want}" in command, command


def test_report_renders_the_serving_section(tmp_path):
    recs = report.load_records(_write(tmp_path / "r.json", _good_records()))
    md = report.render(recs, MACHINE, serving="No token was served.")
    assert "## 8. Served inside vLLM" in md and "No token was served." in md
    assert "## 8." not in report.render(recs, MACHINE)


def test_post_load_figures_sum_the_hooks_records(tmp_path):
    """What the serving run reports of vLLM's post-load step, from tests/gpu/hooks/sitecustomize.py's lines
    (two processes' files: only the engine's loads): per MoE layer and in all, transient = peak - max(before, after)."""
    pwal = tmp_path / "x.pwal"
    pwal.mkdir()
    (pwal / "11.jsonl").write_text("")
    lines = [{"what": "moe_layer", "backend": "FLASHINFER_CUTLASS_MXFP4_BF16", "tagged": True, "ms": ms} for ms in (1.5, 2.5)]
    lines.append({"what": "post_load", "s": 0.25, "allocated_before": 100, "peak": 400, "allocated_after": 120})
    (pwal / "12.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = S.post_load_figures(pwal)
    assert got["moe_post_load"] == {"layers": 2, "backend": ["FLASHINFER_CUTLASS_MXFP4_BF16"], "kernel_layout_layers": 2,
                                    "total_ms": 4.0, "max_ms": 2.5}
    assert got["post_load"] == {"s": 0.25, "allocated_before": 100, "peak": 400, "allocated_after": 120,
                                "transient_bytes": 280}
    assert S.post_load_figures(tmp_path / "none") == {}


class _FakeServer:
    """Stands in for a vLLM server process (no vLLM here): ready at once; each start takes 100 s of a fake clock."""
    started: list[str] = []
    now = [0.0]

    def __init__(self, name, argv, port, logs):
        self.name, self.t0 = name, self.now[0]
        self.started.append(name)

    def wait_ready(self, deadline):
        return 1.0

    def complete(self, prompt, max_tokens):
        return {}

    def load_figures(self):
        return {"model_loading_s": 2.0 if "lucifer" in self.name else 5.0, "verbatim_lines": []}

    def stop(self):
        self.now[0] += 100


def test_timed_starts_run_cold_then_warm_and_a_later_call_continues_where_one_stopped(monkeypatch, tmp_path):
    """The load phase's starts: cold ones after dropping the page cache, warm ones right after; a call whose
    time runs out saves what ran and is marked unfinished, so the next call on the machine runs only the rest
    (a partial result once counted as done and the phase was skipped: found on the H200, 2026-12-04)."""
    dropped = []
    monkeypatch.setattr(S, "Server", _FakeServer)
    monkeypatch.setattr(S, "drop_caches", lambda: dropped.append(len(_FakeServer.started)))
    monkeypatch.setattr(S.time, "monotonic", lambda: _FakeServer.now[0])
    _FakeServer.started, _FakeServer.now[0] = [], 0.0
    starts = [(rep, name, mode) for rep in range(2) for name in S.LOADS for mode in ("cold", "warm")]
    argv = {name: [name] for name in S.LOADS}
    saved = []
    # a start needs 100 s left: at 300 s of a 350 s call, the fourth does not begin
    res = S._timed_starts(starts, argv, "load", tmp_path, 350.0, {}, lambda r: saved.append(dict(r)))
    assert _FakeServer.started == ["load_default_cold_0", "load_default_warm_0", "load_lucifer_cold_0"]
    assert dropped == [0, 2]  # before each cold start only
    assert "lucifer_warm" in res["stopped_early"] and len(saved) == 3 and not S._done(res)

    _FakeServer.started, read = [], []
    monkeypatch.setattr(S, "read_files", lambda files: read.append(files))
    res = S._timed_starts(starts, argv, "load", tmp_path, 1e9, res, lambda r: None, {"lucifer": ["rank"]})
    assert _FakeServer.started == ["load_lucifer_warm_0", "load_default_cold_1", "load_default_warm_1",
                                   "load_lucifer_cold_1", "load_lucifer_warm_1"]
    assert read == [["rank"]]  # its cold start ran in the call before: its files are read first
    assert S._done(res) and res["lucifer_warm"][0] == {"machine": S.MACHINE, "ready_s": 1.0, "warmed_by_read": True,
                                                       "first_token_s": 0.0, "model_loading_s": 2.0}
    assert {k: len(v) for k, v in res.items() if k.endswith(("_cold", "_warm"))} == {
        "default_cold": 2, "default_warm": 2, "lucifer_cold": 2, "lucifer_warm": 2}


def test_a_fresh_machine_continues_an_earlier_calls_load_rows(monkeypatch, tmp_path):
    """The load phase carried to a freshly lent machine (`--continue-load`): the earlier call's rows count,
    tagged with their machine, and only the missing starts run; a warm start whose cold start ran on the
    earlier machine reads its files first, and says so in its row."""
    dropped, read = [], []
    monkeypatch.setattr(S, "Server", _FakeServer)
    monkeypatch.setattr(S, "drop_caches", lambda: dropped.append(len(_FakeServer.started)))
    monkeypatch.setattr(S, "read_files", lambda files: read.append((len(_FakeServer.started), files)))
    monkeypatch.setattr(S.time, "monotonic", lambda: _FakeServer.now[0])
    _FakeServer.started, _FakeServer.now[0] = [], 0.0
    row = {"ready_s": 90.0, "model_loading_s": 9.0}
    earlier = {"load": {"default_cold": [row, row], "default_warm": [row], "lucifer_cold": [row],
                        "lucifer_warm": [row], "floor": {"out": {"gb_per_s": 1.17}}, "complete": False}}
    res = S.carried_load(earlier, "results/earlier.json")
    assert not S._done(res) and res["earlier_floors"] == {"results/earlier.json": {"out": {"gb_per_s": 1.17}}}
    starts = [(rep, name, mode) for rep in range(3) for name in S.LOADS for mode in ("cold", "warm")]
    files = {"default": ["model.safetensors"], "lucifer": ["rank.safetensors"]}
    res = S._timed_starts(starts, {n: [n] for n in S.LOADS}, "load", tmp_path, 1e9, res, lambda r: None, files)
    assert _FakeServer.started == ["load_default_warm_1", "load_lucifer_cold_1", "load_lucifer_warm_1",
                                   "load_default_cold_2", "load_default_warm_2", "load_lucifer_cold_2",
                                   "load_lucifer_warm_2"]
    assert read == [(0, ["model.safetensors"])] and dropped == [1, 3, 5]
    assert res["default_warm"][1]["warmed_by_read"] and "warmed_by_read" not in res["lucifer_warm"][1]
    assert [r["machine"] for r in res["default_warm"]] == ["results/earlier.json", S.MACHINE, S.MACHINE]
    assert S._done(res) and all(len(res[k]) == 3 for k in ("default_cold", "default_warm", "lucifer_cold",
                                                             "lucifer_warm"))
    again = S.carried_load({"load": {**res, "machine": S.MACHINE, "floor": {"out": {}}}}, "later.json")
    assert set(again["earlier_floors"]) == {"results/earlier.json", S.MACHINE}


@pytest.mark.parametrize("result,done", [
    (None, False), ({"error": "x"}, False), ({"import_ok": False}, False), ({"import_ok": True}, True),
    ({"complete": False}, False), ({"stopped_early": "at repetition 1"}, False), ({"complete": True}, True)])
def test_a_phase_is_done_only_when_it_ran_whole(result, done):
    assert S._done(result) is done
