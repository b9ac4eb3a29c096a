"""Shared code of the GPU tests (tests/gpu) and of tp3_nccl.py.

Nothing here imports FlashInfer at module level: CPU CI collects the GPU test modules (and then
deselects them with -m 'not gpu'), so this module must import on a CPU box. FlashInfer is
imported inside `flashinfer_moe()`, which only GPU tests and tp3_nccl.py call.

What it provides:
  * the checkpoints: `lucifer-shard synth flash-moe` (8 experts) or `flash-layer --layers 1` (one
    real Flash MoE layer, 256 experts) with `--fill random`, then `convert --tp 3 --arch sm90`, run
    as subprocesses (`make_checkpoint`), and their tensors on the device (`load_geometry`);
  * rank tensors as written (`load_rank_stored`, straight from the rank file named in the
    manifest) and in model layout (`load_rank_model`, through `Output.model_tensor`);
  * the unsharded source experts assembled as [w1 ; w3] with I = 2048, unpadded (`source_unsharded`);
  * rank tensors rebuilt from the source with numpy at the correct or the stock unit-blind
    offsets (`build_rank_model`, `lay_out`);
  * routing inputs, the kernel call, the reference, the metrics of docs/design/kernel-layouts.md §5.4;
  * the load side: a rank's experts from its rank file vs prepared from the source as a runtime
    would (`runtime_prepare`), page-cache dropping and I/O counters;
  * the results JSON every GPU test appends to (`record`).

CPU dry run (LUCIFER_GPU_DRYRUN=1): DEVICE is "cpu" and `flashinfer_moe()` imports the stand-in
in tests/gpu/fake_flashinfer (our inverse layouts + `moe_reference` in place of the kernel). It
checks plumbing, shapes and tolerances, never the kernel, and records no `device`, so the
report's verdict of a dry run is always NO-GO.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# ---------------------------------------------------------------- constants of the checkpoints
DRYRUN = os.environ.get("LUCIFER_GPU_DRYRUN") == "1"
DEVICE = "cpu" if DRYRUN else "cuda"   # where the GPU tests put tensors
FAKE_FLASHINFER = Path(__file__).resolve().parent / "fake_flashinfer"
ROLE = "target"
TP = 3
ARCH = "sm90"
FI_LAYOUT = "folded"
SEED = 1234                  # synth seed
MOE, FLASH = "flash-moe", "flash-layer"
MS = {MOE: (1, 8, 16, 64),   # token counts of the world-size-3 test per checkpoint; at the largest M
      FLASH: (1, 8, 64, 256)}  # of FLASH every one of the 256 experts is routed (make_routing cover)
SYNTH_ARGS = {MOE: (MOE,), FLASH: (FLASH, "--layers", "1", "--no-mtp")}
if DRYRUN and os.environ.get("LUCIFER_GPU_DRYRUN_FLASH") != "full":
    SYNTH_ARGS[FLASH] = SYNTH_ARGS[MOE]  # 256 experts on the CPU would hold ~14 GB of host memory
PREFIX = "model.layers.0.ffn.experts.routed_experts."
NAMES = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
SRC = "layers.0.ffn.experts.{e}.{w}.{kind}"  # source key: w in w1/w2/w3, kind in weight/scale

# docs/design/kernel-layouts.md §5.4
TOL_RANK_REL = 2e-3          # kernel vs moe_reference on the same tensors, relative Frobenius
TOL_SUM_REL = 5e-3           # TP3 sum vs TP1 reference
ELEM_FRAC = 0.999            # share of elements that must meet the elementwise rule
ELEM_ULPS = 2                # max|d| <= 2 ulp_bf16(|ref|) + 1e-3 max|ref|
ELEM_REL_MAX = 1e-3
STOCK_MIN_REL = 0.3          # the stock unit-blind offsets must be at least this wrong


# ---------------------------------------------------------------- results JSON
def results_path() -> Path:
    p = os.environ.get("LUCIFER_GPU_RESULTS")
    if p:
        return Path(p)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu-results.json"
    return Path("/tmp/gpu-results.json")


SESSION = os.environ.get("LUCIFER_GPU_SESSION") or f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.generic,)):
        v = v.item()
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/nan
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def record(kind: str, path: Path | None = None, **fields) -> dict:
    """Append one record {session, kind, time, **fields} to the results JSON (locked read-modify-write)."""
    path = Path(path) if path else results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = _jsonable({"session": SESSION, "kind": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     **fields})
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            data = {"corrupt_previous": text[:2000]}
        data.setdefault("format", "lucifer-shard/gpu-results")
        data.setdefault("version", 1)
        data.setdefault("records", []).append(rec)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(data, indent=1) + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)
    return rec


# ---------------------------------------------------------------- checkpoint
def cli(*args: str, timeout: int = 600) -> float:
    """Run `python -m lucifer_shard.cli ARGS` (sys.executable); returns its wall time in s."""
    env = dict(os.environ, FLASHINFER_W4A16_TRIM="0")  # the converter never needs FlashInfer
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"lucifer-shard {' '.join(args)} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


@dataclass
class Checkpoint:
    preset: str
    src: Path
    out: Path
    synth_s: float
    convert_s: float
    hidden: int
    inter: int
    experts: int
    top_k: int
    swiglu_limit: float


def make_checkpoint(base: Path, preset: str = MOE, seed: int = SEED) -> Checkpoint:
    """synth PRESET (random fill) into BASE/src and convert --tp 3 --arch sm90 (folded) into BASE/out."""
    base = Path(base)
    src, out = base / "src", base / "out"
    if (out / "COMPLETE").exists():
        synth_s = convert_s = 0.0
    else:
        synth_s = cli("synth", *SYNTH_ARGS[preset], str(src), "--fill", "random", "--seed", str(seed), "--quiet")
        convert_s = cli("convert", "--tp", str(TP), "--arch", ARCH, "--flashinfer-layout", FI_LAYOUT, "--no-mtp",
                        "--workers", str(TP), str(src), str(out), "--quiet")
    return checkpoint_info(src, out, synth_s, convert_s, preset)


def checkpoint_info(src: Path, out: Path, synth_s: float = 0.0, convert_s: float = 0.0, preset: str = MOE) -> Checkpoint:
    cfg = json.loads((Path(src) / "config.json").read_text())
    return Checkpoint(preset, Path(src), Path(out), synth_s, convert_s, int(cfg["hidden_size"]),
                      int(cfg["moe_intermediate_size"]), int(cfg["n_routed_experts"]),
                      int(cfg["num_experts_per_tok"]), float(cfg["swiglu_limit"]))


def manifest(out: Path) -> dict:
    from lucifer_shard.proof.outdir import Output

    return Output(Path(out)).manifest.to_dict()


def load_rank_stored(out: Path, rank: int, device: str | torch.device = "cpu", man: dict | None = None) -> dict[str, torch.Tensor]:
    """The four routed-expert tensors of one rank exactly as written (uint8), read with
    safetensors.safe_open from the rank file the manifest names; nothing else is opened."""
    from safetensors import safe_open

    man = man or manifest(out)
    tinfo = man["roles"][ROLE]["ranks"][rank]["tensors"]
    res = {}
    for n in NAMES:
        info = tinfo[PREFIX + n]
        if info["dtype"] != "U8":
            raise AssertionError(f"rank {rank} {n}: dtype {info['dtype']} in the manifest, expected U8")
        with safe_open(str(Path(out) / info["file"]), framework="pt") as f:
            t = f.get_tensor(PREFIX + n)
        if t.dtype != torch.uint8 or list(t.shape) != list(info["shape"]):
            raise AssertionError(f"rank {rank} {n}: file holds {t.dtype} {list(t.shape)}, manifest says U8 {info['shape']}")
        res[n] = t.contiguous().to(device)
    return res


def load_rank_model(out: Path, rank: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The four routed-expert tensors of one rank in model layout ([w1|0 ; w3|0]), via Output.model_tensor."""
    from lucifer_shard.proof.outdir import Output

    o = Output(Path(out))
    res = {n: o.model_tensor(ROLE, rank, PREFIX + n).view(torch.uint8).contiguous().to(device) for n in NAMES}
    o.close()
    return res


