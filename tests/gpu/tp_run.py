"""TP on one GPU (docs/evidence/gpu-validation.md §9): stock vLLM 0.33.0's own GPU model at tensor-parallel size 2
and 3, every worker on the one H200, serving TP2 and TP3 rank files; tokens against TP1; the MTP and DSpark
drafts at TP1 and TP3; a flipped expert byte refused by the rank that owns it.

    LUCIFER_RUN=tests/gpu/tp_run.py bash tests/gpu/serve-run.sh      # the kit installed, then this script

Three GPUs run the same script with `--gpus 3`: no harness replacement, NCCL and CUDA graphs as vLLM
chooses. With `--gpus 1` (the default when one GPU is visible) the harness replaces four pieces of vLLM
behaviour, for the servers of TP > 1 only, each because several ranks share one device:

* `ParallelConfig.get_local_gpu_index` returns 0 (tests/gpu/hooks/sitecustomize.py): vLLM gives worker r
  `cuda:r` (vllm/v1/worker/gpu_worker.py `init_device`), and only `cuda:0` exists;
* `CudaPlatformBase.dist_backend` is "gloo" (the same hook): NCCL refuses two ranks on one GPU
  (`ncclInvalidUsage`, measured on this H200), while gloo runs every collective vLLM uses on CUDA tensors
  (staged through the host); vLLM's `CudaCommunicator` falls back to `torch.distributed` on its device
  group once PyNccl is off (`all_reduce`, `all_gather`);
* PyNccl, custom all-reduce and symmetric memory off (`VLLM_DISABLE_PYNCCL=1`,
  `--disable-custom-all-reduce`, `VLLM_ALLREDUCE_USE_SYMM_MEM=0`): each builds a communicator over distinct
  devices;
* `--distributed-executor-backend mp` and `--enforce-eager`: vLLM refuses a world larger than the GPU count
  when it picks the executor itself (vllm/config/parallel.py, "World size ... is larger than the number of
  available GPUs"), and gloo collectives cannot be captured in CUDA graphs.

Every server sizes its KV cache in bytes (serve_run.COMMON), so servers and ranks sharing the GPU do not see
each other's allocations in their profiling.

Phases (each recorded in WORK/results.json as it ends; a later call on the warm machine continues):

    probe     as the serving run's (vLLM, FlashInfer, DeepSeek-V4's NVIDIA model import)
    prepare   `synth forward` (random fill, seed 0) and its DSpark twin (the `forward` geometry with the
              0731 config's DSpark keys and a three-stage drafter); rank files: TP1 sm90 kernel layout, TP2
              model layout, TP3 sm90 model and kernel layout, the DSpark twin at TP1 and TP3; a copy of the TP3
              kernel-layout output with one expert byte of rank 1 flipped
    tp        at once, eager: TP1 and TP2 of vLLM's default loader on the checkpoint, TP2 rank files, TP3 rank
              files in model and kernel layout, the flipped TP3 copy under verify=full (must refuse to start)
    draft     at once, eager: TP1 and TP3 rank files with the MTP draft and without; the DSpark twin likewise;
              greedy tokens with a draft against those without, and vLLM's acceptance counters
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import serve_run as S

sys.path.insert(0, str(S.ROOT / "tests" / "forward"))
import compare  # noqa: E402
from inputs import FLIP_TENSOR, flip_routed_expert_byte  # noqa: E402

PHASES = ("probe", "prepare", "tp", "draft")
# The harness's replacements of vLLM behaviour for TP > 1 on one GPU (module docstring says why, each)
ONE_GPU_ENV = {"LUCIFER_ONE_GPU_TP": "1", "VLLM_DISABLE_PYNCCL": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
ONE_GPU_FLAGS = ["--distributed-executor-backend", "mp", "--disable-custom-all-reduce", "--enforce-eager"]
FLIP_RANK = 1  # a rank other than 0: the refusal must come from the worker that owns the byte
# DeepSeek-V4-Flash-0731's DSpark keys on the `forward` geometry: three SWA stages reading target layers
# 1-3, Markov rank 64 (the `dspark` preset's values; its own head_dim 128 has no FlashMLA kernel)
DSPARK_KEYS = {"compress_ratios": [0, 0, 4, 128, 0, 0, 0], "dspark_block_size": 5, "dspark_noise_token_id": 999,
               "dspark_target_layer_ids": [1, 2, 3], "dspark_markov_rank": 64}
# name -> (source, convert arguments)
CONVERSIONS = {
    "out-tp1": ("model", ["--tp", "1", "--arch", "sm90"]),
    "out-tp2": ("model", ["--tp", "2"]),
    "out-tp3-model": ("model", ["--tp", "3", "--arch", "sm90", "--expert-layout", "model"]),
    "out-tp3-kernel": ("model", ["--tp", "3", "--arch", "sm90"]),
    "dspark-tp1": ("model-dspark", ["--tp", "1", "--arch", "sm90"]),
    "dspark-tp3": ("model-dspark", ["--tp", "3", "--arch", "sm90"]),
}
ACCEPT_METRICS = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                  "vllm:spec_decode_num_drafts_total")


class Plan:
    """How servers of a TP size are started: the harness's one-GPU replacements, or none (`gpus` >= tp)."""

    def __init__(self, gpus: int):
        self.gpus = gpus

    def one_gpu(self, tp: int) -> bool:
        return tp > self.gpus

    def flags(self, tp: int) -> list[str]:
        return ONE_GPU_FLAGS if self.one_gpu(tp) else S.EAGER

    def env(self, tp: int) -> dict[str, str]:
        return ONE_GPU_ENV if self.one_gpu(tp) else {}


