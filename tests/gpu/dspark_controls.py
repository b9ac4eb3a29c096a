"""DSpark at TP3: the control runs (issue 65, item 1; docs/evidence/gpu-validation.md §11). Whose is the greedy
output the DSpark server leaves beyond tau at TP3: vLLM's own multi-token verification, or the plugin's virtual TP?

    LUCIFER_FLASHINFER=none LUCIFER_RUN=tests/gpu/dspark_controls.py bash tests/gpu/serve-run.sh --phases ...

The checkpoint and TP3 rank files of tests/gpu/flash_run.py (`synth flash-0731-layer --layers 2`, model layout,
sm90, with the DSpark drafter; the same work folder, so a prepare of either serves both). Every server eager,
greedy, the serving run's prompts, top-5 logprobs; TP > 1 on one GPU with tp_run's replacements (gloo, device 0).

    prepare   synth and the TP3 conversion with the draft only (no TP1 files, flipped copy or node shares)
    w1        the two controls that decide whose it is: vLLM's own loader on the checkpoint at TP1 with DSpark
              (k=5) and the TP3 rank files with `serve --draft --draft-tokens 1`; vLLM's TP1 without a draft
    w2        the TP3 rank files without and with `serve --draft` (k=5)
    w3        vLLM's own loader at TP2 without and with DSpark (k=5); at TP1 with DSpark k=1
Waves sized for an 80 GB H100 by the memory each server took on 2026-12-08 (ref TP1 11.3 GiB, TP3 files 3 x 5.9,
TP3 files k=5 3 x 8.9, ref TP1 k=5 over 21.8): four servers at once ran out of memory there.
(on a GPU of more than 120 GiB w1 and w2 start as one wave.) Per pair: flash_run's comparison, and per prompt
each step's largest |dlogprob|, the first parting step, the reference's top-2 margin there and both top-5 lists.
The servers without a draft are also asked the three short prompts at once (CONCURRENT): the target then runs
several tokens a step with no draft and no multi-token query per sequence, so the gloo sum order of §9 changes
as it does under a draft; their answers against their own one-at-a-time answers separate the two.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import flash_run as F
import serve_run as S
import tp_run as T

sys.path.insert(0, str(S.ROOT / "tests" / "forward"))
import compare  # noqa: E402
from inputs import SHORT, SHORT_STEPS  # noqa: E402


def spec(k: int) -> list[str]:
    doc = {"method": "dspark", "num_speculative_tokens": k}
    return ["--speculative-config", json.dumps(doc, separators=(",", ":"))]


def ref(w: Path, p: T.Plan, tp: int, k: int | None = None) -> tuple[list[str], dict]:
    argv, env = F.vllm_serve(w / "model", tp, p)
    return argv + (spec(k) if k else []), env


def files(w: Path, p: T.Plan, k: int | None = None) -> tuple[list[str], dict]:
    argv, env = F.lucifer_serve(w / "out-tp3", 3, p, draft=bool(k))
    if k and k != 5:  # the manifest's default for DSpark is 5
        argv[argv.index("--draft") + 1:argv.index("--draft") + 1] = ["--draft-tokens", str(k)]
    return argv, env


SERVERS = {
    "ref_tp1": lambda w, p: ref(w, p, 1),
    "ref_tp1_k5": lambda w, p: ref(w, p, 1, 5),
    "files_tp3": lambda w, p: files(w, p),
    "files_tp3_k5": lambda w, p: files(w, p, 5),
    "files_tp3_k1": lambda w, p: files(w, p, 1),
    "ref_tp2": lambda w, p: ref(w, p, 2),
    "ref_tp2_k5": lambda w, p: ref(w, p, 2, 5),
    "ref_tp1_k1": lambda w, p: ref(w, p, 1, 1),
}
WAVES = {"w1": ["ref_tp1_k5", "files_tp3_k1", "ref_tp1"], "w2": ["files_tp3", "files_tp3_k5"],
         "w3": ["ref_tp2", "ref_tp2_k5", "ref_tp1_k1"]}
WAVES_BIG = {"w1": WAVES["w1"] + WAVES["w2"], "w2": [], "w3": WAVES["w3"]}
PAIRS = (("ref_tp1", "ref_tp1_k5"), ("files_tp3", "files_tp3_k5"), ("files_tp3", "files_tp3_k1"),
         ("ref_tp2", "ref_tp2_k5"), ("ref_tp1", "ref_tp1_k1"), ("ref_tp1", "files_tp3"), ("ref_tp1", "ref_tp2"),
         ("ref_tp1_k5", "files_tp3_k5"), ("files_tp3_k1", "files_tp3_k5"))
PROMPTS = ("short 0", "short 1", "short 2", "long")
CONCURRENT = ("ref_tp1", "files_tp3", "ref_tp2")


def concurrent(name: str, server: S.Server) -> dict:
    """T.run's after-hook: the three short prompts sent at once to a server without a draft."""
    if name not in CONCURRENT:
        return {}
    try:
        with ThreadPoolExecutor(len(SHORT)) as ex:
            return {"concurrent_short": list(ex.map(lambda p: server.complete(p, SHORT_STEPS), SHORT))}
    except OSError as e:
        return {"concurrent_error": f"{type(e).__name__}: {e}"}


