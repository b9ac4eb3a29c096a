"""The serving run on a GPU (docs/gpu-validation.md, "Served on a GPU"): stock vLLM 0.33.0's own
OpenAI-compatible server, started by `lucifer-shard serve` on TP1 rank files and by `vllm serve` on the
original checkpoint (vLLM's default loader), answers the same greedy requests over HTTP; tokens and
logprobs are compared, eager and with CUDA graphs; one flipped expert byte is refused by verify=full and
changes the logprobs under verify=headers; start-up is timed per loader beside the disk's cold-read floor.

    eval "$(bash tests/gpu/vllm-kit-install.sh)" && python3 tests/gpu/serve_run.py --work /tmp/serve --out $OUT

Phases run in order and each is recorded in WORK/results.json as it ends, so a call that runs out of
time is continued by the next one (while the machine stays warm) with the phases still missing:

    probe     versions; vLLM's extensions and DeepSeek-V4's NVIDIA model import on this torch
    prepare   `synth forward` (random fill) and `convert --tp 1 --arch sm90`, model and kernel layout; the
              flipped copy; the doctor's report on each output
    eager     four servers at once, --enforce-eager: the checkpoint, the rank files, the flipped copy
              (verify=headers) and the flipped copy with verify=full (must refuse to start)
    graphs    the checkpoint and the rank files with vLLM's default compilation and CUDA graphs
    startup   process start to first token and vLLM's "Model loading took" per loader, REPS times each,
              one server at a time, the page cache dropped before each start; the disk's cold-read floor
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "forward"))
from inputs import FLIP_TENSOR, LONG, LONG_STEPS, SHORT, SHORT_STEPS, flip_routed_expert_byte  # noqa: E402

PHASES = ("probe", "prepare", "eager", "graphs", "startup")
LOGPROBS = 5
# The same engine flags for every server: the KV cache is sized by bytes, not by a share of free memory,
# so servers started together on one GPU do not see each other's allocations in their profiling.
COMMON = ["--max-model-len", "4096", "--max-num-seqs", "4", "--seed", "0", "--skip-tokenizer-init",
          "--return-tokens-as-token-ids", "--gpu-memory-utilization", "0.15", "--kv-cache-memory-bytes", "2G",
          "--attention-backend", "FLASHMLA_SPARSE_DSV4", "--moe-backend", "marlin"]
EAGER = ["--enforce-eager"]
# CUDA graphs: vLLM's default (torch.compile, piecewise and full graphs) first; if that cannot start on
# this torch, full graphs of the uncompiled model (decode only).
GRAPHS = ([], ["--compilation-config", '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'])
STARTUP_REPS = 3
LOAD_RE = re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds")


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def cli(*args: str) -> str:
    r = sh([sys.executable, "-m", "lucifer_shard.cli", *args])
    if r.returncode not in (0, 1):
        raise RuntimeError(f"lucifer-shard {' '.join(args)}: exit {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


class Server:
    """One `vllm serve` process (started directly or through `lucifer-shard serve`), its log and timings."""

    def __init__(self, name: str, argv: list[str], port: int, logs: Path):
        self.name, self.port, self.log = name, port, logs / f"{name}.log"
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv + ["--port", str(port)], stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.argv = argv

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float) -> float | None:
        """Seconds from process start until /health answers; None if the process ended first."""
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                return None
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: not ready after {timeout:.0f} s")

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = json.dumps({"model": self.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "logprobs": LOGPROBS, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url("/v1/completions"), body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            choice = json.load(r)["choices"][0]
        lp = choice["logprobs"]
        return {"tokens": [int(t.split(":", 1)[1]) for t in lp["tokens"]], "token_logprobs": lp["token_logprobs"],
                "top_logprobs": lp["top_logprobs"]}

    def model(self) -> str:
        with urllib.request.urlopen(self.url("/v1/models"), timeout=10) as r:
            return json.load(r)["data"][0]["id"]

    def generate(self) -> dict:
        return {"short": [self.complete(p, SHORT_STEPS) for p in SHORT],
                "short_again": [self.complete(p, SHORT_STEPS) for p in SHORT],
                "long": [self.complete(p, LONG_STEPS) for p in LONG]}

    def load_figures(self) -> dict:
        text = self.log.read_text(errors="replace")
        m = LOAD_RE.search(text)
        return {"model_loading_gib": float(m.group(1)), "model_loading_s": float(m.group(2))} if m else {}

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def vllm_serve(model: Path, extra: list[str]) -> list[str]:
    return ["vllm", "serve", str(model), *COMMON, *extra]


def lucifer_serve(out: Path, extra: list[str], verify: str | None = None) -> list[str]:
    # lucifer-shard serve owns --tensor-parallel-size, --load-format and the two backends (from the arch
    # in the manifest); everything after `--` goes to vLLM.
    own = [a for i, a in enumerate(COMMON) if a not in ("--attention-backend", "--moe-backend")
           and COMMON[i - 1] not in ("--attention-backend", "--moe-backend")]
    cfg = ["--model-loader-extra-config", json.dumps({"verify": verify})] if verify else []
    return [sys.executable, "-m", "lucifer_shard.cli", "serve", str(out), "--", *own, *extra, *cfg]


def run_servers(specs: dict[str, list[str]], logs: Path, timeout: float) -> dict:
    """Start every server at once, then per server: ready time, the generations, load figures; or why
    it did not start (the log's tail)."""
    servers = {name: Server(name, argv, 8100 + i, logs) for i, (name, argv) in enumerate(specs.items())}
    out = {}
    try:
        for name, s in servers.items():
            ready = s.wait_ready(timeout - (time.monotonic() - s.t0))
            if ready is None:
                out[name] = {"argv": s.argv, "started": False, "exit": s.proc.returncode, "log_tail": s.tail()}
                continue
            t = time.monotonic()
            gens = s.generate()
            out[name] = {"argv": s.argv, "started": True, "ready_s": round(ready, 2),
                         "generate_s": round(time.monotonic() - t, 2), **s.load_figures(), "generates": gens}
    finally:
        for s in servers.values():
            s.stop()
    return out


def same(a: dict, b: dict) -> dict:
    """Tokens and logprobs of two servers' generations: equal bit for bit, and the largest difference."""
    diffs, equal_tokens = [], True
    for key in ("short", "long"):
        for x, y in zip(a[key], b[key]):
            equal_tokens &= x["tokens"] == y["tokens"]
            diffs += [abs(p - q) for p, q in zip(x["token_logprobs"], y["token_logprobs"])]
    return {"tokens_equal": equal_tokens, "identical": a == b, "max_abs_logprob_diff": max(diffs) if diffs else None}


def phase_probe(work: Path) -> dict:
    import torch

    code = ("import vllm, vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch, vllm._flashmla_C;"
            "from vllm.models.deepseek_v4.nvidia import model;"
            "import tilelang; from vllm.utils import deep_gemm as dg;"
            "print(vllm.__version__, tilelang.__version__, dg.is_deep_gemm_supported())")
    t = time.monotonic()
    r = sh([sys.executable, "-c", code])
    build = sh([sys.executable, "-m", "lucifer_shard.runtime_shim.compat", "tree",
                str(Path(__import__("vllm").__file__).parent.parent)]) if r.returncode == 0 else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)), "python": sys.version.split()[0],
            "import_ok": r.returncode == 0, "import_s": round(time.monotonic() - t, 1),
            "import_out": (r.stdout + r.stderr)[-3000:], "compat_tree": build.stdout[-2000:] if build else None,
            "nvidia_smi": sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"]).stdout}


