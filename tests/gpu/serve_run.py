"""The serving run on a GPU (docs/evidence/gpu-validation.md §8): stock vLLM 0.33.0's own OpenAI-compatible
server, started by `lucifer-shard serve` on TP1 rank files (model layout, and sm90 kernel layout loaded
verbatim) and by `vllm serve` on the original checkpoint (vLLM's default loader), answers the same greedy
requests over HTTP; tokens and logprobs are compared, eager and with CUDA graphs; one flipped byte of a
kernel-layout expert is refused by verify=full and changes the logprobs under verify=headers; vLLM's
post-load step is timed per MoE layer with its peak GPU memory (tests/gpu/hooks/sitecustomize.py), and
start-up per layout beside the disk's cold-read floor.

    bash tests/gpu/serve-run.sh      # the kit installed (vLLM + FlashInfer), then this script

The MoE backend is FlashInfer's CUTLASS (`--moe-backend flashinfer_cutlass`, its SM90 MXFP4 x BF16
variant) for the three servers compared: the kernel-layout files hold that kernel's layout; the
checkpoint and the model-layout files are re-laid into it by vLLM at load. Marlin, what `serve` picks for
model layout on sm90, is compared too (the checkpoint and the model-layout files).

Phases run in order and each is recorded in WORK/results.json as it ends, so a call that runs out of
time is continued by the next one (while the machine stays warm) with the phases still missing:

    probe     versions; vLLM's extensions, FlashInfer's CUTLASS MoE and DeepSeek-V4's NVIDIA model import
    prepare   `synth forward` (random fill) and `convert --tp 1 --arch sm90`, model and kernel layout; a
              flipped copy of the kernel-layout output; serve's dry run on the kernel-layout output
    eager     seven servers at once, --enforce-eager: the checkpoint, the model-layout files (FlashInfer and
              Marlin each), the kernel-layout files, the flipped copy (verify=headers) and the flipped copy
              with verify=full (must refuse to start)
    graphs    the checkpoint, the model-layout and the kernel-layout files with vLLM's default compilation
              and CUDA graphs (FlashInfer MoE)
    startup   process start to first token, vLLM's "Model loading took" and the post-load step per layout,
              REPS times each, one server at a time, the page cache dropped before each start (resumed
              where a cut call left it); the disk's cold-read floor
    load      reading speed inside the server (issue 41): a multi-GB checkpoint of the real Flash dimensions
              (`synth flash-layer --layers 2 --no-mtp`) and its TP1 sm90 kernel-layout files; `vllm serve`
              on the checkpoint against `lucifer-shard serve` on the files, each started cold (page cache
              dropped) then warm (its weights just read), REPS times, one server at a time; vLLM's "Model
              loading took" per start, the disk's cold-read floor (resumed where a cut call left it; on
              a fresh machine, `--continue-load` an earlier call's results.json: its rows count, tagged
              with their machine, and a warm start whose cold one ran there reads its files first)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "forward"))
from inputs import FLIP_TENSOR, LONG, LONG_STEPS, SHORT, SHORT_STEPS, flip_routed_expert_byte  # noqa: E402

PHASES = ("probe", "prepare", "eager", "graphs", "startup", "load")
LOGPROBS = 5
# The same engine flags for every server: the KV cache is sized by bytes, not by a share of free memory,
# so servers started together on one GPU do not see each other's allocations in their profiling. FlashInfer
# comes as the shared/gpu kit (only its SM90 MXFP4 x BF16 MoE module, prebuilt; JIT off): its autotuner and
# its FP8 block GEMM (VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0, set in main) stay off, the default tactic runs.
COMMON = ["--max-model-len", "4096", "--max-num-seqs", "4", "--seed", "0", "--skip-tokenizer-init",
          "--return-tokens-as-token-ids", "--gpu-memory-utilization", "0.15", "--kv-cache-memory-bytes", "2G",
          "--no-enable-flashinfer-autotune"]
ATTENTION = "FLASHMLA_SPARSE_DSV4"  # SM90's DeepSeek-V4 sparse MLA (what serve picks for sm90)
FI, MARLIN = "flashinfer_cutlass", "marlin"
EAGER = ["--enforce-eager"]
GRAPHS = []  # vLLM's default: torch.compile with piecewise and full CUDA graphs
STARTUP_REPS = 3
HARNESS_ENV = {
    "VLLM_DEEP_GEMM_WARMUP": "skip",  # compile DeepGEMM kernels at first use only
    # FlashInfer's sampler is a JIT module too (v1/sample/ops/topk_topp_sampler.py:118-125); greedy sampling
    # never uses it.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    # FlashInfer's FP8 block-scale GEMM (vLLM's first choice for the FP8 linears on SM90 when FlashInfer is
    # present) is a JIT module the kit does not carry; DeepGEMM serves those layers instead
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
}


def machine_id() -> str:
    """This boot of this machine: one call's rows share it; a call on a freshly lent machine has another."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