@dataclass
class Geometry:
    """One converted checkpoint with its routed experts on the device: the unsharded source experts
    (model layout, I unpadded), and per rank the tensors as written and in model layout."""
    ck: Checkpoint
    srcx: dict[str, np.ndarray]
    full: dict[str, torch.Tensor]
    stored: list[dict[str, torch.Tensor]]
    model: list[dict[str, torch.Tensor]]


def load_geometry(ck: Checkpoint, device: str | torch.device) -> Geometry:
    man = manifest(ck.out)
    srcx = source_experts(ck.src, ck.experts)
    return Geometry(ck, srcx, source_unsharded(srcx, device),
                    [load_rank_stored(ck.out, r, device, man=man) for r in range(TP)],
                    [load_rank_model(ck.out, r, device) for r in range(TP)])


# ---------------------------------------------------------------- source experts
def _u8np(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return t.view(torch.uint8).numpy()


def source_experts(src: Path, experts: int) -> dict[str, np.ndarray]:
    """Source tensors as uint8 numpy stacked over experts: w1, w3 [E, I, H/2], w1s, w3s [E, I, H/32],
    w2 [E, H, I/2], w2s [E, H, I/32]."""
    from lucifer_shard.source.checkpoint import open_checkpoint

    ck = open_checkpoint(Path(src))
    try:
        def stack(w: str, kind: str) -> np.ndarray:
            arrs = []
            for e in range(experts):
                key = SRC.format(e=e, w=w, kind=kind)
                shape = ck.tensors[key].shape
                arrs.append(_u8np(ck.read(key, tuple(slice(0, d) for d in shape))))
            return np.stack(arrs)

        return {"w1": stack("w1", "weight"), "w3": stack("w3", "weight"), "w2": stack("w2", "weight"),
                "w1s": stack("w1", "scale"), "w3s": stack("w3", "scale"), "w2s": stack("w2", "scale")}
    finally:
        ck.close()


def source_unsharded(srcx: dict[str, np.ndarray], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Unsharded experts in model layout, halves [w1 ; w3] with I unpadded (2048)."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return {"w13_weight": t(np.concatenate([srcx["w1"], srcx["w3"]], axis=1)),
            "w13_weight_scale": t(np.concatenate([srcx["w1s"], srcx["w3s"]], axis=1)),
            "w2_weight": t(srcx["w2"]), "w2_weight_scale": t(srcx["w2s"])}


def rank_geometry(inter: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(logical per rank, kernel per rank, real rows of this rank) of the intermediate axis:
    704/768 at I=2048, TP3 (virtual TP pads I to a multiple of 64*tp, the kernel to 128)."""
    logical = -(-inter // (64 * tp)) * 64            # 2048 / 3 -> 704
    kernel = -(-logical // 128) * 128                 # 704 -> 768
    real = max(0, min(logical, inter - logical * rank))
    return logical, kernel, real


def build_rank_model(srcx: dict[str, np.ndarray], rank: int, inter: int, tp: int = TP,
                     stock: bool = False) -> dict[str, np.ndarray]:
    """One rank's experts in model layout, cut from the source with numpy.

    w13 rows (and w13 scale rows) always at the correct element offsets 704 r; each half
    [real | 0] padded to the kernel width 768. W2 along K: correct = element offsets converted
    to bytes (352 r) and to 32-groups (22 r); stock = the unit-blind offsets of vLLM's generic
    loader, r * (destination width): bytes 384 r and groups 24 r, copying min(width, left) and
    leaving the rest of the zeroed destination at 0 (docs/design/tensor-plan.md §3.3)."""
    logical, kernel, real = rank_geometry(inter, tp, rank)
    e, _, hb = srcx["w1"].shape
    r0 = logical * rank

    def half(a: np.ndarray) -> np.ndarray:
        d = np.zeros((e, kernel, a.shape[2]), np.uint8)
        d[:, :real] = a[:, r0:r0 + real]
        return d

    def cols(a: np.ndarray, unit: int) -> np.ndarray:
        width = kernel // unit
        d = np.zeros((e, a.shape[1], width), np.uint8)
        if stock:
            start = rank * width
            n = max(0, min(width, a.shape[2] - start))
        else:
            start, n = r0 // unit, real // unit
        d[:, :, :n] = a[:, :, start:start + n]
        return d

    return {"w13_weight": np.concatenate([half(srcx["w1"]), half(srcx["w3"])], axis=1),
            "w13_weight_scale": np.concatenate([half(srcx["w1s"]), half(srcx["w3s"])], axis=1),
            "w2_weight": cols(srcx["w2"], 2), "w2_weight_scale": cols(srcx["w2s"], 32)}


def lay_out(model: dict[str, np.ndarray], arch: str = ARCH, fi_layout: str = FI_LAYOUT) -> dict[str, np.ndarray]:
    """Model layout -> kernel layout with the converter's own layout functions."""
    from lucifer_shard.model.layouts import expert_layout

    return {n: expert_layout(arch, "kernel", fi_layout, n).forward(np.ascontiguousarray(a)) for n, a in model.items()}


def to_torch(d: dict[str, np.ndarray], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(np.ascontiguousarray(a)).to(device) for n, a in d.items()}


# ---------------------------------------------------------------- the load side
def runtime_prepare(src: Path, rank: int, fmoe, device: str | torch.device, tp: int = TP) -> tuple[dict[str, torch.Tensor], int]:
    """One rank's routed experts made kernel-ready from the ORIGINAL checkpoint, as a runtime without
    pre-sharding does it: read every source tensor of the routed experts whole (safetensors), narrow
    it to this rank on the host, copy the slice into zeroed, padded device parameters in vLLM model
    layout ([w1|0 ; w3|0] rows, W2 bytes and scale groups at element offset / 2 and / 32), then on
    the device swap the halves to [w3 ; w1] and apply FlashInfer's own SM90 interleave helpers.
    Returns (the four tensors, bytes of the source tensors read)."""
    from safetensors import safe_open

    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    experts, hidden, inter = int(cfg["n_routed_experts"]), int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    logical, kernel, real = rank_geometry(inter, tp, rank)
    r0 = logical * rank
    u8 = dict(dtype=torch.uint8, device=device)
    w13 = torch.zeros(experts, 2 * kernel, hidden // 2, **u8)
    w13s = torch.zeros(experts, 2 * kernel, hidden // 32, **u8)
    w2 = torch.zeros(experts, hidden, kernel // 2, **u8)
    w2s = torch.zeros(experts, hidden, kernel // 32, **u8)
    # (source weight, kind) -> (destination, dim narrowed, this rank's start and length there, row offset)
    dest = {("w1", "weight"): (w13, 0, r0, real, 0), ("w3", "weight"): (w13, 0, r0, real, kernel),
            ("w1", "scale"): (w13s, 0, r0, real, 0), ("w3", "scale"): (w13s, 0, r0, real, kernel),
            ("w2", "weight"): (w2, 1, r0 // 2, real // 2, 0), ("w2", "scale"): (w2s, 1, r0 // 32, real // 32, 0)}
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, list[tuple[str, int, tuple]]] = {}
    for e in range(experts):
        for (w, kind), d in dest.items():
            key = SRC.format(e=e, w=w, kind=kind)
            by_file.setdefault(weight_map[key], []).append((key, e, d))
    nbytes = 0
    for fname, items in sorted(by_file.items()):
        with safe_open(str(src / fname), framework="pt") as f:
            for key, e, (param, dim, start, length, row0) in items:
                t = f.get_tensor(key).view(torch.uint8)
                nbytes += t.numel()
                part = t.narrow(dim, start, length)
                if dim == 0:
                    param[e, row0:row0 + length].copy_(part)
                else:
                    param[e, :, :length].copy_(part)
    swap = lambda t: torch.cat([t[:, kernel:], t[:, :kernel]], dim=1)  # noqa: E731
    out = {"w13_weight": fmoe.interleave_moe_weights_for_sm90_mixed_gemm(swap(w13).contiguous(), "fp4"),
           "w13_weight_scale": fmoe.interleave_moe_scales_for_sm90_mixed_gemm(swap(w13s).contiguous()),
           "w2_weight": fmoe.interleave_moe_weights_for_sm90_mixed_gemm(w2, "fp4"),
           "w2_weight_scale": fmoe.interleave_moe_scales_for_sm90_mixed_gemm(w2s)}
    sync()
    return out, nbytes


def drop_page_cache(paths: list[Path]) -> str:
    """Evict PATHS from the page cache: sync, then /proc/sys/vm/drop_caches (root on the GPU machine;
    never in a dry run, which runs on shared boxes) and posix_fadvise(DONTNEED) on every file.
    Returns what was done."""
    os.sync()
    how = []
    if not DRYRUN:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            how.append("drop_caches")
        except OSError:
            pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how.append("fadvise")
    return "+".join(how)


def io_counters() -> dict[str, int]:
    """This process's /proc/self/io (rchar: bytes asked of read(); read_bytes: bytes fetched from
    storage, page faults of mmap included); empty where the kernel has none."""
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}
    except OSError:
        return {}


# ---------------------------------------------------------------- inputs, reference, metrics
def make_routing(m: int, hidden: int, experts: int, top_k: int, seed: int, device: str | torch.device = "cpu",
                 cover: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x bf16 [M, H] ~ N(0, 1); distinct top-k expert ids per token (int32); softmax weights (fp32, > 0).
    Drawn on the CPU from `seed`, so every process and device sees the same inputs. cover: every
    expert is routed at least once (the first ceil(E/k) tokens take a random permutation of the
    experts, the rest stay random), which needs M * k >= E."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
    ids = torch.rand(m, experts, generator=g).argsort(dim=1)[:, :top_k]
    if cover:
        n = -(-experts // top_k)
        if n > m:
            raise ValueError(f"cover: M={m} tokens of top-{top_k} cannot route all {experts} experts")
        perm = torch.randperm(experts, generator=g)
        # rows of consecutive permutation entries; the last row is completed from the permutation's
        # start, which cannot repeat one of its own ids since top_k <= experts
        rows = torch.cat([perm, perm[: n * top_k - experts]]).view(n, top_k)
        ids[:n] = rows
    ids = ids.to(torch.int32)
    w = torch.softmax(torch.randn(m, top_k, generator=g), dim=1).to(torch.float32)
    return x.to(device), ids.contiguous().to(device), w.contiguous().to(device)


def reference(x, ids, w, t: dict[str, torch.Tensor], swiglu_limit: float) -> torch.Tensor:
    """lucifer_shard.proof.numerics.moe_reference on model-layout tensors (on their device)."""
    from lucifer_shard.proof.numerics import moe_reference

    return moe_reference(x, ids, w, t["w13_weight"], t["w13_weight_scale"], t["w2_weight"],
                         t["w2_weight_scale"], swiglu_limit)


def ulp_bf16(a: torch.Tensor) -> torch.Tensor:
    """BF16 ulp at |a| (fp32): 2^(floor(log2 |a|) - 7), with |a| clamped to the smallest normal."""
    a = a.abs().to(torch.float32).clamp_min(2.0 ** -126)
    _, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    return torch.ldexp(torch.ones_like(a), (e - 8).to(torch.int32))


def metrics(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """max abs error, max |ref|, relative Frobenius error, share meeting the elementwise rule, finiteness."""
    g = got.to(torch.float32)
    r = ref.to(torch.float32)
    finite = bool(torch.isfinite(g).all().item())
    d = (g - r).abs()
    max_ref = float(r.abs().max().item())
    bound = ELEM_ULPS * ulp_bf16(r) + ELEM_REL_MAX * max_ref
    rn = float(torch.linalg.vector_norm(r).item())
    dn = float(torch.linalg.vector_norm(g - r).item())
    return {"max_abs": float(d.max().item()) if finite else float("inf"), "max_ref": max_ref,
            "rel": dn / rn if rn > 0 else (0.0 if dn == 0 else float("inf")),
            "frac_ok": float((d <= bound).to(torch.float32).mean().item()), "finite": finite,
            "n": int(r.numel())}


def rank_ok(m: dict) -> bool:
    return m["finite"] and m["rel"] <= TOL_RANK_REL and m["frac_ok"] >= ELEM_FRAC


def sum_ok(m: dict) -> bool:
    return m["finite"] and m["rel"] <= TOL_SUM_REL


def fmt(m: dict) -> str:
    return f"rel {m['rel']:.3e} max|d| {m['max_abs']:.3e} max|ref| {m['max_ref']:.3g} ok {m['frac_ok']:.4%}"


# ---------------------------------------------------------------- FlashInfer (GPU only)
def flashinfer_moe():
    """(flashinfer module, flashinfer.fused_moe) after checking for an SM90 GPU. GPU tests only.
    In a dry run, the CPU stand-in of tests/gpu/fake_flashinfer instead."""
    if DRYRUN:
        if str(FAKE_FLASHINFER) not in sys.path:
            sys.path.insert(0, str(FAKE_FLASHINFER))
        import flashinfer
        import flashinfer.fused_moe as fmoe

        if not getattr(flashinfer, "IS_CPU_STAND_IN", False):
            raise RuntimeError(f"LUCIFER_GPU_DRYRUN=1 but `flashinfer` is the real one ({flashinfer.__file__})")
        return flashinfer, fmoe
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the gpu-marked tests need an NVIDIA H100/H200 (SM90)")
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        raise RuntimeError(f"compute capability {cap}: FlashInfer's MXFP4 x BF16 CUTLASS MoE runs on SM90 only")
    import flashinfer
    import flashinfer.fused_moe as fmoe

    return flashinfer, fmoe


def sync() -> None:
    if not DRYRUN:
        torch.cuda.synchronize()


def time_ms(fn, reps: int) -> float:
    """Mean ms per call of fn over reps calls (CUDA events; wall clock in a dry run)."""
    if DRYRUN:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def device_info(flashinfer) -> dict:
    """What ran: GPU name, capability and count, torch/CUDA/FlashInfer versions, fp32 matmul precision."""
    return {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "count": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "flashinfer": getattr(flashinfer, "__version__", "?"),
            "fp32_matmul_precision": torch.get_float32_matmul_precision()}


def run_kernel(fmoe, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, t: dict[str, torch.Tensor], rank: int,
               tp: int, swiglu_limit: float | torch.Tensor | None, out: torch.Tensor | None = None,
               workspace: torch.Tensor | None = None) -> torch.Tensor:
    """One rank's `cutlass_fused_moe` (SM90 MXFP4 x BF16): tensors as written, tp_size/tp_rank,
    swiglu_limit as a float32 [E_local] tensor (pass one to keep allocations out of a CUDA-graph
    capture; None: plain SwiGLU, no clamp). Returns the BF16 partial [M, H] (the `output=`)."""
    e_local, hidden = t["w2_weight"].shape[0], t["w2_weight"].shape[1]
    if out is None:
        out = torch.empty(x.shape[0], hidden, dtype=torch.bfloat16, device=x.device)
    limit = swiglu_limit if swiglu_limit is None or isinstance(swiglu_limit, torch.Tensor) else \
        torch.full((e_local,), float(swiglu_limit), dtype=torch.float32, device=x.device)
    kw = {"workspace_buffer": workspace} if workspace is not None else {}
    fmoe.cutlass_fused_moe(
        input=x, token_selected_experts=ids, token_final_scales=w,
        fc1_expert_weights=t["w13_weight"], fc2_expert_weights=t["w2_weight"],
        output_dtype=torch.bfloat16, quant_scales=[t["w13_weight_scale"], t["w2_weight_scale"]],
        swiglu_limit=limit, tp_size=tp, tp_rank=rank, use_w4_group_scaling=True, output=out, **kw)
    return out
