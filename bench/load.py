"""The `load` section of `make bench`: server start-up in vLLM's own loaders, side by side.

Per TP size (1, 2, 4), one world of the real-model harness (tests/shim/vllm_cpu_model.py: vLLM's
own DeepSeek-V4 CPU model, one gloo process per rank) loads a `synth flash-layer --layers 1
--no-mtp` checkpoint (exact Flash dimensions, 5.7 GB), every contender `--reps` times, interleaved:

  default                  vLLM's DefaultModelLoader from the original checkpoint
  sharded_state            vLLM's ShardedStateLoader from what the world's first run (a default load)
                           saved with vLLM's own `ShardedStateLoader.save_model`, before post-load
                           processing: the same parameters the rank files hold
  lucifer verify=none|headers|full
                           lucifer_tp3 from `convert --expert-layout model` rank files
  floor                    each rank reads its own rank files once (16 MiB reads), no model

Every run is timed on all ranks at once: rank 0 evicts the bench's files from the page cache
(`posix_fadvise(DONTNEED)` after a sync; not the global drop_caches, which would also evict the
ranks' Python and torch code and charge its re-reading to the load) and waits for a quiet machine
while the others wait at a barrier; then all load, and rank 0 reads the machine's disk and CPU
counters once all have finished. Per run: the load wall (the slowest rank; model construction is
timed apart), per rank /proc/self/io read_bytes and rchar, peak RSS during the load (VmHWM reset
before it: file pages an mmap-based reader touches count) and CPU; a run during which others moved
more than 10% of our bytes is repeated in a fresh world (at most twice).

Two sides: `bench.py` (any Python, no torch) prepares the inputs, runs the worlds and reports through
this module (`load_section`, `summarize_load`; it imports this module, never the reverse, and both share
`measure`); `python bench/load.py _world SPEC.json` is one world, run through
tools/vllm-env.sh in its vLLM venv (the newest vetted release, LUCIFER_VLLM_VERSION picks another).
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from measure import (  # noqa: E402
    DISTURBED, GiB, RETRIES, block_device, cpu_busy_seconds, disk_bytes, drop_caches, files_of, lucifer, rmtree,
    run, synth, tree_bytes, wait_quiet,
)

VERIFY = ("none", "headers", "full")
CONTENDERS = ("floor", "default", "sharded_state", *(f"lucifer verify={v}" for v in VERIFY))
SAVE_RUN = "default + save_model"  # the world's first run: saves the sharded state, warms the code up
WORLD_TIMEOUT_S = 3600
# DeepSeek-V4-Flash as published (docs/design/tensor-plan.md §1): the extrapolation's default-loader input.
FLASH_TP = 3


# ---------------------------------------------------------------- the world side (vLLM venv)


class Hook:
    """Rank 0's part of every run (see vllm_cpu_model.measured_load): evict the bench's files, wait
    for a quiet machine, and count the machine's disk bytes and busy CPU until all ranks loaded."""

    def __init__(self, evict: list[str], quiet_wait: float):
        self.evict = [Path(p) for p in evict]
        self.dev = block_device(self.evict[0])
        self.quiet_wait = quiet_wait
        self.start = (0, 0.0)

    def before_load(self, run: dict) -> dict:
        eviction = drop_caches(self.evict, everything=False)
        quiet = wait_quiet(self.dev, self.quiet_wait)
        self.start = (disk_bytes(self.dev), cpu_busy_seconds())
        return {"eviction": eviction, **quiet}

    def after_load(self, run: dict) -> dict:
        return {"disk_bytes": disk_bytes(self.dev) - self.start[0] if self.dev else None,
                "cpu_busy_s": cpu_busy_seconds() - self.start[1]}