MACHINE = machine_id()
VERBATIM = "loaded verbatim in kernel layout"  # the loader's line after its post-load checks
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

    def __init__(self, name: str, argv: list[str], port: int, logs: Path, env: dict[str, str] | None = None):
        self.name, self.port, self.log, self.env = name, port, logs / f"{name}.log", env or {}
        self.pwal = logs / f"{name}.pwal"  # tests/gpu/hooks/sitecustomize.py's records of the post-load step
        shutil.rmtree(self.pwal, ignore_errors=True)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv + ["--port", str(port)], stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **self.env, "LUCIFER_PWAL_LOG": str(self.pwal)})
        self.argv = argv

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, deadline: float) -> float | None:
        """Seconds from process start until /health answers; None if the process ended first. DEADLINE is
        a time.monotonic() instant, the same for servers started together (not a span from this one's start)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return None
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except OSError:
                pass
            time.sleep(0.5)
        if self.proc.poll() is not None:  # ended while an earlier server used up the deadline
            return None
        raise TimeoutError(f"{self.name}: not ready after {time.monotonic() - self.t0:.0f} s")

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
        out = {"model_loading_gib": float(m.group(1)), "model_loading_s": float(m.group(2))} if m else {}
        return {**out, **post_load_figures(self.pwal), "verbatim_lines": [ln[ln.index("lucifer_tp3"):] for ln in text.splitlines() if VERBATIM in ln]}

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


def post_load_figures(pwal: Path) -> dict:
    """The post-load step as the hook measured it: per MoE layer (count, backend, how many were loaded in
    kernel layout, total and largest ms) and in all (seconds, GPU memory allocated before it, its peak)."""
    recs = [json.loads(line) for f in sorted(pwal.glob("*.jsonl")) for line in f.read_text().splitlines() if line]
    layers = [r for r in recs if r["what"] == "moe_layer"]
    whole = [r for r in recs if r["what"] == "post_load"]
    out = {}
    if layers:
        ms = [r["ms"] for r in layers]
        out["moe_post_load"] = {"layers": len(layers), "backend": sorted({r["backend"] for r in layers}),
                                "kernel_layout_layers": sum(r["tagged"] for r in layers),
                                "total_ms": round(sum(ms), 3), "max_ms": round(max(ms), 3)}
    if whole:
        w = whole[-1]
        out["post_load"] = {"s": round(w["s"], 4), **{k: w[k] for k in ("allocated_before", "peak", "allocated_after")
                                                      if k in w}}
        if "peak" in w:
            out["post_load"]["transient_bytes"] = w["peak"] - max(w["allocated_before"], w["allocated_after"])
    return out


def vllm_serve(model: Path, extra: list[str], moe: str = FI) -> list[str]:
    return ["vllm", "serve", str(model), *COMMON, "--attention-backend", ATTENTION, "--moe-backend", moe, *extra]


def lucifer_serve(out: Path, extra: list[str], verify: str | None = None, moe: str | None = None) -> list[str]:
    # lucifer-shard serve owns --tensor-parallel-size, --load-format and the backends (from the manifest's arch
    # and expert layout); a model-layout output may be given another MoE backend after `--` (MOE).
    cfg = ["--model-loader-extra-config", json.dumps({"verify": verify})] if verify else []
    backend = ["--moe-backend", moe] if moe else []
    return [sys.executable, "-m", "lucifer_shard.cli", "serve", str(out), "--", *COMMON, *backend, *extra, *cfg]


def run_servers(specs: dict[str, list[str]], logs: Path, timeout: float) -> dict:
    """Start every server at once, then per server: ready time, the generations, load figures; or why
    it did not start (the log's tail)."""
    servers = {name: Server(name, argv, 8100 + i, logs) for i, (name, argv) in enumerate(specs.items())}
    deadline = time.monotonic() + timeout
    out = {}
    try:
        for name, s in servers.items():
            ready = s.wait_ready(deadline)
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


# FlashInfer as vLLM finds it: its version, the CUTLASS MoE vLLM's flashinfer_cutlass backend needs, and the
# prebuilt SM90 module loading (FLASHINFER_DISABLE_JIT: nothing may compile)
FLASHINFER_PROBE = ("import flashinfer, tvm_ffi; from vllm.utils.flashinfer import has_flashinfer_cutlass_fused_moe;"
                    "from flashinfer.fused_moe.core import get_cutlass_fused_moe_module as g; g('90');"
                    "print(flashinfer.__version__, tvm_ffi.__version__, has_flashinfer_cutlass_fused_moe())")


def phase_probe(work: Path) -> dict:
    import torch

    code = ("import vllm, vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch, vllm._flashmla_C;"
            "from vllm.models.deepseek_v4.nvidia import model;"
            "import tilelang; from vllm.utils import deep_gemm as dg;"
            "print(vllm.__version__, tilelang.__version__, dg.is_deep_gemm_supported())")
    t = time.monotonic()
    r = sh([sys.executable, "-c", code])
    build = sh([sys.executable, "-m", "lucifer_shard.runtime_shim.adapt.compat", "tree",
                str(Path(__import__("vllm").__file__).parent.parent)]) if r.returncode == 0 else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)), "python": sys.version.split()[0],
            "import_ok": r.returncode == 0, "import_s": round(time.monotonic() - t, 1),
            "flashinfer": sh([sys.executable, "-c", FLASHINFER_PROBE]).stdout.strip()[-500:],
            "import_out": (r.stdout + r.stderr)[-3000:], "compat_tree": build.stdout[-2000:] if build else None,
            "nvidia_smi": sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"]).stdout}


