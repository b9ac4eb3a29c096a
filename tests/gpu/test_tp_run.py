"""TP on one GPU's own logic, on the CPU (tests/gpu/tp_run.py runs on the device; these parts decide what it
reports): which servers get the harness's one-GPU replacements, the comparison under the TP tolerance, the
acceptance counters read from vLLM's /metrics, and that every command it gives `lucifer-shard serve` passes
the real CLI's check of the flags it owns."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import tp_run as T


def _gen(tokens: list[list[int]], lp: float = -0.5, second: float = -2.0) -> dict:
    def one(ts):
        return {"tokens": ts, "token_logprobs": [lp] * len(ts),
                "top_logprobs": [{f"token_id:{t}": lp, f"token_id:{t + 1}": second} for t in ts]}
    return {"short": [one(t) for t in tokens], "short_again": [one(t) for t in tokens], "long": [one([9, 9])]}


def test_only_servers_wider_than_the_gpus_get_the_one_gpu_replacements():
    one = T.Plan(1)
    assert one.flags(1) == ["--enforce-eager"] and one.env(1) == {}
    assert one.flags(3) == T.ONE_GPU_FLAGS and one.env(3)["LUCIFER_ONE_GPU_TP"] == "1"
    three = T.Plan(3)  # three GPUs: the same script, vLLM's own choices (NCCL), no replacement
    assert three.env(3) == {} and "--distributed-executor-backend" not in three.flags(3)


def test_as_compare_orders_each_steps_logprobs_best_first():
    got = T.as_compare(_gen([[4, 7]])["short"])
    assert got == [{"tokens": [4, 7], "logprobs": [[[4, -0.5], [5, -2.0]], [[7, -0.5], [8, -2.0]]]}]


def test_against_reports_identity_differences_and_the_tolerance():
    a = _gen([[1, 2, 3]])
    same = T.against(a, _gen([[1, 2, 3]]), tau=0.1)
    assert same["identical"] and same["tokens_equal"] and same["violations"] == [] and same["max_abs_logprob_diff"] == 0
    near = T.against(a, _gen([[1, 2, 3]], lp=-0.55), tau=0.1)
    assert not near["identical"] and near["tokens_equal"] and near["violations"] == []
    assert near["max_abs_logprob_diff"] == pytest.approx(0.05)
    far = T.against(a, _gen([[1, 2, 3]], lp=-0.8), tau=0.1)
    assert far["violations"] and "> tau" in far["violations"][0]
    # a token differing where the reference's top-2 margin (1.5 nats) is wide: a violation, and where it stopped
    parted = T.against(a, _gen([[1, 3, 3]]), tau=0.1)
    assert parted["first_differences"] == [1, None] and any("tokens differ at step 1" in v for v in parted["violations"])
    assert "violations" not in T.against(a, a)  # no tolerance given: none judged
    assert parted["identical_prompts"] == {"short": [False], "long": [True]}


def _runs(names, gens):
    return {n: {"started": True, "generates": g, "speculative": {"acceptance_rate": 0.0}} for n, g in zip(names, gens)}


def test_judge_recomputes_both_phases_from_the_recorded_generations(tmp_path):
    a, near = _gen([[1, 2, 3]]), _gen([[1, 2, 3]], lp=-0.55)
    tp_names = ("ref_tp1", "ref_tp2", "files_tp2", "tp3_model", "tp3_kernel")
    draft_names = [n for pair in T.DRAFT_PAIRS for n in pair]
    path = tmp_path / "results.json"
    path.write_text(T.json.dumps({"tp": {"runs": _runs(tp_names, [a, near, near, near, near]), "tau": 0.1, "gain": 12.0},
                                  "draft": {"runs": _runs(draft_names, [a] * len(draft_names))}}))
    T.judge(path)
    got = T.json.loads(path.read_text())
    assert set(got["tp"]["compare"]) == {f"{x} vs {y}" for x, y in T.TP_PAIRS}
    assert got["tp"]["compare"]["ref_tp2 vs files_tp2"]["identical"]
    assert got["tp"]["own_noise"]["gain"] == pytest.approx(0.05 / (0.1 / 12.0)) and got["tp"]["own_noise"]["within_tau"]
    assert got["draft"]["tau"] == 0.1 and all(c["identical"] and c["violations"] == [] for c in got["draft"]["compare"].values())


def test_the_committed_one_gpu_results_are_what_this_code_judges(tmp_path):
    committed = Path(__file__).resolve().parent / "results" / "tp-one-gpu-2026-12-04" / "results.json"
    copy = tmp_path / "results.json"
    copy.write_bytes(committed.read_bytes())
    T.judge(copy)
    assert T.json.loads(copy.read_text()) == T.json.loads(committed.read_text())


def test_acceptance_sums_vllms_counters_over_labels():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.",
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="0"} 8.0',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 8.0'])
    assert T.acceptance(text) == {"draft_tokens": 40.0, "accepted_tokens": 10.0, "drafts": 8.0, "acceptance_rate": 0.25}
    assert T.acceptance("")["acceptance_rate"] is None


@pytest.mark.parametrize("tp,draft,verify", [(1, True, None), (3, False, "full"), (3, True, None)])
def test_lucifer_serve_commands_pass_the_clis_owned_flag_check(converted, tp, draft, verify):
    """`serve --dry-run` with exactly the arguments the run passes (the one-GPU flags included): the CLI must not
    refuse them; `--draft` stands before `--`, and the command asks vLLM for the output's draft method."""
    out = converted(tp=tp, arch="sm90")
    argv, _ = T.lucifer_serve(out, tp, T.Plan(1), draft=draft, verify=verify)
    cut = argv.index("--")
    assert ("--draft" in argv[:cut]) == draft and "--draft" not in argv[cut:]
    r = subprocess.run([*argv[:5], "--dry-run", *argv[5:]], capture_output=True, text=True)
    assert "in the vLLM arguments" not in r.stdout + r.stderr and r.returncode in (0, 1), r.stdout + r.stderr
    command = r.stdout.strip().splitlines()[-1]
    assert f"--tensor-parallel-size {tp}" in command and ("--distributed-executor-backend mp" in command) == (tp > 1)
    assert ('"method":"mtp"' in command) == draft
    assert argv[:3] == [sys.executable, "-m", "lucifer_shard.cli"]