def world(spec_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "shim"))
    import blake3
    import safetensors
    import torch
    import vllm
    import vllm_cpu_model

    spec = json.loads(spec_path.read_text())
    reports = vllm_cpu_model.run_world(spec, Hook(spec["evict"], spec["quiet_wait"]))
    software = {"vllm": vllm.__version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
                "blake3": blake3.__version__}
    (Path(spec["results"]) / "software.json").write_text(json.dumps(software))
    for r in reports:
        if "crash" in r:
            print(f"rank {r['rank']} crashed:\n{r['crash']}", file=sys.stderr)
    sys.exit(1 if any("crash" in r for r in reports) else 0)


# ---------------------------------------------------------------- the bench side (no torch here)


def contender_run(what: str, label: str, model: Path, out: Path, sharded: Path) -> dict:
    run = {"name": label, "capture": False}
    if what == "floor":
        return {**run, "load_format": "floor", "model": str(out), "files": str(out / "target")}
    if what == "default":
        return {**run, "load_format": "auto", "model": str(model)}
    if what == "sharded_state":
        return {**run, "load_format": "sharded_state", "model": str(sharded)}
    return {**run, "load_format": "lucifer_tp3", "model": str(out), "extra": {"verify": what.split("=", 1)[1]}}


def run_world(spec: dict, base: Path) -> tuple[list[dict], dict]:
    """One world through tools/vllm-env.sh (its vLLM venv); its rank reports and software."""
    results = Path(spec["results"])
    rmtree(results)
    results.mkdir(parents=True)
    spec_path = base / f"{results.name}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    try:
        subprocess.run(["bash", str(ROOT / "tools" / "vllm-env.sh"), "python", str(HERE / "load.py"), "_world",
                        str(spec_path)], check=True, timeout=WORLD_TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"load world {results.name} failed: {e}") from None
    reports = [json.loads((results / f"rank-{r}.json").read_text()) for r in range(int(spec["tp"]))]
    return reports, json.loads((results / "software.json").read_text())


def world_record(reports: list[dict], name: str) -> dict:
    """One run over all ranks: the slowest rank's wall, per-rank figures, what others did meanwhile."""
    recs = [rep["runs"][name] for rep in reports]
    errors = [f"rank {rep['rank']}: {rec['error']}" for rep, rec in zip(reports, recs) if "error" in rec]
    if errors:
        raise RuntimeError(f"load run {name!r} failed: " + "; ".join(errors))
    lead = recs[0]
    ours_read = sum(r["read_bytes"] for r in recs)
    ours_cpu = sum(r["cpu_s"] for r in recs)
    disk = lead["after"]["disk_bytes"]
    other_io = max(0, disk - ours_read) if disk is not None else None
    return {
        "wall": max(r["load_s"] for r in recs),
        "construct": max((r.get("construct_s", 0.0) for r in recs), default=0.0),
        **{k: [r[k] for r in recs] for k in ("load_s", "read_bytes", "rchar", "peak_rss", "rss_before", "cpu_s")},
        "before": lead["before"],
        "other_io": other_io,
        "other_cpu": round(max(0.0, lead["after"]["cpu_busy_s"] - ours_cpu), 1),
        "disturbed": bool(other_io and other_io > DISTURBED * max(ours_read, 1)),
    }


def ordered(rep: int) -> tuple[str, ...]:
    """The contenders in repetition `rep`'s order: row `rep` of a Williams square (0, 1, n-1, 2, n-2, ...
    shifted by rep), so each contender follows a different run each time. A plain rotation keeps
    neighbours: one contender then always follows sharded_state, whose 11 GiB freed just before
    makes the next run refill guest memory (measured: that contender ran 1.3-1.5x slower)."""
    n = len(CONTENDERS)
    base = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    return tuple(CONTENDERS[(i + rep) % n] for i in base)