def phase_prepare(work: Path, swa_only: bool) -> dict:
    """The checkpoint, its TP1 rank files in model and sm90 kernel layout (the default with --arch), a copy of
    the kernel-layout files with one expert byte flipped; serve's dry run on the kernel-layout output."""
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
        shutil.copytree(work / "out-kernel", work / "flipped")
        res["flipped"] = flip_routed_expert_byte(model, work / "flipped")
        (work / "prepared").touch()
    res["sizes_bytes"] = {d: weight_bytes(work / d) for d in ("model", "out-model", "out-kernel")}
    for name in () if swa_only else ("out-kernel",):  # the dry run prints the doctor's report and the command
        r = sh([sys.executable, "-m", "lucifer_shard.cli", "serve", str(work / name), "--dry-run"])
        res[f"serve_dry_run_{name}"] = {"exit": r.returncode, "output": (r.stdout + r.stderr)[-3000:]}
    return res


def phase_eager(work: Path, logs: Path, timeout: float) -> dict:
    runs = run_servers({"ref_eager": vllm_serve(work / "model", EAGER),
                        "model_eager": lucifer_serve(work / "out-model", EAGER, moe=FI),
                        "kernel_eager": lucifer_serve(work / "out-kernel", EAGER),
                        "refmarlin_eager": vllm_serve(work / "model", EAGER, moe=MARLIN),
                        "modelmarlin_eager": lucifer_serve(work / "out-model", EAGER),
                        "flip_headers": lucifer_serve(work / "flipped", EAGER),
                        "flip_full": lucifer_serve(work / "flipped", EAGER, verify="full")}, logs, timeout)
    res = _summarise(runs, [("ref_eager", "model_eager"), ("ref_eager", "kernel_eager"), ("model_eager", "kernel_eager"),
                            ("refmarlin_eager", "modelmarlin_eager"), ("kernel_eager", "flip_headers")])
    refusal = [line for line in (logs / "flip_full.log").read_text(errors="replace").splitlines()
               if "lucifer_tp3: verify=full" in line]
    res["flip_full_refusal"] = {"started": runs["flip_full"]["started"], "lines": refusal[:3],
                                "names_the_tensor": any(FLIP_TENSOR in line for line in refusal)}
    return res