def vllm_serve(model: Path, tp: int, plan: Plan) -> tuple[list[str], dict]:
    return S.vllm_serve(model, ["--tensor-parallel-size", str(tp), *plan.flags(tp)]), plan.env(tp)


def lucifer_serve(out: Path, tp: int, plan: Plan, draft: bool = False, verify: str | None = None,
                  moe: str | None = None) -> tuple[list[str], dict]:
    argv = S.lucifer_serve(out, plan.flags(tp), verify=verify, moe=moe)
    if draft:  # serve's own flag, before `--`: it picks vLLM's method (mtp or dspark) from the output
        argv.insert(argv.index("--"), "--draft")
    return argv, plan.env(tp)


def as_compare(gens: list[dict]) -> list[dict]:
    """Server generations in tests/forward/compare.py's form: tokens, and per step [token, logprob] best first."""
    return [{"tokens": g["tokens"],
             "logprobs": [sorted(([int(k.split(":", 1)[1]), v] for k, v in step.items()), key=lambda kv: -kv[1])
                          for step in g["top_logprobs"]]} for g in gens]


def against(ref: dict, other: dict, tau: float | None = None) -> dict:
    """Two servers' short and long generations: bit-identical or not (in all, and per prompt), the largest
    logprob difference before the contexts part, the first differing token per prompt, and (given the TP
    tolerance TAU) what breaks it."""
    a, b = as_compare(ref["short"] + ref["long"]), as_compare(other["short"] + other["long"])
    per = [compare.compare_output(x, y) for x, y in zip(a, b, strict=True)]
    res = {"identical": S.same(ref, other)["identical"],
           "identical_prompts": {k: [x == y for x, y in zip(ref[k], other[k], strict=True)] for k in ("short", "long")},
           "tokens_equal": all(c.first_difference is None for c in per),
           "max_abs_logprob_diff": max(c.max_abs_diff for c in per),
           "first_differences": [c.first_difference for c in per]}
    return res if tau is None else {**res, "violations": compare.violations(a, b, tau)}


def acceptance(text: str) -> dict:
    """vLLM's speculative-decoding counters from its /metrics text (summed over labels), and the rate."""
    got = {m: 0.0 for m in ACCEPT_METRICS}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    drafted = got["vllm:spec_decode_num_draft_tokens_total"]
    rate = got["vllm:spec_decode_num_accepted_tokens_total"] / drafted if drafted else None
    return {"draft_tokens": drafted, "accepted_tokens": got["vllm:spec_decode_num_accepted_tokens_total"],
            "drafts": got["vllm:spec_decode_num_drafts_total"], "acceptance_rate": rate}


def run(specs: dict[str, tuple[list[str], dict]], logs: Path, deadline: float, metrics: bool = False,
        after=None) -> dict:
    """Start every server at once; per server its ready time, generations, load figures (and with METRICS
    vLLM's acceptance counters), or why it did not start, was not ready by DEADLINE or failed a request (its
    log's tail). AFTER(name, server), if given, runs while each answering server is still up; its dict joins
    the server's row."""
    servers = {name: S.Server(name, argv, 8100 + i, logs, env) for i, (name, (argv, env)) in enumerate(specs.items())}
    out = {}
    try:
        for name, s in servers.items():
            row = {"argv": s.argv, "env": s.env}
            try:
                ready = s.wait_ready(deadline)
            except TimeoutError as e:
                out[name] = {**row, "started": False, "timed_out": str(e), "log_tail": s.tail()}
                continue
            if ready is None:
                out[name] = {**row, "started": False, "exit": s.proc.returncode, "log_tail": s.tail()}
                continue
            t = time.monotonic()
            try:
                gens = s.generate()
            except OSError as e:  # the server died or refused mid-run: keep its evidence, go on with the others
                out[name] = {**row, "started": True, "error": f"{type(e).__name__}: {e}", "log_tail": s.tail()}
                continue
            row.update(started=True, ready_s=round(ready, 2), generate_s=round(time.monotonic() - t, 2),
                       **s.load_figures(), generates=gens, repeat_identical=gens["short"] == gens["short_again"])
            if metrics:
                with urllib.request.urlopen(s.url("/metrics"), timeout=10) as r:
                    row["speculative"] = acceptance(r.read().decode())
            if after:
                row.update(after(name, s))
            out[name] = row
    finally:
        stop_all(servers.values())
    return out