def load_section(args, work: Path) -> dict:
    """Every TP size of `args.load_tp`; the `load` part of results.json."""
    model = work / "load-flash-layer-1"
    synth(model, layers=1, mtp=False)
    res: dict = {"runs": {}, "sizes": {"source_bytes": tree_bytes(model, "*.safetensors")}, "reps": args.reps,
                 "tp": args.load_tp, "checkpoint": "synth flash-layer --layers 1 --no-mtp --fill random"}
    t0 = time.time()
    for tp in args.load_tp:
        out, sharded = work / f"load-out-tp{tp}", work / f"load-sharded-tp{tp}"
        rmtree(out)
        print(f"[load TP{tp}] convert --tp {tp} --expert-layout model --no-mtp -> {out}", flush=True)
        run([*lucifer(), "convert", "--tp", str(tp), "--arch", "sm120", "--expert-layout", "model", "--no-mtp", "--quiet",
             str(model), str(out)])
        rmtree(sharded)
        sharded.mkdir(parents=True)
        for f in model.iterdir():  # config and tokenizer files: vLLM's engine config reads them
            if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
                shutil.copy2(f, sharded / f.name)
        base = {"tp": tp, "evict": [str(model), str(out), str(sharded)], "quiet_wait": args.quiet_wait}
        runs = [{**contender_run("default", SAVE_RUN, model, out, sharded), "save_sharded": str(sharded)}]
        runs += [contender_run(what, f"{what} #{rep + 1}", model, out, sharded)
                 for rep in range(args.reps) for what in ordered(rep)]
        for attempt in range(RETRIES + 1):
            spec = {**base, "results": str(work / f"load-world-tp{tp}-{attempt}"), "runs": runs}
            print(f"[load TP{tp}] world {attempt + 1}: {len(runs)} runs", flush=True)
            reports, res["software"] = run_world(spec, work)
            retry = []
            for before, r in zip([None, *runs], runs):
                rec = {**world_record(reports, r["name"]), "after": before and before["name"].split(" #")[0]}
                what = r["name"].split(" #")[0]
                res["runs"].setdefault(f"TP{tp} {what}", []).append(rec)
                print(f"  TP{tp} {r['name']:<28} {rec['wall']:7.2f} s  read/rank "
                      f"{max(rec['read_bytes']) / 1e9:5.2f} GB  peak RSS/rank {max(rec['peak_rss']) / GiB:5.2f} GiB  "
                      f"(others: {rec['other_cpu']:5.1f} cpu-s, {(rec['other_io'] or 0) / 1e9:5.2f} GB io)"
                      + ("  disturbed" if rec["disturbed"] else ""), flush=True)
                if rec["disturbed"] and r["name"] != SAVE_RUN:
                    retry.append(r)
            runs = retry
            if not runs:
                break
        res["sizes"][f"TP{tp}"] = {
            "rank_file_bytes": [tree_bytes(out / "target" / f"rank-{r}", "*.safetensors") for r in range(tp)],
            "sharded_state_bytes": [sum(p.stat().st_size for p in files_of(sharded, f"model-rank-{r}-part-*"))
                                    for r in range(tp)]}
        rmtree(out)
        rmtree(sharded)
    res["extrapolation_input"] = flash_bytes(work)
    res["seconds"] = round(time.time() - t0, 1)
    if not args.keep:
        rmtree(model)
    return res


def flash_bytes(work: Path) -> dict:
    """The full DeepSeek-V4-Flash at TP3, from `plan --json` on the shipped config: the checkpoint's
    bytes a conversion reads and each rank's target rank-file bytes (headers included)."""
    model = work / "flash-config"
    model.mkdir(exist_ok=True)
    shutil.copy2(ROOT / "src" / "lucifer_shard" / "configs" / "deepseek-v4-flash.json", model / "config.json")
    out = subprocess.run([*lucifer(), "plan", "--tp", str(FLASH_TP), "--arch", "sm120", "--json", str(model)],
                         capture_output=True, text=True, check=True).stdout
    fp = json.loads(out)["result"]["footprint"]
    return {"checkpoint_bytes": fp["read_bytes"], "tp": FLASH_TP,
            "rank_bytes": [r["bytes"] for r in fp["ranks"] if r["role"] == "target"]}


# ---------------------------------------------------------------- report


def _med(recs: list[dict], key) -> float:
    return statistics.median(key(r) for r in recs)