def phase_graphs(work: Path, logs: Path, eager: dict, timeout: float) -> dict:
    """vLLM's default compilation and CUDA graphs: the checkpoint, the model-layout and the kernel-layout files."""
    specs = {"ref_graphs": vllm_serve(work / "model", GRAPHS),
             "model_graphs": lucifer_serve(work / "out-model", GRAPHS, moe=FI),
             "kernel_graphs": lucifer_serve(work / "out-kernel", GRAPHS)}
    runs = run_servers(specs, logs, timeout)
    res = _summarise(runs, [("ref_graphs", "model_graphs"), ("ref_graphs", "kernel_graphs")])
    for name in specs:
        e = eager["runs"].get(name.split("_")[0] + "_eager", {})
        if runs[name].get("started") and e.get("started"):
            res["compare"][f"{name} vs {name.split('_')[0]}_eager"] = same(runs[name]["generates"], e["generates"])
    res["flags"] = GRAPHS or "vLLM's default"
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


def weights(d: Path) -> list[Path]:
    """The safetensors files under D (a checkpoint or an output), in order."""
    return sorted(d.rglob("*.safetensors"))


def weight_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in weights(d))


def read_files(files: list[Path]) -> int:
    """Read FILES once (into the page cache); their bytes."""
    n = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n


def cold_read_floor(files: list[Path]) -> dict:
    """Seconds to read FILES from storage after the page cache is dropped (the disk's floor for a load)."""
    dropped = drop_caches()
    t = time.monotonic()
    n = read_files(files)
    s = time.monotonic() - t
    return {"bytes": n, "seconds": round(s, 3), "gb_per_s": round(n / s / 1e9, 3), "page_cache_dropped": dropped}


STARTUP = ("default", "model", "kernel")  # vLLM's loader on the checkpoint; the two layouts through serve
LOAD_LAYERS = 2  # real Flash layers: both sliding-window and hash-routed, so no compressor kernel is needed
LOADS = ("default", "lucifer")  # `vllm serve` on the checkpoint; `lucifer-shard serve` on its rank files


def phase_startup(work: Path, logs: Path, deadline: float, done: dict, save) -> dict:
    """One server at a time, page cache dropped first: process start to the first token (a 1-token request
    after /health), vLLM's "Model loading took" and the post-load step, all with the FlashInfer MoE.
    Continues DONE (a cut call's rows); `save(res)` after every start, so a call cut off loses one row."""
    res = dict(done)
    res.setdefault("floor", {d: cold_read_floor(weights(work / d)) for d in ("model", "out-model", "out-kernel")})
    argv = {"default": vllm_serve(work / "model", EAGER), "model": lucifer_serve(work / "out-model", EAGER, moe=FI),
            "kernel": lucifer_serve(work / "out-kernel", EAGER)}
    starts = [(rep, name, "cold") for rep in range(STARTUP_REPS) for name in STARTUP]
    return _timed_starts(starts, argv, "startup", logs, deadline, res, save)