def phase_prepare(work: Path, swa_only: bool) -> dict:
    model, res = work / "model", {}
    if not (work / "prepared").exists():
        for d in ("model", "out-model", "out-kernel", "flipped"):
            shutil.rmtree(work / d, ignore_errors=True)
        if swa_only:
            # `synth forward` with compress_ratios all 0: lucifer-shard's own synth, its preset changed in
            # that process only (as tests/forward/test_forward.py's synth_with_experts does)
            code = ("import sys, lucifer_shard.engine.synth as s; base = s.preset_config; "
                    "s.preset_config = lambda *a, **k: (lambda c: {**c, 'compress_ratios': [0] * len(c['compress_ratios'])})"
                    "(base(*a, **k)); s.synth('forward', sys.argv[1], fill='random', seed=0, progress=False)")
            subprocess.run([sys.executable, "-c", code, str(model)], check=True)
        else:
            cli("synth", "forward", str(model), "--fill", "random", "--seed", "0", "--quiet")
        cli("convert", "--tp", "1", "--arch", "sm90", "--expert-layout", "model", str(model), str(work / "out-model"),
            "--quiet")
        cli("convert", "--tp", "1", "--arch", "sm90", str(model), str(work / "out-kernel"), "--quiet")
        shutil.copytree(work / "out-model", work / "flipped")
        res["flipped"] = flip_routed_expert_byte(model, work / "flipped")
        (work / "prepared").touch()
    res["sizes_bytes"] = {d: sum(f.stat().st_size for f in (work / d).rglob("*.safetensors"))
                          for d in ("model", "out-model", "out-kernel")}
    for name in () if swa_only else ("out-model", "out-kernel"):  # the dry run prints the doctor's report and the command
        r = sh([sys.executable, "-m", "lucifer_shard.cli", "serve", str(work / name), "--dry-run"])
        res[f"serve_dry_run_{name}"] = {"exit": r.returncode, "output": (r.stdout + r.stderr)[-3000:]}
    return res


