"""The Flash geometry on vLLM 0.34.0 on one GPU (docs/evidence/gpu-validation.md §10, issue 55): `synth flash-0731-layer
--layers 2` (the real Flash dimensions: hidden 4096, 64 heads, 256 experts of 2048, vocabulary 129,280, and
DeepSeek-V4-Flash-0731's three-stage DSpark drafter at that size) converted at TP1 and TP3 in model layout,
served by stock vLLM 0.34.0's GPU model with its own SM90 kernels (Marlin MoE, FlashMLA sparse attention,
DeepGEMM FP8 linears; no FlashInfer) against `vllm serve` on the checkpoint.

    LUCIFER_FLASHINFER=none LUCIFER_RUN=tests/gpu/flash_run.py bash tests/gpu/serve-run.sh --phases ...

Servers of TP > 1 on one GPU take tests/gpu/tp_run.py's replacements (gloo, device 0, eager; its docstring
says why each); `--gpus 3` on three GPUs takes none. Phases (each recorded in WORK/results.json as it ends;
a later call on the warm machine continues with the phases still missing):

    probe     as the serving run's (versions; vLLM's extensions and DeepSeek-V4's NVIDIA model import)
    prepare   the checkpoint; TP1 rank files (with the draft where the disk has room for it) and TP3 rank
              files with the draft, converted at once; a hard-linked copy of the TP3 files whose rank-1
              part holding FLIP_TENSOR is a real copy with one expert byte flipped; three `stage`d node
              shares of the TP3 files (hard links)
    first     the first start on the fresh machine (every JIT cache empty): `vllm serve` on the checkpoint
              with CUDA graphs, as soon as synth has written it, split like the startup phase's starts
    tp, graphs, nodes   three waves of servers started at once (WAVES; on a GPU of more than 120 GiB two,
              WAVES_BIG): vLLM TP1 and TP2 on the checkpoint (TP2: vLLM's own TP noise, eager) and TP1 and TP3 rank
              files, eager; vLLM TP1 and TP1 rank files with vLLM's default compilation and CUDA graphs; TP3 rank
              files with the DSpark draft; the flipped TP3 copy under verify=full (must refuse to start); three
              `lucifer-shard serve --nnodes 3 --node-rank R --master-addr 127.0.0.1` processes, each on its own
              share (node 0 answers), after a node given another node's share (refused at preflight); TP1 rank
              files with the DSpark draft, where prepared. PAIRS are compared across waves
    startup   one TP1 server at a time with CUDA graphs: `vllm serve` on the checkpoint and `lucifer-shard
              serve` on the rank files, page cache dropped and vLLM's compile cache empty, then page cache
              warm and the compile cache kept; each start split by vLLM's own log lines (startup_split)
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
from datetime import datetime
from pathlib import Path

import serve_run as S
import tp_run as T

sys.path.insert(0, str(S.ROOT / "tests" / "forward"))
import compare  # noqa: E402
from inputs import FLIP_TENSOR, SHORT  # noqa: E402

PHASES = ("probe", "prepare", "first", "tp", "graphs", "nodes", "startup")
LAYERS = 2  # decoder layers: both hash-routed and sliding-window, as in flash-layer --layers 2
# several servers share the GPU: a small KV cache each, and a utilisation floor below what the others leave free
EXTRA = ["--kv-cache-memory-bytes", "1G", "--gpu-memory-utilization", "0.05"]
MARLIN = S.MARLIN  # what serve picks for sm90 model layout; the checkpoint's servers take the same
DRAFT_ROOM = 12 << 30  # the TP1 draft (three Flash-size stages, about 10 GiB) and some slack
NODES, MASTER_PORT = 3, 29533
BOTH_WAVES_BYTES = 120 << 30
# vLLM's default compilation and CUDA graphs, less its JIT kernel warm-up: at this geometry the warm-up compiles
# all 54 keys of its 10 kernels one after another (CuTe-DSL's serially) before capture, and in the first session
# had not finished DequantGatherKCacheKernel's after 275 s; without it each kernel compiles at its first use, in
# the profile and warm-up runs before capture (vllm/config/vllm.py: what --enforce-eager turns off with graphs)
NO_JIT_WARMUP = ["--kernel-config", '{"enable_jit_warmup": false}']
GRAPHS = S.GRAPHS + NO_JIT_WARMUP
WRONG_SHARE = (1, 2)  # node 2 given node 1's share: refused at its preflight


def vllm_serve(model: Path, tp: int, plan: T.Plan, flags: list[str] | None = None) -> tuple[list[str], dict]:
    own = plan.flags(tp) if flags is None else flags
    return S.vllm_serve(model, ["--tensor-parallel-size", str(tp), *EXTRA, *own], moe=MARLIN), plan.env(tp)


def lucifer_serve(out: Path, tp: int, plan: T.Plan, draft: bool = False, verify: str | None = None,
                  flags: list[str] | None = None) -> tuple[list[str], dict]:
    argv, env = T.lucifer_serve(out, tp, plan, draft=draft, verify=verify)
    if flags is not None:  # the plan's eager flags replaced (graphs at TP1)
        for f in plan.flags(tp):
            argv.remove(f)
        argv += flags
    return argv + EXTRA, env


def node_argv(share: Path, rank: int, plan: T.Plan, nnodes: int = NODES) -> list[str]:
    """`lucifer-shard serve SHARE --nnodes N --node-rank R --master-addr 127.0.0.1`: serve adds --headless
    above node 0; each node runs TP size / N ranks, so with one GPU per node no one-GPU replacement but gloo
    and eager is needed, and those apply only where the nodes share a GPU."""
    argv = [sys.executable, "-m", "lucifer_shard.cli", "serve", str(share), "--nnodes", str(nnodes),
            "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(MASTER_PORT), "--",
            *S.COMMON, *EXTRA]
    return argv + (T.ONE_GPU_FLAGS if plan.one_gpu(NODES) else [])


# ---- prepare -------------------------------------------------------------------------------------------

def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def flip_copy(out: Path, flipped: Path, model: Path, rank: int) -> dict:
    """A copy of OUT by hard links, except rank RANK's part holding FLIP_TENSOR (a real copy), flipped there."""
    from lucifer_shard.formats.stheader import read_header

    from inputs import flip_routed_expert_byte

    shutil.rmtree(flipped, ignore_errors=True)
    shutil.copytree(out, flipped, copy_function=os.link)
    part = next(p for p in sorted((flipped / "target" / f"rank-{rank}").glob("*.safetensors"))
                if FLIP_TENSOR in read_header(p).tensors)
    part.unlink()
    shutil.copyfile(out / part.relative_to(flipped), part)  # its own inode: OUT keeps its byte
    return flip_routed_expert_byte(model, flipped, rank=rank)