def phase_load(work: Path, logs: Path, deadline: float, done: dict, save) -> dict:
    """Issue 41's serving figures: vLLM's "Model loading took" for `vllm serve` on a multi-GB checkpoint and
    `lucifer-shard serve` on its TP1 sm90 kernel-layout files, cold then warm, STARTUP_REPS times each, one
    server at a time (continues DONE, saving after every start)."""
    big, res = work / "big", dict(done)
    res.setdefault("machine", MACHINE)  # the machine of the files and the floor below
    if "sizes_bytes" not in res:
        t = time.monotonic()
        shutil.rmtree(big, ignore_errors=True)
        cli("synth", "flash-layer", str(big / "model"), "--layers", str(LOAD_LAYERS), "--no-mtp", "--quiet")
        cli("convert", "--tp", "1", "--arch", "sm90", str(big / "model"), str(big / "out"), "--quiet")
        res["prepare_s"] = round(time.monotonic() - t, 1)
        res["sizes_bytes"] = {d: weight_bytes(big / d) for d in ("model", "out")}
        save(res)
    res.setdefault("floor", {d: cold_read_floor(weights(big / d)) for d in ("model", "out")})
    # the weights fill more of the GPU than the small model's: one server at a time, so half the GPU is its own
    mem = ["--gpu-memory-utilization", "0.5"]
    argv = {"default": vllm_serve(big / "model", EAGER + mem), "lucifer": lucifer_serve(big / "out", EAGER + mem)}
    starts = [(rep, name, mode) for rep in range(STARTUP_REPS) for name in LOADS for mode in ("cold", "warm")]
    files = {"default": weights(big / "model"), "lucifer": weights(big / "out")}
    res = _timed_starts(starts, argv, "load", logs, deadline, res, save, files)
    res["median_model_loading_s"] = {  # over every row, this call's and those carried from earlier ones
        key: statistics.median(r["model_loading_s"] for r in rows) for key, rows in res.items()
        if key.endswith(("_cold", "_warm")) and rows and all("model_loading_s" in r for r in rows)}
    return res


def carried_load(earlier: dict, label: str) -> dict:
    """An earlier call's load phase (EARLIER: its results.json) to continue on another machine: its per-start
    rows, each tagged with its machine (LABEL for rows from before the tag), and its floor under that
    machine; left unfinished, so this call prepares its own files, measures its own floor and runs the
    starts still missing."""
    load = earlier.get("load", {})
    machine = load.get("machine", label)
    rows = {k: [{"machine": machine, **r} for r in v] for k, v in load.items() if k.endswith(("_cold", "_warm"))}
    floors = dict(load.get("earlier_floors", {}))
    if "floor" in load:
        floors[machine] = load["floor"]
    return {**rows, "earlier_floors": floors, "complete": False}


