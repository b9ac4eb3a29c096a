#!/usr/bin/env python3
"""Render docs/evidence/gpu-validation.md from the GPU tests' results JSON and machine.txt.

  python3 tests/gpu/report.py RESULTS.json MACHINE.txt [--log gpu-tests.log] [--build-status build_status.json]
                             [--command CMD] [--notes NOTES.md] [-o docs/evidence/gpu-validation.md]

Only the records of the latest session in RESULTS.json are used. The go/no-go verdict is
re-derived from the recorded figures (not only from pass/fail), against the audit's criterion
"a small CUTLASS hardware test matches a reference at world size 3":
  * layout identity: all six cases byte-equal to FlashInfer's helpers;
  * kernel at world size 3, on flash-moe (8 experts) for every M in (1, 8, 16, 64) and on one Flash
    MoE layer (256 experts) for every M in (1, 8, 64, 256), all 256 experts routed at M = 256: each
    rank vs its reference rel <= 2e-3, >= 99.9 % elementwise, finite, and the TP3 fp32 sum vs the
    unsharded reference rel <= 5e-3;
  * the stock unit-blind offsets give rel > 0.3;
  * CUDA-graph replay bit-identical to eager;
  * a 0xFF scale byte in a zero-padded region, every rank, three cases (W2 scale; W13 scale without
    and with swiglu_limit): the kernel's NaN rows are the expected ones (the routed rows; none for
    W13 with the limit, whose clamp masks the NaN) and the reference's, and no other row changes;
  * the load side: a runtime's preparation from the source equals every rank file byte for byte
    (its times are reported, not gated);
  * no gated test failed (the TP3 multi-process test of issue 10 is reported, not gated);
  * the tests saw an SM90 GPU (a `device` record; a CPU dry run with a fake FlashInfer has none).
Pure standard library, so it also runs where the GPU tests did not.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MOE, FLASH = "flash-moe", "flash-layer"
REQUIRED_MS = {MOE: (1, 8, 16, 64), FLASH: (1, 8, 64, 256)}
FLASH_EXPERTS = 256
FF_CASES = [(r, t, lim) for r in range(3) for t, lim in (("w2_weight_scale", 10.0), ("w13_weight_scale", None),
                                                         ("w13_weight_scale", 10.0))]
LAYOUT_CASES = ("weights-w13", "weights-w2", "scales-fold-w13", "scales-fold-w2", "scales-swizzle-w13",
                "scales-swizzle-w2")
TOL_RANK_REL, TOL_SUM_REL, ELEM_FRAC, STOCK_MIN_REL = 2e-3, 5e-3, 0.999, 0.3
CRITERION = "a small CUTLASS hardware test matches a reference at world size 3"
DEFAULT_COMMAND = "bash tests/gpu/device-run.sh"
RECIPE = """## How to run it

Here, once, into `.gpu/` (ignored by git, about 41 MiB, carried to the GPU machine; the prebuilt
FlashInfer modules mean nothing is compiled there):

```bash
mkdir -p .gpu/wheels && cp -r ../shared/gpu/*.py ../shared/gpu/prepare.sh ../shared/gpu/prebuilt .gpu/
pip download --no-deps flashinfer-python==0.7.2.post1 -d /tmp/fi
python3 .gpu/make_slim_wheel.py /tmp/fi/flashinfer_python-0.7.2.post1-py3-none-any.whl \\
    .gpu/wheels/flashinfer_python-0.7.2.post1-py3-none-any.whl
pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 apache-tvm-ffi==0.1.15.post2 -d .gpu/wheels
pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
  --platform manylinux_2_17_x86_64 blake3==1.0.11 -d .gpu/wheels
```

Dry run on a CPU box first (a FlashInfer stand-in, `tests/gpu/fake_flashinfer`; checks plumbing,
never the kernel; about 12 minutes on 2 cores; `flash-layer` is replaced by `flash-moe` unless
`LUCIFER_GPU_DRYRUN_FLASH=full`, which needs ~14 GB of memory):

```bash
LUCIFER_GPU_DRYRUN=1 LUCIFER_TP3_MODE=cpu python3 -m pytest -m gpu tests/gpu -o addopts='' -k 'not cuda_graph'
```