def phase_eager(work: Path, logs: Path, timeout: float) -> dict:
    runs = run_servers({"ref_eager": vllm_serve(work / "model", EAGER),
                        "lu_eager": lucifer_serve(work / "out-model", EAGER),
                        "flip_headers": lucifer_serve(work / "flipped", EAGER),
                        "flip_full": lucifer_serve(work / "flipped", EAGER, verify="full")}, logs, timeout)
    res = _summarise(runs, [("ref_eager", "lu_eager"), ("lu_eager", "flip_headers")])
    refusal = [line for line in (logs / "flip_full.log").read_text(errors="replace").splitlines()
               if "lucifer_tp3: verify=full" in line]
    res["flip_full_refusal"] = {"started": runs["flip_full"]["started"], "lines": refusal[:3],
                                "names_the_tensor": any(FLIP_TENSOR in line for line in refusal)}
    return res


def phase_graphs(work: Path, logs: Path, eager: dict, timeout: float) -> dict:
    """Both CUDA-graph variants at once (GRAPHS), the checkpoint and the rank files each."""
    specs = {}
    for i, flags in enumerate(GRAPHS):
        specs[f"ref_graphs{i}"] = vllm_serve(work / "model", flags)
        specs[f"lu_graphs{i}"] = lucifer_serve(work / "out-model", flags)
    runs = run_servers(specs, logs, timeout)
    res = _summarise(runs, [(f"ref_graphs{i}", f"lu_graphs{i}") for i in range(len(GRAPHS))])
    for name in specs:
        e = eager["runs"].get(name.split("_")[0] + "_eager", {})
        if runs[name].get("started") and e.get("started"):
            res["compare"][f"{name} vs {name.split('_')[0]}_eager"] = same(runs[name]["generates"], e["generates"])
    res["variants"] = {f"graphs{i}": flags for i, flags in enumerate(GRAPHS)}
    return res


def _summarise(runs: dict, pairs: list[tuple[str, str]]) -> dict:
    cmp = {}
    for a, b in pairs:
        if runs.get(a, {}).get("started") and runs.get(b, {}).get("started"):
            cmp[f"{a} vs {b}"] = same(runs[a]["generates"], runs[b]["generates"])
    for name, r in runs.items():
        if r.get("started"):
            g = r["generates"]
            r["repeat_identical"] = g["short"] == g["short_again"]
    return {"runs": runs, "compare": cmp}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def cold_read_floor(files: list[Path]) -> dict:
    """Seconds to read FILES from storage after the page cache is dropped (the disk's floor for a load)."""
    dropped = drop_caches()
    t, n = time.monotonic(), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    s = time.monotonic() - t
    return {"bytes": n, "seconds": round(s, 3), "gb_per_s": round(n / s / 1e9, 3), "page_cache_dropped": dropped}