def _timed_starts(starts: list[tuple[int, str, str]], argv: dict[str, list[str]], phase: str, logs: Path,
                  deadline: float, res: dict, save, files: dict[str, list[Path]] | None = None) -> dict:
    """Each (repetition, server, cold|warm) start in turn, skipping those RES already holds (as rows of
    "<server>" for the start-up phase, "<server>_<mode>" otherwise): the page cache dropped before a cold
    start; for a warm one, the server's weights left cached by its cold start just before, or, where that
    start's row came from an earlier call, read once (its FILES); per start the machine, the ready and
    first-token seconds and vLLM's load figures, saved at once."""
    res["complete"] = False  # until every start has a row: the next call on this machine continues it
    last = None  # the server and mode of the start before, in this call
    for rep, name, mode in starts:
        key = name if phase == "startup" else f"{name}_{mode}"
        if len(res.get(key, [])) > rep:
            continue
        if deadline - time.monotonic() < 100:  # another start would not end in time
            res["stopped_early"] = f"at repetition {rep} of {key}: the call's time was running out"
            return res
        warmed_by_read = mode == "warm" and last != (name, "cold")
        if mode == "cold":
            drop_caches()
        elif warmed_by_read:
            read_files(files[name])
        last = (name, mode)
        s = Server(f"{phase}_{key}_{rep}", argv[name], 8200, logs)
        try:
            try:
                ready = s.wait_ready(max(deadline - 15, time.monotonic() + 10))
            except TimeoutError:  # the call's time ran out during this start: keep the rows so far
                res["stopped_early"] = f"at repetition {rep} of {key}: the call's time ran out"
                return res
            row = {"machine": MACHINE, "ready_s": ready and round(ready, 2)}
            if warmed_by_read:
                row["warmed_by_read"] = True
            if ready is not None:
                s.complete(SHORT[0], 1)
                row["first_token_s"] = round(time.monotonic() - s.t0, 2)
                row.update(s.load_figures())
                row.pop("verbatim_lines", None)
            else:
                row["log_tail"] = s.tail()
        finally:
            s.stop()
        res.setdefault(key, []).append(row)
        save(res)
    res.pop("stopped_early", None)
    res["complete"] = True
    return res


def harness_start(work: Path, seconds: float) -> tuple[Path, Path, Path, dict, float]:
    """What every run's main does first (this one's, tp_run's, flash_run's): the work and log folders, the
    results an earlier call on this machine recorded, the harness's environment, the deadline, and SIGTERM
    (`timeout`, the device call's limit) turned into an unwind, so the servers stop and the logs come back."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = work / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for key, value in HARNESS_ENV.items():
        os.environ.setdefault(key, value)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    return work, logs, path, results, time.monotonic() + seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/serve-run"))
    ap.add_argument("--out", type=Path, required=True, help="where results.json and the server logs are copied")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--swa-only", action="store_true",
                    help="compress_ratios all 0: no compressor or indexer layer (their CUDA path needs CuTe-DSL)")
    ap.add_argument("--seconds", type=float, default=560, help="end every phase within this many seconds")
    ap.add_argument("--continue-load", type=Path, metavar="RESULTS_JSON",
                    help="an earlier call's results (a machine since given back): its load rows count, each "
                         "tagged with its machine, and this call runs the starts still missing")
    args = ap.parse_args()
    work, logs, results_path, results, deadline = harness_start(args.work, args.seconds)
    if args.continue_load and "load" not in results:
        results["load"] = carried_load(json.loads(args.continue_load.read_text()), str(args.continue_load))
    try:
        _run_phases(args.phases.split(","), results, results_path, work, logs, args.out, deadline, args.swa_only)
    finally:
        _export(results_path, logs, args.out)
    return 0


def _run_phases(phases: list[str], results: dict, results_path: Path, work: Path, logs: Path, out: Path,
                deadline: float, swa_only: bool) -> None:
    for phase in phases:
        if _done(results.get(phase)):
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
            elif phase in ("startup", "load"):
                def save(partial: dict, phase: str = phase) -> None:
                    results[phase] = partial
                    results_path.write_text(json.dumps(results, indent=1))
                run = phase_startup if phase == "startup" else phase_load
                results[phase] = run(work, logs, deadline, dict(results.get(phase, {})), save)
        except Exception as e:  # recorded with the phase; the next phases still run
            results[phase] = {"error": f"{type(e).__name__}: {e}"}
        results[phase]["phase_s"] = round(time.monotonic() - t, 1)
        results_path.write_text(json.dumps(results, indent=1))
        print(json.dumps({phase: _brief(results[phase])})[:3000], flush=True)
        _export(results_path, logs, out)


def _done(result: dict | None) -> bool:
    """Whether a phase's recorded result needs no further call: it ran without an error, vLLM imported
    (probe), and every start it owes has its row (startup, load: cut short by a call's time, it goes on)."""
    return result is not None and "error" not in result and result.get("import_ok", True) \
        and result.get("complete", True) and "stopped_early" not in result


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