On the GPU machine, one call with `.gpu` carried, from the checkout root, naming the commit sent
(the copy's `.git` there may be older): `LUCIFER_GPU_COMMIT=<hash> bash tests/gpu/device-run.sh`.
It writes `machine.txt`, `gpu-tests.log` and `gpu-results.json` under `$OUT`; they are committed
in `tests/gpu/results/`, and this page is rendered from them:

```bash
python3 tests/gpu/report.py tests/gpu/results/gpu-results.json tests/gpu/results/machine.txt \\
    --log tests/gpu/results/gpu-tests.log --notes tests/gpu/results/notes.md \\
    --serving tests/gpu/results/serving.md --one-gpu-tp tests/gpu/results/tp-one-gpu.md \\
    --flash tests/gpu/results/flash-0.34.0.md --record tests/gpu/results/record.md --command "..." \\
    -o docs/evidence/gpu-validation.md
```
"""


# ---------------------------------------------------------------- input
def load_records(path: Path) -> list[dict]:
    data = json.loads(Path(path).read_text())
    recs = data.get("records", []) if isinstance(data, dict) else []
    if not recs:
        return []
    last = recs[-1].get("session")
    return [r for r in recs if r.get("session") == last]


def parse_machine(text: str) -> dict[str, str]:
    """`key: value` lines of machine.txt (first occurrence wins)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith((" ", "\t", "|", "+")):
            k, _, v = line.partition(":")
            k = k.strip()
            if k and len(k) <= 40 and k not in out:
                out[k] = v.strip()
    return out


def _num(v, default=float("nan")) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _f(v, spec=".2e") -> str:
    x = _num(v)
    return "n/a" if x != x else format(x, spec)


def _pct(v) -> str:
    x = _num(v)
    return "n/a" if x != x else f"{100 * x:.2f} %"


# ---------------------------------------------------------------- verdict
def _kernel_check(recs: list[dict], preset: str, title: str, experts: int | None = None) -> tuple[str, bool, str]:
    """Every required M of PRESET: three ranks within the rank tolerances, the TP3 sum within its own;
    with `experts`, that many experts in the checkpoint and all of them routed at the largest M."""
    ms = REQUIRED_MS[preset]
    ker = {int(_num(r.get("M"), -1)): r for r in recs if r.get("preset", MOE) == preset}
    problems = []
    for m in ms:
        r = ker.get(m)
        if r is None:
            problems.append(f"M={m} missing")
            continue
        for d in r.get("ranks", []):
            if not (d.get("finite") is True and _num(d.get("rel")) <= TOL_RANK_REL and _num(d.get("frac_ok")) >= ELEM_FRAC):
                problems.append(f"M={m} rank {d.get('rank')}: rel {_f(d.get('rel'))}, elementwise {_pct(d.get('frac_ok'))}, finite {d.get('finite')}")
        if len(r.get("ranks", [])) != 3:
            problems.append(f"M={m}: {len(r.get('ranks', []))} ranks recorded")
        s = r.get("sum", {})
        if not (s.get("finite") is True and _num(s.get("rel")) <= TOL_SUM_REL):
            problems.append(f"M={m} TP3 sum: rel {_f(s.get('rel'))}, finite {s.get('finite')}")
        if experts is not None and r.get("experts") != experts:
            problems.append(f"M={m}: {r.get('experts')} experts, expected {experts}")
        if experts is not None and m == max(ms) and r.get("experts_routed") != experts:
            problems.append(f"M={m}: {r.get('experts_routed')} of {experts} experts routed")
    title = f"{title}, M = {', '.join(map(str, ms))}" + (f", all {experts} routed at M = {max(ms)}" if experts else "")
    got = [r for r in ker.values() if r.get("M") in ms]
    detail = "; ".join(problems) if problems else (
        f"max rank rel {_f(max(_num(d.get('rel')) for r in got for d in r.get('ranks', [])))}, "
        f"max TP3 sum rel {_f(max(_num(r.get('sum', {}).get('rel')) for r in got))}")
    return title, not problems, detail


def _rows(v) -> str:
    v = list(v or [])
    return f"{len(v)} {v[:8]}{'...' if len(v) > 8 else ''}"


def _ff_ok(r: dict) -> bool:
    want = r.get("expected_nan_rows")
    return (bool(r.get("routed_rows")) and want in (r.get("routed_rows"), []) and r.get("kernel_nan_rows") == want
            and r.get("reference_nan_rows") == want and r.get("others_identical") is True
            and r.get("clean_finite") is True)


def _ff_key(r: dict) -> tuple:
    lim = r.get("swiglu_limit")
    return r.get("rank"), r.get("tensor"), None if lim is None else _num(lim)


def evaluate(recs: list[dict]) -> tuple[bool, list[tuple[str, bool, str]]]:
    """(go, [(check, ok, detail)]) from the figures of one session."""
    checks: list[tuple[str, bool, str]] = []
    kind = lambda k: [r for r in recs if r.get("kind") == k]  # noqa: E731

    dev = kind("device")
    cap = (dev[0].get("capability") or [None]) if dev else [None]
    checks.append(("ran on an SM90 GPU with FlashInfer", bool(dev) and cap[0] == 9,
                   "no device record" if not dev else f"{dev[0].get('name')}, capability {cap}, "
                                                      f"FlashInfer {dev[0].get('flashinfer')}"))

    lay = {r.get("case"): r for r in kind("layout_identity")}
    missing = [c for c in LAYOUT_CASES if c not in lay]
    bad = [c for c in LAYOUT_CASES if c in lay and not lay[c].get("equal")]
    checks.append(("layout identity with FlashInfer's helpers (6 cases)", not missing and not bad,
                   f"missing {missing}" if missing else (f"differ: {bad}" if bad else "all byte-equal")))

    checks.append(_kernel_check(kind("kernel_tp3"), MOE, "kernel at world size 3 vs references, flash-moe (8 experts)"))
    checks.append(_kernel_check(kind("kernel_tp3"), FLASH, f"kernel at world size 3 vs references, one Flash MoE layer "
                                                           f"({FLASH_EXPERTS} experts)", FLASH_EXPERTS))

    st = kind("stock_offsets")
    st_ok = bool(st) and all(_num(r.get("stock", {}).get("rel"), 0.0) > STOCK_MIN_REL for r in st)
    checks.append(("stock unit-blind offsets give a large error", st_ok,
                   "no record" if not st else ", ".join(f"M={r.get('M')} rel {_f(r.get('stock', {}).get('rel'))}" for r in st)))

    g = kind("cuda_graph")
    g_ok = bool(g) and all(r.get("bit_identical") is True and r.get("bit_identical_new_input") is True for r in g)
    checks.append(("CUDA-graph replay bit-identical to eager", g_ok,
                   "no record" if not g else ", ".join(f"identical {r.get('bit_identical')}/{r.get('bit_identical_new_input')}" for r in g)))

    ff = {_ff_key(r): r for r in kind("ff_padding")}
    ff_bad = [f"rank {k[0]} {k[1]} swiglu_limit {k[2]}: " + ("missing" if k not in ff else
              f"NaN rows {_rows(ff[k].get('kernel_nan_rows'))} (reference {_rows(ff[k].get('reference_nan_rows'))}) "
              f"vs expected {_rows(ff[k].get('expected_nan_rows'))}, others identical {ff[k].get('others_identical')}")
              for k in FF_CASES if k not in ff or not _ff_ok(ff[k])]
    nan_rows = lambda t, lim: sum(len(ff[k].get("kernel_nan_rows") or []) for k in FF_CASES  # noqa: E731
                                  if k in ff and k[1:] == (t, lim))
    checks.append(("0xFF scale byte in zero padding: NaN exactly where expected and predicted (3 ranks x 3 cases)",
                   not ff_bad, "; ".join(ff_bad) if ff_bad else
                   f"W2 scale: {nan_rows('w2_weight_scale', 10.0)} NaN rows, W13 scale without swiglu_limit: "
                   f"{nan_rows('w13_weight_scale', None)}, exactly the routed rows; W13 scale with swiglu_limit 10: "
                   f"{nan_rows('w13_weight_scale', 10.0)} (the clamp masks it); kernel = reference, other rows "
                   "bit-identical"))

    ld = kind("load_side")
    eq = (ld[-1].get("equal_by_rank") or {}) if ld else {}
    differ = {r: [n for n, ok in v.items() if not ok] for r, v in eq.items() if not all(v.values())}
    ld_ok = len(eq) == 3 and not differ
    checks.append(("runtime preparation from the source == rank files (Flash layer, 3 ranks)", ld_ok,
                   "no record" if not ld else ("byte-equal, all four tensors of every rank" if ld_ok else
                                               f"{len(eq)} ranks compared, differ: {differ}")))

    gated_fail = [r.get("test") for r in kind("outcome")
                  if r.get("outcome") not in ("passed",) and "tp3_nccl" not in str(r.get("test"))]
    checks.append(("no gated GPU test failed", not gated_fail and bool(kind("outcome")),
                   "no outcome records" if not kind("outcome") else (", ".join(map(str, gated_fail)) or "all passed")))
    return all(ok for _, ok, _ in checks), checks


# ---------------------------------------------------------------- rendering
def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|",
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


ONE_GPU_TP_TITLE = "TP3 on the one GPU: the harness, and what ran (2026-12-04)"
FLASH_TITLE = "vLLM 0.34.0 on the GPU: the Flash geometry at TP1 and TP3, three nodes, where a start goes (2026-12-06)"


def render(recs: list[dict], machine_text: str, log_text: str = "", build: dict | None = None,
           command: str = DEFAULT_COMMAND, notes: str = "", serving: str = "", one_gpu_tp: str = "",
           flash: str = "", record: str = "") -> str:
    go, checks = evaluate(recs)
    mach = parse_machine(machine_text)
    kind = lambda k: [r for r in recs if r.get("kind") == k]  # noqa: E731
    L: list[str] = ["# GPU validation: FlashInfer's CUTLASS MoE on the converter's TP3 rank files", ""]
    L += ["Generated by `tests/gpu/report.py` from `gpu-results.json` and `machine.txt` of one run of "
          "`tests/gpu/run.sh` on the H200 test machine.", ""]
    if record.strip():  # the evidence page's date and commits (docs/evidence/README.md)
        L += [record.strip(), ""]

    L += ["## Verdict", ""]
    sess = kind("session")
    verdict = "GO" if go else "NO-GO"
    L += [f"**{verdict}.** Audit criterion: \"{CRITERION}\". "
          + ("Every check below holds: the real CUTLASS MoE (SM90 MXFP4 x BF16), run on each of the three rank "
             "files exactly as `lucifer-shard convert --tp 3 --arch sm90` wrote them, summed over the ranks, "
             "matches the unsharded reference within the [kernel-layouts.md §5.4](../design/kernel-layouts.md#54-tolerances) tolerances."
             if go else "At least one check below fails or has no result, so the criterion is NOT shown."), ""]
    L += _table(["check", "result", "detail"], [[c, "pass" if ok else "**FAIL**", d] for c, ok, d in checks])
    L += [""]
    if notes.strip():
        L += ["## Notes on this run", "", notes.strip(), ""]

    L += ["## Machine", ""]
    keys = ["gpu", "gpu_count", "compute_capability", "driver", "cuda_runtime_torch", "nvcc", "torch", "flashinfer",
            "tvm_ffi", "python", "lucifer_shard", "sent_commit", "cpu", "date"]
    rows = [[k, mach[k]] for k in keys if k in mach]
    for d in kind("device"):
        rows.append(["device seen by the tests", f"{d.get('name')}, capability {d.get('capability')}, "
                     f"{d.get('count')} GPU(s), torch {d.get('torch')} (CUDA {d.get('cuda')}), FlashInfer "
                     f"{d.get('flashinfer')}, fp32 matmul precision {d.get('fp32_matmul_precision')}"])
    L += _table(["item", "value"], rows) if rows else ["(machine.txt has no `key: value` lines)"]
    L += ["", "<details><summary>machine.txt</summary>", "", "```", machine_text.strip(), "```", "", "</details>", ""]

    L += ["## Command and wall times", "", "On the GPU machine, from the checkout root (with `.gpu/` prepared as in "
          "*How to run it* below):", "", "```", command, "```", ""]
    wt = []
    if build:
        wt.append(["FlashInfer trimmed build (build_fi.py)", f"{_num(build.get('wall_s')):.0f} s"
                   + (f" (result {build.get('result')})" if build.get("result") else "")])
        for k, v in (build.get("phases") or {}).items():
            wt.append([f"  build phase {k}", f"{_num(v):.0f} s"])
    for r in kind("fixture"):
        wt.append([f"synth {r.get('preset', MOE)} + convert --tp 3 --arch sm90",
                   f"{_num(r.get('synth_s')):.1f} s + {_num(r.get('convert_s')):.1f} s"])
    for r in kind("geometry_load"):
        wt.append([f"{r.get('preset')}: source experts and rank tensors onto the GPU (incl. inverse layouts on the CPU)",
                   f"{_num(r.get('load_s')):.1f} s"])
    for r in sess:
        wt.append(["GPU tests (pytest session)", f"{_num(r.get('wall_s')):.1f} s, {r.get('passed')} passed, "
                   f"{r.get('failed')} failed, {r.get('errors')} errors"])
    for r in kind("outcome"):
        wt.append([f"  {r.get('test')}", f"{_num(r.get('duration_s')):.2f} s ({r.get('outcome')})"])
    L += _table(["phase", "wall time"], wt) if wt else ["(no timings recorded)"]
    L += [""]

    fx = kind("fixture")
    if fx:
        L += ["## Test checkpoints", "",
              "Synthetic checkpoints with the exact DeepSeek-V4-Flash schema and random valid values "
              "(`lucifer-shard synth ... --fill random`), converted with `lucifer-shard convert --tp 3 --arch sm90 "
              "--no-mtp`. `flash-moe` is one MoE layer of 8 experts with the Flash expert shapes; `flash-layer` "
              "is one complete Flash decoder layer (`--layers 1 --no-mtp`), 256 routed experts.", ""]
        L += _table(["checkpoint", "hidden", "routed I", "experts", "top-k", "swiglu_limit", "layout generation",
                     "MoE variant", "rank 0 expert tensors as written"],
                    [[r.get("preset", MOE), r.get("hidden"), r.get("inter"), r.get("experts"), r.get("top_k"),
                      r.get("swiglu_limit"), r.get("flashinfer_layout"), r.get("moe_variant"),
                      "<br>".join(f"{n} {s} ({(r.get('layouts') or {}).get(n, '')})"
                                  for n, s in (r.get("rank_shapes") or {}).items())] for r in fx])
        L += [""]

    L += ["## 1. Layout identity (CPU layout functions vs FlashInfer's GPU helpers)", ""]
    lay = kind("layout_identity")
    L += _table(["case", "ours", "FlashInfer", "input shape", "output shape", "bytes", "differing bytes"],
                [[r.get("case"), f"`{r.get('ours')}`", f"`{r.get('flashinfer')}`", str(r.get("shape")),
                  str(r.get("out_shape")), r.get("nbytes"), r.get("mismatches")] for r in lay]) if lay else ["(no records)"]
    L += [""]

    L += ["## 2. Kernel at world size 3", "",
          "`cutlass_fused_moe(..., tp_size=3, tp_rank=r, use_w4_group_scaling=True, swiglu_limit=10)` on each "
          "rank's tensors as written; each partial vs `moe_reference` on that rank's model-layout tensors "
          f"(tolerance rel <= {TOL_RANK_REL:g}, elementwise rule for >= {100 * ELEM_FRAC:g} %); the fp32 sum of "
          f"the three partials vs `moe_reference` on the unsharded source experts (rel <= {TOL_SUM_REL:g}). "
          "\"rel\" is the relative Frobenius error; \"elementwise\" the share of elements with "
          "|d| <= 2 ulp_bf16(|ref|) + 1e-3 max|ref|.", ""]
    for preset in REQUIRED_MS:
        recs_p = sorted((r for r in kind("kernel_tp3") if r.get("preset", MOE) == preset), key=lambda r: _num(r.get("M")))
        if not recs_p:
            L += [f"### {preset}", "", "(no records)", ""]
            continue
        L += [f"### {preset} ({recs_p[0].get('experts')} experts)", ""]
        rows = []
        for r in recs_p:
            for d in r.get("ranks", []):
                rows.append([r.get("M"), r.get("experts_routed"), f"rank {d.get('rank')} vs own ref", _f(d.get("rel")),
                             _f(d.get("max_abs"), ".3g"), _f(d.get("max_ref"), ".4g"), _pct(d.get("frac_ok")), d.get("finite")])
            s = r.get("sum", {})
            rows.append([r.get("M"), r.get("experts_routed"), "**TP3 sum vs unsharded**", f"**{_f(s.get('rel'))}**",
                         _f(s.get("max_abs"), ".3g"), _f(s.get("max_ref"), ".4g"), _pct(s.get("frac_ok")), s.get("finite")])
        L += _table(["M", "experts routed", "comparison", "rel", "max abs err", "max abs ref", "elementwise", "finite"], rows)
        km = [f"M={r.get('M')}: {_f(r.get('kernel_ms_rank0'), '.3f')} ms" for r in recs_p]
        L += ["", "Eager kernel time, rank 0 (mean of 5 calls after one warm-up): " + ", ".join(km) + ".", ""]

    L += ["## 3. The stock unit-blind offsets on hardware", "",
          "Rank tensors rebuilt from the source with vLLM's stock W2 offsets (bytes 0/384/768, scale groups "
          "0/24/48; w13 rows 0/704/1408), laid out with the converter's sm90 functions (the same construction at "
          "the correct offsets reproduces the converter's rank files byte for byte), run through the kernel and summed.", ""]
    rows = [[r.get("M"), _f(r.get("stock", {}).get("rel")), _f(r.get("stock", {}).get("max_abs"), ".3g"),
             _f(r.get("converter", {}).get("rel"))] for r in kind("stock_offsets")]
    L += _table(["M", "stock offsets rel", "stock max abs err", "converter files rel"], rows) if rows else ["(no records)"]
    L += [""]

    L += ["## 4. CUDA graphs", ""]
    rows = [[r.get("M"), r.get("rank"), r.get("workspace_bytes"), r.get("bit_identical"), r.get("bit_identical_new_input"),
             _f(r.get("replay_ms"), ".4f"), _f(r.get("eager_ms"), ".4f")] for r in kind("cuda_graph")]
    L += _table(["M", "rank", "workspace bytes", "replay == eager", "== eager after new inputs", "replay ms", "eager ms"],
                rows) if rows else ["(no records)"]
    L += [""]

    L += ["## 5. A 0xFF scale byte in zero padding", "",
          "One byte 0xFF written into the first zero region the manifest lists for the scale tensor (model layout; "
          "the converter's sm90 layout then moves it to one byte of the kernel layout), on one Flash MoE layer, "
          "M = 64, the most-routed expert. `verify` rejects such a byte; this is what it does on the kernel. "
          "CUTLASS decodes E8M0 255 as +inf, so the padded (zero) weights of that group become NaN in their GEMM. "
          "In W2 the NaN reaches the output (column 0 of every routed row). In W13's gate half it reaches the "
          "output without a swiglu_limit (whole routed rows); with DeepSeek's swiglu_limit 10 the activation's "
          "clamp, CUTLASS `minimum<float>` = `fminf`, replaces the NaN gate by 10, which multiplies a padded up "
          "value of 0, and the output is bit-identical to the clean one. *Expected* is that mechanism; "
          "*reference* is `moe_reference` on the poisoned tensors, which models the fminf clamp.", ""]
    ffr = sorted(kind("ff_padding"), key=lambda r: (r.get("tensor", ""), str(r.get("swiglu_limit")), r.get("rank", 0)))
    L += _table(["rank", "tensor", "swiglu_limit", "model index", "zero region", "routed rows", "expected NaN rows",
                 "kernel NaN rows", "rows all NaN", "NaN elements (kernel / reference)", "reference NaN rows",
                 "other rows identical", "result"],
                [[r.get("rank"), r.get("tensor"), r.get("swiglu_limit"), str(r.get("model_index")), str(r.get("zero_region")),
                  _rows(r.get("routed_rows")), _rows(r.get("expected_nan_rows")), _rows(r.get("kernel_nan_rows")),
                  r.get("kernel_rows_all_nan"), f"{r.get('kernel_nan_elements')} / {r.get('reference_nan_elements')}",
                  _rows(r.get("reference_nan_rows")), r.get("others_identical"), "pass" if _ff_ok(r) else "**FAIL**"]
                 for r in ffr]) if ffr else ["(no records)"]
    L += [""]

    L += ["## 6. Load side: rank file vs the original checkpoint prepared on the GPU", ""]
    for r in kind("load_side"):
        med, tb, st = r.get("median_s") or {}, r.get("bytes_read") or {}, r.get("storage_read_bytes") or {}
        L += [f"Rank {r.get('rank')} of a {r.get('preset')} checkpoint, {r.get('experts')} routed experts of one "
              f"layer, {r.get('reps')} repetitions per path and cache state, alternating paths; \"cold\": page "
              f"cache dropped before every read ({r.get('cache_drop')}); \"warm\": both inputs cached. "
              "Rank file: `safe_open(...).get_tensor(name).to('cuda')` for the four tensors, nothing else. Runtime: "
              "every source tensor of the layer's routed experts read whole with safetensors, narrowed to the rank, "
              "copied into zeroed padded GPU parameters, halves swapped, then FlashInfer's "
              "`interleave_moe_weights_for_sm90_mixed_gemm` / `interleave_moe_scales_for_sm90_mixed_gemm` on the GPU.", ""]
        rows = []
        for path in med:
            sc = st.get(path, {})
            rows.append([path, f"{_num(tb.get(path)) / 1e9:.3f} GB", f"{_num(med[path].get('cold')):.3f} s",
                         f"{_num(med[path].get('warm')):.3f} s",
                         f"{_num(tb.get(path)) / 1e9 / _num(med[path].get('cold')):.2f} / "
                         f"{_num(tb.get(path)) / 1e9 / _num(med[path].get('warm')):.2f}",
                         ", ".join(f"{_num(x) / 1e9:.2f}" for x in sc.get("cold", [])),
                         ", ".join(map(str, (r.get("times_s") or {}).get(path, {}).get("cold", []))) + " / "
                         + ", ".join(map(str, (r.get("times_s") or {}).get(path, {}).get("warm", [])))])
        L += _table(["path", "tensor bytes read", "median cold", "median warm", "GB/s cold / warm",
                     "storage reads per cold run (GB)", "every run, cold / warm (s)"], rows)
        sp = r.get("speedup") or {}
        eq = r.get("equal_by_rank") or {}
        L += ["", f"Rank file faster by {_num(sp.get('cold')):.1f}x cold and {_num(sp.get('warm')):.1f}x warm. "
              f"Kernel-ready bytes from both paths identical on ranks "
              f"{', '.join(str(k) for k, v in eq.items() if all(v.values())) or 'none'}"
              f" of {len(eq)}.", ""]
    if not kind("load_side"):
        L += ["(no record)", ""]

    L += ["## 7. TP3 across three processes, BF16 all-reduce (issue 10; reported, not part of the verdict)", ""]
    tp = kind("tp3_nccl")
    if not tp:
        L += ["(no record)", ""]
    for r in tp:
        L += [f"Mode: **{r.get('label', r.get('mode'))}** ({r.get('gpus')} GPU(s)); result "
              f"**{'pass' if r.get('ok') else 'FAIL'}**; wall {_f(r.get('wall_s'), '.1f')} s."
              + (f" Error: `{r.get('error')}`" if r.get("error") else ""), ""]
        if r.get("mode") == "gloo":
            L += ["Real NCCL across three GPUs was **not** run here (needs a machine with >= 3 GPUs); "
                  "the three processes shared one GPU and gloo summed the BF16 partials on the host.", ""]
        elif r.get("mode") != "nccl":
            L += ["No GPU ran: the per-rank reference stood in for the kernel (plumbing check only).", ""]
        rows = [[w.get("M"), _f(w.get("vs_ref", {}).get("rel")), _f(w.get("vs_ref", {}).get("max_abs"), ".3g"),
                 _f(w.get("vs_emul", {}).get("rel")), _pct(w.get("vs_emul", {}).get("frac_ok")),
                 _f(w.get("emul_vs_ref", {}).get("rel")), w.get("ranks_identical"),
                 w.get("partials_bit_identical_to_single_process")] for w in r.get("rows", [])]
        tol = r.get("tol", {})
        L += _table(["M", "all-reduced vs unsharded rel", "max abs err", "vs single-GPU emulation rel",
                     "elementwise vs emulation", "emulation vs unsharded rel", "same on all ranks",
                     "partials == single-process"], rows) if rows else ["(no rows)"]
        L += ["", f"Tolerances: vs unsharded rel <= {tol.get('vs_ref_rel')}, vs emulation rel <= {tol.get('vs_emul_rel')}.", ""]

    if serving.strip():
        L += ["## 8. Served inside vLLM: stock vLLM 0.33.0 on the H200 (a separate run)", "", serving.strip(), ""]
    if one_gpu_tp.strip():
        L += [f"## 9. {ONE_GPU_TP_TITLE}", "", one_gpu_tp.strip(), ""]
    if flash.strip():
        L += [f"## 10. {FLASH_TITLE}", "", flash.strip(), ""]

    L += [RECIPE.strip(), ""]

    L += ["## What this does not prove", "",
          "* The SM120/SM100 production kernel (MXFP4 x MXFP8): it cannot run on SM90. Its scale layout is proven "
          "here only by identity with `block_scale_interleave`.",
          "* The legacy FlashInfer layout generation (0.6.10-0.6.15, 0.6.17) that the pinned vLLM forks use; only "
          "the folded generation of FlashInfer 0.7.2.post1 ran here.",
          "* Autotuned tactics (the default tactic ran) and a real model's weight statistics (the weights are "
          "random valid MXFP4 codes with scales 2^-8..2^-4).",
          "* The runtime side of the load figures is our re-creation of what a runtime does with the field's calls "
          "(safetensors, torch, FlashInfer's helpers), not vLLM's loader itself.", ""]

    fails = [r for r in kind("outcome") if r.get("outcome") != "passed"]
    if fails:
        L += ["## Failures", ""]
        for r in fails:
            L += [f"### {r.get('test')} ({r.get('when')}: {r.get('outcome')})", "", "```", str(r.get("detail", ""))[-3000:], "```", ""]
    if log_text.strip():
        tail = "\n".join(log_text.strip().splitlines()[-15:])
        L += ["## pytest log (tail)", "", "```", tail, "```", ""]
    return "\n".join(L).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render docs/evidence/gpu-validation.md from gpu-results.json and machine.txt")
    ap.add_argument("results", type=Path)
    ap.add_argument("machine", type=Path)
    ap.add_argument("--log", type=Path, help="gpu-tests.log (its tail is quoted)")
    ap.add_argument("--build-status", type=Path, help="build_status.json of .gpu/build_fi.py (build wall time)")
    ap.add_argument("--command", default=DEFAULT_COMMAND)
    ap.add_argument("--notes", type=Path, help="markdown quoted under 'Notes on this run'")
    ap.add_argument("--serving", type=Path, help="markdown of the serving run (tests/gpu/serve_run.py), section 8")
    ap.add_argument("--one-gpu-tp", type=Path, help="markdown of TP on one GPU (tests/gpu/tp_run.py), section 9")
    ap.add_argument("--flash", type=Path, help="markdown of vLLM 0.34.0 on the Flash geometry (tests/gpu/flash_run.py), "
                                               "section 10")
    ap.add_argument("--record", type=Path, help="markdown of the record line: the runs' dates and commits")
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args(argv)
    recs = load_records(a.results)
    machine = a.machine.read_text(errors="replace") if a.machine.exists() else "(machine.txt missing)"
    log = a.log.read_text(errors="replace") if a.log and a.log.exists() else ""
    build = json.loads(a.build_status.read_text()) if a.build_status and a.build_status.exists() else None
    notes = a.notes.read_text() if a.notes else ""
    text = render(recs, machine, log, build, a.command, notes, a.serving.read_text() if a.serving else "",
                  a.one_gpu_tp.read_text() if a.one_gpu_tp else "", a.flash.read_text() if a.flash else "",
                  a.record.read_text() if a.record else "")
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(text)
    else:
        sys.stdout.write(text)
    go, _ = evaluate(recs)
    print(f"verdict: {'GO' if go else 'NO-GO'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