def convert_args(tp: int, draft: bool) -> list[str]:
    return ["--tp", str(tp), "--arch", "sm90", "--expert-layout", "model", "--workers", str(tp),
            *([] if draft else ["--no-mtp"])]


def phase_prepare(work: Path) -> dict:
    res: dict = {}
    t = time.monotonic()
    model = work / "model"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        S.cli("synth", "flash-0731-layer", str(model), "--layers", str(LAYERS), "--fill", "random", "--seed", "0",
              "--quiet")
    res["synth_s"] = round(time.monotonic() - t, 1)
    (work / SYNTHESIZED).touch()  # the first start may begin (phase_first)
    size = S.weight_bytes(model)
    # TP1 with the draft only where the disk keeps room for it beside TP3 (about the checkpoint's size)
    tp1_draft = free_bytes(work) > 2 * size + DRAFT_ROOM
    procs = {name: subprocess.Popen([sys.executable, "-m", "lucifer_shard.cli", "convert", *convert_args(tp, d),
                                     str(model), str(work / name), "--quiet", "--force"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, tp, d in (("out-tp1", 1, tp1_draft), ("out-tp3", 3, True))}
    for name, p in procs.items():
        text = p.communicate()[0]
        if p.returncode:
            raise RuntimeError(f"convert {name}: exit {p.returncode}: {text[-2000:]}")
    res["convert_s"] = round(time.monotonic() - t - res["synth_s"], 1)
    res["tp1_draft"] = tp1_draft
    res["flipped"] = flip_copy(work / "out-tp3", work / "flipped-tp3", model, T.FLIP_RANK)
    for r in range(NODES):
        S.cli("stage", str(work / "out-tp3"), str(work / f"share-{r}"), "--nnodes", str(NODES), "--node-rank", str(r),
              "--quiet")
    res["sizes_bytes"] = {d: S.weight_bytes(work / d) for d in ("model", "out-tp1", "out-tp3")}
    res["free_bytes_after"] = free_bytes(work)
    res["tau"] = compare.tolerance(model)
    res["prepare_s"] = round(time.monotonic() - t, 1)
    return res


# ---- the server phases ---------------------------------------------------------------------------------

# Every server of the run, by name: how it is started (from WORK and the plan). Names are unique across waves,
# so any two servers compare, whichever waves they ran in.
SERVERS = {
    "ref_tp1": lambda w, p: vllm_serve(w / "model", 1, p),
    "files_tp1": lambda w, p: lucifer_serve(w / "out-tp1", 1, p),
    "ref_tp2": lambda w, p: vllm_serve(w / "model", 2, p),
    "files_tp3": lambda w, p: lucifer_serve(w / "out-tp3", 3, p),
    "ref_graphs": lambda w, p: vllm_serve(w / "model", 1, p, GRAPHS),
    "files_graphs": lambda w, p: lucifer_serve(w / "out-tp1", 1, p, flags=GRAPHS),
    "dspark_tp3": lambda w, p: lucifer_serve(w / "out-tp3", 3, p, draft=True),
    "flip3_full": lambda w, p: lucifer_serve(w / "flipped-tp3", 3, p, verify="full"),
    "node0": lambda w, p: (node_argv(w / "share-0", 0, p), p.env(NODES)),
    "dspark_tp1": lambda w, p: lucifer_serve(w / "out-tp1", 1, p, draft=True),
}
# Which servers start together in each phase: on an H100 (80 GB) three waves; on a GPU of more than
# BOTH_WAVES_BYTES (an H200) the graphs pair joins the tp wave and the nodes the graphs wave.
WAVES = {"tp": ["ref_tp1", "files_tp1", "ref_tp2", "files_tp3"], "graphs": ["ref_graphs", "files_graphs",
                                                                              "dspark_tp3", "flip3_full"],
         "nodes": ["node0", "dspark_tp1"]}
# a later session (the tp wave and the flip's refusal on record from an earlier one): what it still lacked, with
# the single-node TP3 server (eager) beside the three nodes, whose tokens it must equal
WAVES_LATER = {"tp": [], "graphs": ["ref_graphs", "files_graphs", "dspark_tp3"], "nodes": ["files_tp3", "node0"]}
WAVES_LATER_BIG = {"tp": [], "graphs": WAVES_LATER["graphs"] + WAVES_LATER["nodes"], "nodes": []}
WAVES_BIG = {"tp": WAVES["tp"] + ["ref_graphs", "files_graphs"],
             "graphs": ["dspark_tp3", "flip3_full", "node0", "dspark_tp1"], "nodes": []}
# the comparisons (reference first), each made once both servers have answered
PAIRS = (("ref_tp1", "files_tp1"), ("ref_tp1", "ref_tp2"), ("ref_tp1", "files_tp3"), ("ref_graphs", "files_graphs"),
         ("ref_tp1", "ref_graphs"), ("files_tp1", "files_graphs"), ("files_tp3", "dspark_tp3"),
         ("files_tp3", "node0"), ("files_tp1", "dspark_tp1"))


def phase_wave(names: list[str], work: Path, logs: Path, plan: T.Plan, deadline: float, tp1_draft: bool) -> dict:
    """NAMES started at once (dspark_tp1 only where the TP1 files hold the draft; with node0 its headless nodes
    and the wrong-share refusal first); per server its row and startup_split; the flip's refusal."""
    names = [n for n in names if n != "dspark_tp1" or tp1_draft]
    res: dict = {}
    if "node0" in names:
        res["wrong_share"] = wrong_share(work, logs, plan)
    quiet = headless(work, plan) if "node0" in names else []
    runs, res["headless_exit"] = wave({n: SERVERS[n](work, plan) for n in names}, quiet, logs, deadline)
    res.update(runs=runs, split=splits(runs, logs))
    if "flip3_full" in runs:
        res["flip_full_refusal"] = refusal(logs / "flip3_full.log", runs)
    return res


def all_runs(results: dict) -> dict:
    return {k: v for phase in WAVES for k, v in results.get(phase, {}).get("runs", {}).items()}


def refusal(log: Path, runs: dict) -> dict:
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [ln for ln in text.splitlines() if "lucifer_tp3: verify=full" in ln]
    return {"started": runs["flip3_full"]["started"], "lines": lines[:3],
            "names_the_tensor": any(FLIP_TENSOR in ln for ln in lines),
            "names_the_rank": any(f"rank-{T.FLIP_RANK}" in ln for ln in lines)}


def pairs(runs: dict, wanted, tau: float) -> dict:
    """T.against for each pair whose two servers answered, with its gain over the first-order bound tau / GAIN
    (vLLM's own TP2 noise is ref_tp1 vs ref_tp2); a draft's pair carries vLLM's acceptance counters."""
    out = {}
    for a, b in wanted:
        if "generates" in runs.get(a, {}) and "generates" in runs.get(b, {}):
            c = T.against(runs[a]["generates"], runs[b]["generates"], tau)
            c["gain"] = c["max_abs_logprob_diff"] / (tau / compare.GAIN)
            if "speculative" in runs[b] and "dspark" in b:
                c["speculative"] = runs[b]["speculative"]
            out[f"{a} vs {b}"] = c
    return out


def headless(work: Path, plan: T.Plan) -> list[tuple[str, list[str], dict]]:
    return [(f"node{r}", node_argv(work / f"share-{r}", r, plan), plan.env(NODES)) for r in range(1, NODES)]


def wave(specs: dict, quiet: list[tuple[str, list[str], dict]], logs: Path, deadline: float) -> tuple[dict, list]:
    """T.run of SPECS (with vLLM's /metrics), with QUIET processes (headless nodes: no API) started beside them,
    each logging to LOGS/<name>.log, and stopped with them; their exit codes (None: still running)."""
    procs = [subprocess.Popen(argv, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True, env={**os.environ, **env}) for name, argv, env in quiet]
    try:
        return T.run(specs, logs, deadline, metrics=True, after=smoke), [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def smoke(name: str, server: S.Server) -> dict:
    """`lucifer-shard smoke URL --expect-draft --prompts tokens --json` against a server with the DSpark draft,
    where this checkout's CLI has the command (issue 55, item 6): token ids, since the synthetic checkpoint has
    no tokenizer and the server runs with --skip-tokenizer-init (issue 65, item 2). Its exit code, its verdict
    with every check and the per-position acceptance it read from vLLM's /metrics; the random-fill drafter is
    expected to fail the drafter check: what runs here is the command against a GPU server."""
    if "dspark" not in name or S.sh([sys.executable, "-m", "lucifer_shard.cli", "smoke", "--help"]).returncode:
        return {}
    try:
        r = S.sh([sys.executable, "-m", "lucifer_shard.cli", "smoke", server.url(""), "--expect-draft", "--prompts",
                  "tokens", "--json", "--timeout", "60"], timeout=75)
    except subprocess.TimeoutExpired:
        return {"smoke": {"exit": None, "tail": "smoke did not end within 75 s"}}
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = {}
    return {"smoke": {"exit": r.returncode, "result": doc.get("result"), "error": doc.get("error"),
                      "tail": (r.stdout + r.stderr)[-3000:] if not doc else r.stderr[-1000:]}}


def wrong_share(work: Path, logs: Path, plan: T.Plan) -> dict:
    """Node WRONG_SHARE[1] started on node WRONG_SHARE[0]'s share: serve's preflight must refuse it, before vLLM."""
    have, claim = WRONG_SHARE
    log = logs / "wrong_share.log"
    p = subprocess.Popen(node_argv(work / f"share-{have}", claim, plan) + ["--port", "8190"], stdout=open(log, "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = p.wait(120)
    except subprocess.TimeoutExpired:  # not refused: vLLM is starting
        os.killpg(p.pid, signal.SIGKILL)
        code = None
    text = log.read_text(errors="replace")
    return {"exit": code, "refused_before_vllm": bool(code) and "Initializing a V1 LLM engine" not in text,
            "lines": [ln for ln in text.splitlines() if ln.strip()][-4:]}


# ---- where a start goes --------------------------------------------------------------------------------

STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")
# vLLM 0.34.0's own lines for each step of a start (first match each), with the figure each one states
EVENTS = {
    "engine": (re.compile(r"Initializing a V1 LLM engine"), None),
    "model_init": (re.compile(r"Initializing model took ([\d.]+) seconds"), "model_init_s"),
    "weights_read": (re.compile(r"Loading weights took ([\d.]+) seconds"), "loading_weights_s"),
    "loaded": (re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds"), "model_loading_s"),
    "jit_warmup": (re.compile(r"JIT kernel warmup \(\d+ compile keys\)"), None),
    "compiled": (re.compile(r"torch\.compile took ([\d.]+) s in total"), "torch_compile_s"),
    "kv": (re.compile(r"GPU KV cache size: ([\d,]+) tokens"), None),
    "captured": (re.compile(r"Graph capturing finished in (\d+) secs"), "graph_capture_s"),
    "engine_ready": (re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
                     "init_engine_s"),
    "serving": (re.compile(r"Starting vLLM server on"), None),
}
CACHE_HIT = re.compile(r"Directly load the compiled graph|Directly load the \S+ graph")


def _stamp(line: str, year: int) -> float | None:
    m = STAMP.search(line)
    return datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp() if m else None


def startup_split(text: str, year: int = 2026) -> dict:
    """A server log's start, from vLLM's own lines: each step's figure where vLLM states one (seconds), and
    the seconds (log resolution) from the first line to each step; whether a compiled graph came from the
    compile cache. Steps a start does not take (eager: compile, capture) are absent."""
    lines = text.splitlines()
    first = next((t for t in map(lambda ln: _stamp(ln, year), lines) if t is not None), None)
    out: dict = {"at_s": {}}
    for name, (pattern, figure) in EVENTS.items():
        for ln in lines:
            m = pattern.search(ln)
            if m:
                if figure:
                    out[figure] = float(m.group(2 if name == "loaded" else 1).replace(",", ""))
                t = _stamp(ln, year)
                if t is not None and first is not None:
                    out["at_s"][name] = t - first
                break
    m = re.search(r"warmup model\) took [\d.]+ s \(compilation: ([\d.]+) s", text)
    if m:
        out["compilation_s"] = float(m.group(1))
    out["compile_cache_hit"] = bool(CACHE_HIT.search(text))
    return out


def splits(runs: dict, logs: Path) -> dict:
    return {name: startup_split((logs / f"{name}.log").read_text(errors="replace"))
            for name in runs if (logs / f"{name}.log").exists()}


SYNTHESIZED = "synthesized"


def phase_first(work: Path, logs: Path, deadline: float) -> dict:
    """The first start on a fresh machine: `vllm serve` on the checkpoint with CUDA graphs, as soon as synth has
    written it (the conversions still running beside it), every JIT cache empty; its ready and first-token
    seconds and startup_split. It fills the kernel caches every later start of the run reads."""
    while not (work / SYNTHESIZED).exists():
        if time.monotonic() > deadline:
            return {"error": "the checkpoint was not written in time"}
        time.sleep(5)
    argv, _ = vllm_serve(work / "model", 1, T.Plan(1), S.GRAPHS)
    return {**one_start("first_default_graphs", argv, logs, deadline), "argv": argv}


def one_start(name: str, argv: list[str], logs: Path, deadline: float, env: dict | None = None) -> dict:
    """Start one server, ask for one token once it is ready, stop it: its ready and first-token seconds (from
    process start) and startup_split of its log."""
    s = S.Server(name, argv, 8300, logs, env)
    row: dict = {"machine": S.MACHINE}
    try:
        ready = s.wait_ready(deadline)
        row["ready_s"] = ready and round(ready, 2)
        if ready is not None:
            s.complete(SHORT[0], 1)
            row["first_token_s"] = round(time.monotonic() - s.t0, 2)
        else:
            row["log_tail"] = s.tail()
    except TimeoutError as e:
        row["timed_out"] = str(e)
        # where it waits: every Python process of the server prints its threads' stacks (PYTHONFAULTHANDLER)
        os.killpg(s.proc.pid, signal.SIGABRT)
        time.sleep(5)
        row["log_tail"] = s.tail(120)
    finally:
        s.stop()
    row["split"] = startup_split(s.log.read_text(errors="replace"))
    return row


STARTS = (("default", "cold"), ("lucifer", "cold"), ("default", "warm"), ("lucifer", "warm"), ("default", "jit"))


def phase_startup(work: Path, logs: Path, deadline: float, done: dict, save) -> dict:
    """STARTS one at a time, CUDA graphs without the JIT warm-up (GRAPHS): cold = page cache dropped and this
    loader's vLLM cache root (torch.compile's cache) emptied; warm = the weights just read by the cold start and
    its cache kept; jit = warm, with vLLM's JIT kernel warm-up too (its full default), last, as far as the call's
    time lets it go. Per start: ready and first-token seconds, startup_split of its log. Continues DONE (a cut
    call's rows)."""
    plan = T.Plan(1)
    res = dict(done)
    argv = {"default": vllm_serve(work / "model", 1, plan, GRAPHS)[0],
            "lucifer": lucifer_serve(work / "out-tp1", 1, plan, flags=GRAPHS)[0]}
    for loader, mode in STARTS:
        key = f"{loader}_{mode}"
        if key in res:
            continue
        if deadline - time.monotonic() < 150:
            res["stopped_early"] = f"before {key}: the call's time was running out"
            return res
        cache = work / f"vllm-cache-{loader}"
        if mode == "cold":
            shutil.rmtree(cache, ignore_errors=True)
            S.drop_caches()
        start = vllm_serve(work / "model", 1, plan, S.GRAPHS)[0] if mode == "jit" else argv[loader]
        row = one_start(f"startup_{key}", start, logs, max(deadline - 15, time.monotonic() + 10),
                        {"VLLM_CACHE_ROOT": str(cache), "PYTHONFAULTHANDLER": "1"})
        res[key] = row
        save(res)
    res.pop("stopped_early", None)
    res["complete"] = True
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/flash_run"))
    ap.add_argument("--out", type=Path, required=True, help="where results.json and the server logs are copied")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to spread ranks over (default: those visible)")
    ap.add_argument("--seconds", type=float, default=560, help="end every phase within this many seconds")
    ap.add_argument("--later", action="store_true", help="WAVES_LATER: what a session after the first still lacked")
    args = ap.parse_args()
    import torch

    plan = T.Plan(args.gpus or torch.cuda.device_count())
    big = torch.cuda.get_device_properties(0).total_memory > BOTH_WAVES_BYTES
    waves = (WAVES_LATER_BIG if big else WAVES_LATER) if args.later else (WAVES_BIG if big else WAVES)
    work, logs, path, results, deadline = S.harness_start(args.work, args.seconds)

    def save(partial: dict | None = None) -> None:
        if partial is not None:
            results["startup"] = partial
        write_merged(path, results)

    try:
        for phase in args.phases.split(","):
            if S._done(results.get(phase)):
                continue
            if phase not in ("probe", "prepare", "first") and not awaited(path, results, "tau", deadline - 200):
                print(f"== {phase}: not run, prepare has not finished", flush=True)
                continue
            t = time.monotonic()
            print(f"== {phase}", flush=True)
            prep, left = results.get("prepare", {}), deadline - 15
            try:
                results[phase] = {
                    "probe": lambda: S.phase_probe(work), "prepare": lambda: phase_prepare(work),
                    "first": lambda: phase_first(work, logs, left),
                    **{w: (lambda w=w: phase_wave(waves[w], work, logs, plan, left, prep["tp1_draft"])) for w in WAVES},
                    "startup": lambda: phase_startup(work, logs, deadline, dict(results.get("startup", {})), save),
                }[phase]()
            except Exception as e:  # recorded with the phase; the next phases still run
                results[phase] = {"error": f"{type(e).__name__}: {e}"}
            cut = [k for k, v in results[phase].get("runs", {}).items() if "timed_out" in v]
            if cut:  # the call's time ran out before these answered: the next call runs the phase again
                results[phase]["stopped_early"] = f"not ready in time: {', '.join(cut)}"
            if phase in WAVES:
                results["compare"] = pairs(all_runs(results), PAIRS, prep["tau"])
                results["tau"] = prep["tau"]
            results[phase]["phase_s"] = round(time.monotonic() - t, 1)
            results[phase]["gpus"] = plan.gpus
            save()
            print(json.dumps({phase: S._brief(results[phase])})[:4000], flush=True)
            S._export(path, logs, args.out)
    finally:
        S._export(path, logs, args.out)
    return 0


def write_merged(path: Path, results: dict) -> None:
    """RESULTS into PATH, keeping the phases another process wrote there meanwhile (prepare runs in the background
    while the first start is measured)."""
    if path.exists():
        for phase, value in json.loads(path.read_text()).items():
            results.setdefault(phase, value)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def awaited(path: Path, results: dict, key: str, until: float) -> bool:
    """Whether prepare's KEY is in RESULTS, taking it from PATH (a background prepare) as it appears, until UNTIL."""
    while key not in results.get("prepare", {}):
        if path.exists():
            results.setdefault("prepare", json.loads(path.read_text()).get("prepare", {}))
            if key in results["prepare"]:
                break
            results.pop("prepare")
        if time.monotonic() > until:
            return False
        time.sleep(5)
    return True


if __name__ == "__main__":
    sys.exit(main())