def phase_startup(work: Path, logs: Path, deadline: float) -> dict:
    """One server at a time, page cache dropped first: process start to the first token (a 1-token request
    after /health), and vLLM's own model-loading time."""
    res = {"floor": {d: cold_read_floor(sorted((work / d).rglob("*.safetensors"))) for d in ("model", "out-model")}}
    for rep in range(STARTUP_REPS):
        if deadline - time.monotonic() < 150:  # two more starts would not end in time
            res["stopped_early"] = f"after {rep} repetition(s): the call's time was running out"
            break
        for name, argv in (("default", vllm_serve(work / "model", EAGER)),
                           ("lucifer", lucifer_serve(work / "out-model", EAGER))):
            drop_caches()
            s = Server(f"startup_{name}_{rep}", argv, 8200, logs)
            try:
                ready = s.wait_ready(max(deadline - time.monotonic(), 10))
                row = {"ready_s": ready and round(ready, 2)}
                if ready is not None:
                    s.complete(SHORT[0], 1)
                    row["first_token_s"] = round(time.monotonic() - s.t0, 2)
                    row.update(s.load_figures())
                else:
                    row["log_tail"] = s.tail()
            finally:
                s.stop()
            res.setdefault(name, []).append(row)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/serve-run"))
    ap.add_argument("--out", type=Path, required=True, help="where results.json and the server logs are copied")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--swa-only", action="store_true",
                    help="compress_ratios all 0: no compressor or indexer layer (their CUDA path needs CuTe-DSL)")
    ap.add_argument("--seconds", type=float, default=560, help="end every phase within this many seconds")
    args = ap.parse_args()
    work, logs = args.work, args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")  # compile DeepGEMM kernels at first use only
    # The kit carries no FlashInfer (SM90 serves with FlashMLA and Marlin), but vLLM's GPU sampler imports
    # it unless told not to (v1/sample/ops/topk_topp_sampler.py:118-125); greedy sampling never uses it.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    deadline = time.monotonic() + args.seconds
    # `timeout` (the device call's limit) sends SIGTERM: unwind, so the servers stop and the logs come back
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        _run_phases(args.phases.split(","), results, results_path, work, logs, args.out, deadline, args.swa_only)
    finally:
        _export(results_path, logs, args.out)
    return 0


def _run_phases(phases: list[str], results: dict, results_path: Path, work: Path, logs: Path, out: Path,
                deadline: float, swa_only: bool) -> None:
    for phase in phases:
        if phase in results and "error" not in results[phase] and results[phase].get("import_ok", True):
            continue  # done by an earlier call on this machine
        missing = _missing_prerequisite(phase, results)
        if missing:
            print(f"== {phase}: not run, {missing}", flush=True)
            continue
        left = deadline - time.monotonic() - 15
        t = time.monotonic()
        print(f"== {phase}", flush=True)
        try:
            if phase == "probe":
                results[phase] = phase_probe(work)
            elif phase == "prepare":
                results[phase] = phase_prepare(work, swa_only)
            elif phase == "eager":
                results[phase] = phase_eager(work, logs, min(left, 420))
            elif phase == "graphs":
                results[phase] = phase_graphs(work, logs, results["eager"], left)
            elif phase == "startup":
                results[phase] = phase_startup(work, logs, deadline)
        except Exception as e:  # recorded with the phase; the next phases still run
            results[phase] = {"error": f"{type(e).__name__}: {e}"}
        results[phase]["phase_s"] = round(time.monotonic() - t, 1)
        results_path.write_text(json.dumps(results, indent=1))
        print(json.dumps({phase: _brief(results[phase])})[:3000], flush=True)
        _export(results_path, logs, out)


def _export(results_path: Path, logs: Path, out: Path) -> None:
    """Copy the results and the server logs (one file: the device returns at most 8) into OUT; done after
    every phase, so a call cut off by its time limit still returns what ran."""
    out.mkdir(parents=True, exist_ok=True)
    if results_path.exists():
        shutil.copy(results_path, out / "serve-results.json")
    with open(out / "server-logs.txt", "w") as f:
        for log in sorted(logs.glob("*.log")):
            f.write(f"===== {log.name}\n{log.read_text(errors='replace')[-200_000:]}\n")


def _missing_prerequisite(phase: str, results: dict) -> str | None:
    """Why PHASE cannot run yet (a server needs vLLM to import; graphs and start-up need an eager server
    that started), or None."""
    if phase != "probe" and not results.get("probe", {}).get("import_ok"):
        return "vLLM or DeepSeek-V4's NVIDIA model does not import (probe)"
    if phase in ("graphs", "startup") and not results.get("eager", {}).get("runs", {}).get("ref_eager", {}).get("started"):
        return "the eager reference server did not start"
    return None


def _brief(r: dict) -> dict:
    """The phase's result without the generations, for the call's output."""
    if "runs" in r:
        return {**r, "runs": {k: {x: y for x, y in v.items() if x not in ("generates", "argv")} for k, v in r["runs"].items()}}
    return r


if __name__ == "__main__":
    sys.exit(main())