def summarize_load(load: dict) -> tuple[list[str], list[str], dict]:
    """The load table, its PASS/FAIL lines and the summary (medians of undisturbed runs)."""
    summary = {}
    for label, recs in load["runs"].items():
        clean = [r for r in recs if not r["disturbed"]] or recs
        summary[label] = {
            "wall": _med(clean, lambda r: r["wall"]), "walls": [round(r["wall"], 2) for r in clean],
            "construct": _med(clean, lambda r: r["construct"]),
            "read_bytes": _med(clean, lambda r: max(r["read_bytes"])), "rchar": _med(clean, lambda r: max(r["rchar"])),
            "peak_rss": _med(clean, lambda r: max(r["peak_rss"])), "cpu": _med(clean, lambda r: sum(r["cpu_s"])),
            "other_cpu": _med(clean, lambda r: r["other_cpu"]), "other_io": _med(clean, lambda r: r["other_io"] or 0),
            "n": len(clean), "disturbed": len(recs) - len(clean) if len(clean) < len(recs) else 0,
        }
    lines = ["| TP | run | median load wall (s) | walls (s) | construction (s) | read_bytes / rank (GB) | "
             "rchar / rank (GB) | peak RSS / rank (GiB) | CPU, all ranks (s) | vs floor | other load (cpu-s, GB io) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    checks: list[str] = []
    ratios: dict[str, float] = {}
    for tp in load["tp"]:
        floor = summary.get(f"TP{tp} floor")
        for what in [SAVE_RUN, *CONTENDERS]:
            s = summary.get(f"TP{tp} {what}")
            if not s:
                continue
            vs = f"{s['wall'] / floor['wall']:.2f}x" if floor and what != "floor" else ""
            construct = "" if what == "floor" else f"{s['construct']:.1f}"
            lines.append(f"| {tp} | {what} | {s['wall']:.2f} | {', '.join(f'{w:.2f}' for w in s['walls'])} | "
                         f"{construct} | {s['read_bytes'] / 1e9:.2f} | {s['rchar'] / 1e9:.2f} | "
                         f"{s['peak_rss'] / GiB:.2f} | {s['cpu']:.1f} | {vs} | "
                         f"{s['other_cpu']:.0f}, {s['other_io'] / 1e9:.1f} |")
        get = {what: summary.get(f"TP{tp} {what}") for what in CONTENDERS}
        if not all(get.values()):
            continue
        for v in VERIFY:
            lu = get[f"lucifer verify={v}"]
            for ref in ("default", "sharded_state", "floor"):
                ratios[f"TP{tp} lucifer verify={v}/{ref}"] = lu["wall"] / get[ref]["wall"]
        h, f, fl, ss = get["lucifer verify=headers"], get["lucifer verify=full"], get["floor"], get["sharded_state"]

        def check(ok: bool, text: str) -> None:
            checks.append(f"{'PASS' if ok else 'FAIL'}  TP{tp} {text}")

        check(h["wall"] <= 1.2 * fl["wall"], f"lucifer verify=headers <= 1.2x its floor: {h['wall']:.2f} s vs "
                                             f"{fl['wall']:.2f} s = {h['wall'] / fl['wall']:.2f}x")
        check(h["wall"] <= ss["wall"], f"lucifer verify=headers no slower than sharded_state: {h['wall']:.2f} s vs "
                                       f"{ss['wall']:.2f} s = {h['wall'] / ss['wall']:.2f}x")
        check(f["wall"] <= 1.5 * fl["wall"], f"lucifer verify=full <= 1.5x its floor: {f['wall']:.2f} s vs "
                                             f"{fl['wall']:.2f} s = {f['wall'] / fl['wall']:.2f}x")
        checks.append(f"INFO  TP{tp} lucifer verify=headers vs default: {h['wall']:.2f} s vs "
                      f"{get['default']['wall']:.2f} s = {h['wall'] / get['default']['wall']:.2f}x")
        checks.append(f"INFO  TP{tp} {predecessor_line(load['runs'], tp)}")
    return lines, checks, {"summary": summary, "ratios": ratios}


def predecessor_line(runs: dict, tp: int) -> str:
    """Median lucifer walls split by what ran just before in the same world: another lucifer run
    (whose freed parameters the next one reuses) or a run that read through the page cache."""
    parts = []
    for v in VERIFY:
        split: dict[bool, list[float]] = {True: [], False: []}
        for r in runs.get(f"TP{tp} lucifer verify={v}", []):
            if r.get("after") and not r["disturbed"]:
                split[r["after"].startswith("lucifer")].append(r["wall"])
        parts.append(f"{v} " + " / ".join(f"{statistics.median(w):.2f} s (n={len(w)})" if w else "-"
                                          for w in (split[True], split[False])))
    return "lucifer wall after another lucifer run / after floor, default or sharded_state: " + "; ".join(parts)


def render_load(load: dict) -> tuple[dict, list[str], list[str]]:
    """(the load results with their summary, markdown lines, PASS/FAIL lines)."""
    lines, checks, extra = summarize_load(load)
    load = {**load, **extra}
    sw = load.get("software", {})
    sizes = load["sizes"]
    per_tp = "; ".join(
        f"TP{tp}: rank files {max(sizes[f'TP{tp}']['rank_file_bytes']) / 1e9:.2f} GB/rank, sharded_state "
        f"{max(sizes[f'TP{tp}']['sharded_state_bytes']) / 1e9:.2f} GB/rank" for tp in load["tp"] if f"TP{tp}" in sizes)
    head = [f"load: {load['checkpoint']} ({sizes['source_bytes'] / 1e9:.2f} GB); {per_tp}",
            f"vLLM {sw.get('vllm')} CPU model, torch {sw.get('torch')}, safetensors {sw.get('safetensors')}, "
            f"blake3 {sw.get('blake3')}; median of {load['reps']} runs; the bench's files evicted from the page "
            f"cache before every run (fadvise); one gloo process per rank, all ranks loading at once", ""]
    ratio_line = ", ".join(f"{k} {v:.2f}x" for k, v in extra["ratios"].items())
    md = head + lines + ["", f"ratios: {ratio_line}", "", *extrapolation_lines(load), ""]
    return load, md, checks


def extrapolation_lines(load: dict) -> list[str]:
    """Scale the measured per-rank read rates to the full DeepSeek-V4-Flash at TP3 (the plan's bytes)."""
    x = load.get("extrapolation_input")
    summary = load["summary"]
    tps = [tp for tp in load["tp"] if f"TP{tp} lucifer verify=headers" in summary and f"TP{tp} default" in summary]
    if not x or not tps:
        return []
    ck, rank = x["checkpoint_bytes"], max(x["rank_bytes"])
    out = [f"extrapolation to DeepSeek-V4-Flash at TP{x['tp']}: checkpoint {ck / 1e9:.1f} GB, rank files "
           f"{rank / 1e9:.1f} GB per rank (from the plan); at each measured TP, seconds per GB each rank reads:"]
    source = load["sizes"]["source_bytes"]
    for tp in tps:
        files = max(load["sizes"][f"TP{tp}"]["rank_file_bytes"])
        d, h = summary[f"TP{tp} default"]["wall"], summary[f"TP{tp} lucifer verify=headers"]["wall"]
        out.append(f"  from TP{tp}: default {d / source * 1e9:.2f} s/GB of checkpoint -> {d / source * ck:.0f} s; "
                   f"lucifer verify=headers {h / files * 1e9:.2f} s/GB of rank file -> {h / files * rank:.0f} s "
                   f"({d / source * ck / (h / files * rank):.1f}x faster)")
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_world":
        return world(Path(sys.argv[2]))
    sys.exit("usage: python bench/load.py _world SPEC.json (through tools/vllm-env.sh); "
             "the load bench itself is `python3 bench/bench.py --only load`")


if __name__ == "__main__":
    main()