def concurrent_compare(runs: dict, tau: float) -> dict:
    """Each CONCURRENT server's short answers asked at once against the same server's one at a time."""
    out = {}
    for name in CONCURRENT:
        row = runs.get(name, {})
        if "concurrent_short" not in row or "generates" not in row:
            continue
        a, b = T.as_compare(row["generates"]["short"]), T.as_compare(row["concurrent_short"])
        per = [compare.compare_output(x, y) for x, y in zip(a, b, strict=True)]
        out[f"{name} one at a time vs at once"] = {
            "identical": row["generates"]["short"] == row["concurrent_short"],
            "max_abs_logprob_diff": max(c.max_abs_diff for c in per),
            "first_differences": [c.first_difference for c in per], "violations": compare.violations(a, b, tau),
            "per_prompt": [{"diffs": [round(d, 4) for d in c.diffs], "first_difference": c.first_difference,
                            "margin_there": c.margin_there} for c in per]}
    return out


def detail(a: dict, b: dict) -> list[dict]:
    """Per prompt: each step's largest |dlogprob| (compare.compare_output), the first parting step, the reference's
    top-2 margin there, and both top-5 lists at that step and at the largest difference."""
    out = []
    for name, x, y in zip(PROMPTS, T.as_compare(a["short"] + a["long"]), T.as_compare(b["short"] + b["long"]),
                          strict=True):
        c = compare.compare_output(x, y)
        worst = max(range(len(c.diffs)), key=lambda i: c.diffs[i])
        row = {"prompt": name, "steps": c.steps, "diffs": [round(d, 4) for d in c.diffs],
               "first_difference": c.first_difference, "margin_there": c.margin_there, "worst_step": worst,
               "worst": {"a": x["logprobs"][worst], "b": y["logprobs"][worst]}}
        if c.first_difference is not None:
            i = c.first_difference
            row["at_parting"] = {"a": x["logprobs"][i], "b": y["logprobs"][i]}
        out.append(row)
    return out


def compare_pairs(runs: dict, tau: float) -> dict:
    res = F.pairs(runs, PAIRS, tau)
    for a, b in PAIRS:
        key = f"{a} vs {b}"
        if key in res:
            res[key]["per_prompt"] = detail(runs[a]["generates"], runs[b]["generates"])
            if "speculative" in runs[b]:
                res[key]["speculative"] = runs[b]["speculative"]
    return res


def phase_prepare(work: Path) -> dict:
    res: dict = {}
    t = time.monotonic()
    model = work / "model"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        S.cli("synth", "flash-0731-layer", str(model), "--layers", str(F.LAYERS), "--fill", "random", "--seed", "0",
              "--quiet")
    res["synth_s"] = round(time.monotonic() - t, 1)
    if not (work / "out-tp3" / "manifest.json").exists():
        r = subprocess.run([sys.executable, "-m", "lucifer_shard.cli", "convert", *F.convert_args(3, True), str(model),
                            str(work / "out-tp3"), "--quiet", "--force"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"convert: exit {r.returncode}: {(r.stdout + r.stderr)[-2000:]}")
    res["convert_s"] = round(time.monotonic() - t - res["synth_s"], 1)
    res["sizes_bytes"] = {d: S.weight_bytes(work / d) for d in ("model", "out-tp3")}
    res["tau"] = compare.tolerance(model)
    res["prepare_s"] = round(time.monotonic() - t, 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dspark_controls"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", default="prepare,w1,w2,w3")
    ap.add_argument("--seconds", type=float, default=560)
    args = ap.parse_args()
    import torch

    plan = T.Plan(torch.cuda.device_count())
    big = torch.cuda.get_device_properties(0).total_memory > F.BOTH_WAVES_BYTES
    waves = WAVES_BIG if big else WAVES
    work, logs, path, results, deadline = S.harness_start(args.work, args.seconds)
    try:
        for phase in args.phases.split(","):
            if S._done(results.get(phase)):
                continue
            if phase != "prepare" and not F.awaited(path, results, "tau", deadline - 200):
                print(f"== {phase}: not run, prepare has not finished", flush=True)
                continue
            t = time.monotonic()
            print(f"== {phase}", flush=True)
            try:
                if phase == "prepare":
                    results[phase] = phase_prepare(work)
                else:
                    specs = {n: SERVERS[n](work, plan) for n in waves[phase]}
                    runs = T.run(specs, logs, deadline - 15, metrics=True, after=concurrent) if specs else {}
                    results[phase] = {"runs": runs}
                    runs = {k: v for w in WAVES for k, v in results.get(w, {}).get("runs", {}).items()}
                    results["compare"] = compare_pairs(runs, results["prepare"]["tau"])
                    results["compare"].update(concurrent_compare(runs, results["prepare"]["tau"]))
                    results["tau"] = results["prepare"]["tau"]
            except Exception as e:
                results[phase] = {"error": f"{type(e).__name__}: {e}"}
            cut = [k for k, v in results[phase].get("runs", {}).items() if "timed_out" in v]
            if cut:
                results[phase]["stopped_early"] = f"not ready in time: {', '.join(cut)}"
            results[phase]["phase_s"] = round(time.monotonic() - t, 1)
            F.write_merged(path, results)
            print(json.dumps({phase: S._brief(results[phase])})[:3000], flush=True)
            brief = ("tokens_equal", "max_abs_logprob_diff", "first_differences", "violations")
            for k, v in results.get("compare", {}).items():
                print(json.dumps({k: {x: v[x] for x in brief if x in v}}), flush=True)
            S._export(path, logs, args.out)
    finally:
        S._export(path, logs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