def test_a_run_cut_by_its_deadline_keeps_every_servers_log_tail_and_stops_them_at_once(tmp_path):
    """The call's limit must not cost the evidence: servers not ready by the deadline get a row with their log's
    tail, and every process group is gone within the grace period (the H200 call of 2026-12-04 lost its whole
    phase waiting 30 s per server to stop)."""
    hang = [sys.executable, "-c", "import time; print('loading the model', flush=True); time.sleep(300)"]
    exits = [sys.executable, "-c", "import sys; print('refused: verify=full', flush=True); sys.exit(3)"]
    t = time.monotonic()
    got = T.run({"a": (hang, {}), "b": (exits, {"X": "1"}), "c": (hang, {})}, tmp_path, time.monotonic() + 3)
    assert time.monotonic() - t < 20
    assert got["a"]["timed_out"] and "loading the model" in got["a"]["log_tail"] and not got["a"]["started"]
    assert got["b"] == {"argv": exits, "env": {"X": "1"}, "started": False, "exit": 3,
                        "log_tail": "refused: verify=full"}
    assert "timed_out" in got["c"]


def test_report_renders_the_one_gpu_section_from_its_committed_text():
    """docs/evidence/gpu-validation.md is rendered by report.py: section 9 comes from tests/gpu/results/tp-one-gpu.md, and the
    committed document holds what that renders."""
    import report
    from test_gpu_report import MACHINE

    root = Path(__file__).resolve().parents[2]
    text = (root / "tests" / "gpu" / "results" / "tp-one-gpu.md").read_text()
    section = f"## 9. {report.ONE_GPU_TP_TITLE}\n\n{text.strip()}\n"
    assert section in report.render([], MACHINE, one_gpu_tp=text)
    assert section in (root / "docs" / "evidence" / "gpu-validation.md").read_text()


def _gloo_sums(rank: int, world: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    rows = torch.randn(2, 4096, generator=g).to(torch.bfloat16)  # a rank's partial sums for two tokens
    alone = rows[:1].clone()
    dist.all_reduce(alone)
    dist.all_reduce(rows)
    if rank == 0:
        torch.save({"alone": alone[0], "batched": rows[0]}, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("world, order_free", [(2, True), (3, False)])
def test_gloos_bf16_sum_of_a_token_depends_on_the_batch_only_beyond_two_ranks(tmp_path, world, order_free):
    """Why a draft changes TP3's logprobs but not TP1's or TP2's (docs/evidence/gpu-validation.md §9): gloo's all-reduce
    sums a token's row in an order that depends on the message size at 3 ranks; with 2 the sum is a + b."""
    import torch
    import torch.multiprocessing as mp

    out = tmp_path / "sums.pt"
    mp.spawn(_gloo_sums, args=(world, f"file://{tmp_path / 'init'}", str(out)), nprocs=world)
    got = torch.load(out)
    assert torch.equal(got["alone"], got["batched"]) is order_free