def stop_all(servers, grace: float = 10.0) -> None:
    """SIGTERM every server's process group at once, SIGKILL what is left after GRACE seconds: a call cut by
    its time limit must still have time to copy the logs back."""
    live = [s for s in servers if s.proc.poll() is None]
    for s in live:
        os.killpg(s.proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    for s in live:
        try:
            s.proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()


def phase_prepare(work: Path) -> dict:
    res = {}
    if not (work / "prepared").exists():
        for d in ("model", "model-dspark", "flipped-tp3", *CONVERSIONS):
            shutil.rmtree(work / d, ignore_errors=True)
        S.cli("synth", "forward", str(work / "model"), "--fill", "random", "--seed", "0", "--quiet")
        # the DSpark twin: lucifer-shard's own synth with the preset's config extended in that process only
        code = ("import json, sys, lucifer_shard.engine.synth as s; base = s.preset_config; "
                "s.preset_config = lambda *a, **k: {**base(*a, **k), **json.loads(sys.argv[2])}; "
                "s.synth('forward', sys.argv[1], fill='random', seed=0, progress=False)")
        subprocess.run([sys.executable, "-c", code, str(work / "model-dspark"), json.dumps(DSPARK_KEYS)], check=True)
        for name, (source, args) in CONVERSIONS.items():
            S.cli("convert", *args, str(work / source), str(work / name), "--quiet")
        shutil.copytree(work / "out-tp3-kernel", work / "flipped-tp3")
        res["flipped"] = flip_routed_expert_byte(work / "model", work / "flipped-tp3", rank=FLIP_RANK)
        (work / "prepared").write_text(json.dumps(res))
    res = json.loads((work / "prepared").read_text())
    # (no `serve --dry-run` here: each imports vLLM, about 40 s on the H200; every server below runs the same
    # preflight before it execs vLLM)
    res["sizes_bytes"] = {d: sum(f.stat().st_size for f in (work / d).rglob("*.safetensors"))
                          for d in ("model", "model-dspark", *CONVERSIONS)}
    return res


TP_PAIRS = (("ref_tp1", "ref_tp2"), ("ref_tp2", "files_tp2"), ("ref_tp1", "tp3_model"), ("ref_tp1", "tp3_kernel"),
            ("tp3_model", "tp3_kernel"))


def phase_tp(work: Path, logs: Path, plan: Plan, deadline: float) -> dict:
    specs = {"ref_tp1": vllm_serve(work / "model", 1, plan),
             "ref_tp2": vllm_serve(work / "model", 2, plan),
             "files_tp2": lucifer_serve(work / "out-tp2", 2, plan, moe=S.FI),
             "tp3_model": lucifer_serve(work / "out-tp3-model", 3, plan, moe=S.FI),
             "tp3_kernel": lucifer_serve(work / "out-tp3-kernel", 3, plan),
             "flip3_full": lucifer_serve(work / "flipped-tp3", 3, plan, verify="full")}
    res: dict = {"runs": run(specs, logs, deadline), "tau": compare.tolerance(work / "model"), "gain": compare.GAIN}
    text = (logs / "flip3_full.log").read_text(errors="replace") if (logs / "flip3_full.log").exists() else ""
    refusal = [ln for ln in text.splitlines() if "lucifer_tp3: verify=full" in ln]
    res["flip_full_refusal"] = {"started": res["runs"]["flip3_full"]["started"], "lines": refusal[:3],
                                "names_the_tensor": any(FLIP_TENSOR in ln for ln in refusal),
                                "names_the_rank": any(f"rank {FLIP_RANK}" in ln or f"rank-{FLIP_RANK}" in ln
                                                      for ln in refusal)}
    return judge_tp(res)


def judge_tp(res: dict) -> dict:
    """The tp phase's comparisons, from its recorded generations and tau (`--judge` re-runs this on a result)."""
    runs, tau = res["runs"], res["tau"]
    started = {k for k, v in runs.items() if v["started"]}
    res["compare"] = {f"{a} vs {b}": against(runs[a]["generates"], runs[b]["generates"], tau)
                      for a, b in TP_PAIRS if {a, b} <= started}
    own = res["compare"].get("ref_tp1 vs ref_tp2")
    if own:  # vLLM's own TP noise in this run, against the first-order bound tau / GAIN
        first_order = tau / res["gain"]
        res["own_noise"] = {"max_abs_logprob_diff": own["max_abs_logprob_diff"],
                            "gain": own["max_abs_logprob_diff"] / first_order, "within_tau": not own["violations"]}
        for k in ("ref_tp1 vs tp3_model", "ref_tp1 vs tp3_kernel"):
            if k in res["compare"]:
                res["compare"][k]["gain"] = res["compare"][k]["max_abs_logprob_diff"] / first_order
    return res


DRAFT_PAIRS = (("tp1_plain", "mtp_tp1"), ("tp3_plain", "mtp_tp3"), ("dspark_tp1_plain", "dspark_tp1"),
               ("dspark_tp3_plain", "dspark_tp3"))


def phase_draft(work: Path, logs: Path, plan: Plan, deadline: float) -> dict:
    specs = {}
    for plain, drafted in DRAFT_PAIRS:
        tp = 3 if "tp3" in plain else 1
        out = work / ({1: "out-tp1", 3: "out-tp3-kernel"}[tp] if plain.startswith("tp") else f"dspark-tp{tp}")
        specs[plain] = lucifer_serve(out, tp, plan)
        specs[drafted] = lucifer_serve(out, tp, plan, draft=True)
    return judge_draft({"runs": run(specs, logs, deadline, metrics=True), "tau": compare.tolerance(work / "model")})


def judge_draft(res: dict) -> dict:
    """Greedy tokens with a draft against those without, within tau (a draft changes the target's batch
    shapes, so only a TP1 server may be bit-identical), with vLLM's acceptance counters."""
    runs = res["runs"]
    res["compare"] = {f"{plain} vs {drafted}": {**against(runs[plain]["generates"], runs[drafted]["generates"],
                                                          res["tau"]),
                                                "speculative": runs[drafted]["speculative"]}
                      for plain, drafted in DRAFT_PAIRS if runs[plain]["started"] and runs[drafted]["started"]}
    return res


def judge(path: Path) -> None:
    """Re-run the comparisons of a recorded results.json in place (its generations and tau, no GPU)."""
    results = json.loads(path.read_text())
    for phase, fn in (("tp", judge_tp), ("draft", judge_draft)):
        if "runs" in results.get(phase, {}):
            results[phase].setdefault("tau", results.get("tp", {}).get("tau"))
            results[phase] = fn(results[phase])
    path.write_text(json.dumps(results, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/tp-run"))
    ap.add_argument("--out", type=Path, help="where results.json and the server logs are copied")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to spread ranks over (default: those visible); below a server's TP size the "
                         "harness's one-GPU replacements apply to it")
    ap.add_argument("--seconds", type=float, default=560, help="end every phase within this many seconds")
    ap.add_argument("--judge", type=Path, help="only re-run the comparisons of this recorded results.json")
    args = ap.parse_args()
    if args.judge:
        judge(args.judge)
        return 0
    if args.out is None:
        ap.error("--out is required (where results.json and the server logs are copied)")
    import torch

    plan = Plan(args.gpus or torch.cuda.device_count())
    work, logs, path, results, deadline = S.harness_start(args.work, args.seconds)
    try:
        for phase in args.phases.split(","):
            if phase in results and "error" not in results[phase] and results[phase].get("import_ok", True):
                continue  # done by an earlier call on this machine
            if phase != "probe" and "probe" in results and not results["probe"].get("import_ok"):
                print(f"== {phase}: not run, vLLM does not import (probe)", flush=True)
                continue
            t = time.monotonic()
            print(f"== {phase}", flush=True)
            try:
                results[phase] = {"probe": lambda: S.phase_probe(work), "prepare": lambda: phase_prepare(work),
                                  "tp": lambda: phase_tp(work, logs, plan, deadline - 15),
                                  "draft": lambda: phase_draft(work, logs, plan, deadline - 15)}[phase]()
            except Exception as e:  # recorded with the phase; the next phases still run
                results[phase] = {"error": f"{type(e).__name__}: {e}"}
            results[phase]["phase_s"] = round(time.monotonic() - t, 1)
            results[phase]["gpus"] = plan.gpus
            path.write_text(json.dumps(results, indent=1))
            print(json.dumps({phase: S._brief(results[phase])})[:4000], flush=True)
            S._export(path, logs, args.out)
    finally:
        S._export(path, logs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
