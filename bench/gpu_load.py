"""Issue 41's side-by-side load bench: one rank's files of the project's own converter output, read onto
one device by every loader, cold and warm, every tensor checked, the disk measured in the same call.

    python bench/gpu_load.py --json gpu-load.json                 # H200: cuda:0, ~10 GB of rank files
    python bench/gpu_load.py --device cpu --preset tiny --json x  # the plumbing, anywhere

Phases, each written to --json as soon as it ends (a cut call keeps what finished):
  prepare   `lucifer-shard synth flash-layer --layers K --no-mtp` (K from --gb: the output's total
            rank-file bytes, all ranks) then `convert --tp 3 --no-mtp`; the source is deleted at once
  disk      `dd iflag=direct bs=64M` on the rank's files, all at once (the disk without page cache),
            and `dd bs=16M` buffered one file at a time, cold and warm
  loaders   safetensors (safe_open + get_tensor().to(device), vLLM's default iterator), the lucifer
            reader (src/lucifer_shard/runtime_shim/load/reader.py) with digests off and on (on a GPU also with the GPU's
            tensors hashed on the host, as before src/lucifer_shard/runtime_shim/load/device_blake3.py), and fastsafetensors,
            instanttensor, runai-model-streamer, safetensors 0.9's `prefetch` (on a GPU) when importable (else skipped, the reason printed);
            per repetition all cold (page cache dropped before each run), then all warm (files read
            once before), the loaders' order rotated each repetition; every tensor compared byte for
            byte with a reference read once
Cold is `echo 3 > /proc/sys/vm/drop_caches` after a sync when permitted (root), else
`posix_fadvise(DONTNEED)` on each file; the JSON says which. GB/s = tensor bytes / load wall
(destination allocation included, the device synchronized at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open

from lucifer_shard.formats.stheader import read_header
from lucifer_shard.runtime_shim.load import reader

# rank-file bytes of `synth flash-layer --no-mtp` at TP3, all ranks: 6.16 GB at one layer (measured);
# a layer ~4.1 GB (the full Flash: 177.7 GB for 43 layers), the rest embeddings, head and norms
FIXED_GB = 2.1
LAYER_GB = 4.1
TP = 3
PREFETCH = "safetensors prefetch"
PEERS = ("fastsafetensors", "instanttensor", "runai-model-streamer", PREFETCH)
HOST_HASHED = "lucifer digests=on, host BLAKE3"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="where tensors land (cuda:0, cpu)")
    p.add_argument("--gb", type=float, default=10.0, help="flash-layer output size, all ranks (GB); rank 0 reads ~1/3")
    p.add_argument("--preset", choices=("flash-layer", "tiny"), default="flash-layer", help="tiny: plumbing tests")
    p.add_argument("--rank", default="0", help="whose rank files are read: a rank, or 'all' (every rank's, ~3x the bytes)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("gpu-load-work"), help="scratch directory (removed at the end)")
    p.add_argument("--reuse", action="store_true", help="keep an existing WORK/out (converted before) instead of converting")
    p.add_argument("--fadvise-only", action="store_true", help="cold: evict only the bench's files (shared machines)")
    p.add_argument("--keep", action="store_true", help="leave WORK in place")
    p.add_argument("--json", type=Path, required=True, help="results, rewritten after every phase")
    p.add_argument("--threads", type=int, default=reader.THREADS, help="reader: reads in flight")
    p.add_argument("--slots", type=int, default=reader.SLOTS, help="reader: ring slots")
    p.add_argument("--chunk-mib", type=int, default=reader.CHUNK >> 20, help="reader: MiB per read and per slot")
    p.add_argument("--loaders", default="", help="comma-separated subset of the loaders (default: all)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- prepare


def lucifer(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *args, "--quiet"], check=True, stdout=subprocess.DEVNULL)


def prepare(args: argparse.Namespace, res: dict) -> list[Path]:
    """Convert a fresh synthetic checkpoint (unless --reuse finds one); rank `args.rank`'s files."""
    out = args.work / "out"
    if not (args.reuse and (out / "COMPLETE").exists()):
        src = args.work / "src"
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        layers = max(1, round((args.gb - FIXED_GB) / LAYER_GB))
        synth = ["synth", args.preset, *(["--layers", str(layers)] if args.preset == "flash-layer" else []), "--no-mtp"]
        t0 = time.perf_counter()
        lucifer(*synth, str(src))
        t1 = time.perf_counter()
        lucifer("convert", "--tp", str(TP), "--no-mtp", str(src), str(out))
        t2 = time.perf_counter()
        shutil.rmtree(src)  # the disk holds the output only
        res["prepare"] = {"synth": " ".join(synth), "synth_s": round(t1 - t0, 1), "convert_s": round(t2 - t1, 1)}
    ranks = range(TP) if args.rank == "all" else [int(args.rank)]
    files = [f for r in ranks for f in sorted((out / "target" / f"rank-{r}").glob("*.safetensors"))]
    res.setdefault("prepare", {}).update(files=[str(f) for f in files], file_bytes=sum(f.stat().st_size for f in files),
                                         output_bytes=sum(f.stat().st_size for f in out.rglob("*.safetensors")))
    return files


# ---------------------------------------------------------------- page cache and disk


def drop_cache(files: list[Path], fadvise_only: bool = False) -> str:
    """Evict `files` from the page cache: the global drop_caches when permitted (and not
    `fadvise_only`: a shared machine keeps the others' cache), else per-file fadvise."""
    os.sync()
    if not fadvise_only:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def warm_cache(files: list[Path]) -> None:
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)


def dd_gbps(files: list[Path], direct: bool) -> float:
    """GB/s of dd over `files`: O_DIRECT all at once, or buffered one file after another."""
    total = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    if direct:
        procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for f in files]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"dd iflag=direct failed: {p.stderr.read().decode().strip()}")
    else:
        warm_cache(files)
    return total / 1e9 / (time.perf_counter() - t0)


def disk_phase(args: argparse.Namespace, files: list[Path], res: dict) -> None:
    disk: dict = {"dd iflag=direct bs=64M, files at once": [], "dd bs=16M one file at a time, cold": [],
                  "dd bs=16M one file at a time, warm": []}
    res["disk"] = disk
    for _ in range(args.reps):
        for label, direct, cold in (("dd iflag=direct bs=64M, files at once", True, True),
                                    ("dd bs=16M one file at a time, cold", False, True),
                                    ("dd bs=16M one file at a time, warm", False, False)):
            try:
                if cold:
                    res["cold_method"] = drop_cache(files, args.fadvise_only)
                disk[label].append(round(dd_gbps(files, direct), 3))
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
                disk[label] = f"failed: {e}"
    for label, runs in disk.items():
        print(f"  {label:<40} " + (" ".join(f"{g:6.2f}" for g in runs) if isinstance(runs, list) else runs), flush=True)


# ---------------------------------------------------------------- loaders: files -> {name: tensor on device}


def load_safetensors(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as g:
            for k in g.keys():
                t = g.get_tensor(k)
                out[k] = t.to(device) if device.type != "cpu" else t.clone()  # cpu: own the bytes, as the others do
    return out


def lucifer_loader(digests: bool, threads: int, slots: int, chunk: int, hash_on_device: bool = True) -> Callable:
    def load(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
        out = {}
        for f in files:
            header = read_header(f)
            reads = []
            for name, h in header.tensors.items():
                out[name] = torch.empty(h.shape, dtype=header_dtype(h.dtype), device=device)
                reads.append(reader.TensorRead(name, header.data_start + h.start, out[name]))
            reader.read_tensors(f, reads, digests=digests, threads=threads, slots=slots, chunk=chunk,
                                hash_on_device=hash_on_device)
        return out
    return load


def header_dtype(dtype: str) -> torch.dtype:
    from lucifer_shard.formats.torch_dtypes import TORCH_DTYPE

    return TORCH_DTYPE[dtype]


def load_fastsafetensors(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
    try:
        loader.add_filenames({0: [str(f) for f in files]})
        fb = loader.copy_files_to_device()
        try:
            return {k: fb.get_tensor(k).clone() for k in fb.key_to_rank_lidx}  # clone: outlive the file buffer
        finally:
            fb.close()
    finally:
        loader.close()


def load_instanttensor(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    import instanttensor

    with instanttensor.safe_open([str(f) for f in files], framework="pt", device=device) as g:
        return dict(g.tensors())  # 0.2.2 streams every tensor once, in file order (no get_tensor)


def load_runai(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as s:
        s.stream_files([str(f) for f in files])
        # the streamer's CPU buffer is reused: copy out of it (to the device, or a clone on CPU)
        return {k: t.to(device) if device.type != "cpu" else t.clone() for k, t in s.get_tensors()}


def load_prefetch(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """safetensors 0.9's background reader (a pre-release: benchmarked, never depended on): each file's tensors
    whole (a rank file holds only its rank's rows, so no dim-0 slice is left to ask for), streamed by its
    reader threads through one pinned pool into device memory, handed out as views of it."""
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as g:
            loader = g.prefetch(device=device.index or 0)
            try:
                out.update(loader)
            finally:
                loader.close()  # tensors already handed out keep their memory
    return out


def loaders(args: argparse.Namespace) -> tuple[dict[str, Callable], dict[str, str]]:
    """The loaders to run, and the peers skipped with their reason."""
    chunk = args.chunk_mib << 20
    found: dict[str, Callable] = {
        "safetensors": load_safetensors,
        "lucifer digests=off": lucifer_loader(False, args.threads, args.slots, chunk),
        "lucifer digests=on": lucifer_loader(True, args.threads, args.slots, chunk),
    }
    if torch.device(args.device).type == "cuda":  # the product hashes GPU tensors on the GPU; the host, before
        found[HOST_HASHED] = lucifer_loader(True, args.threads, args.slots, chunk, hash_on_device=False)
    skipped = {}
    if not hasattr(safe_open, "prefetch"):
        skipped[PREFETCH] = f"safetensors {safetensors.__version__} has no safe_open.prefetch (0.9.0rc1 has)"
    elif torch.device(args.device).type != "cuda":
        skipped[PREFETCH] = "prefetch loads to a CUDA device only"
    else:
        found[PREFETCH] = load_prefetch
    for name, module, fn in (("fastsafetensors", "fastsafetensors", load_fastsafetensors),
                             ("instanttensor", "instanttensor", load_instanttensor),
                             ("runai-model-streamer", "runai_model_streamer", load_runai)):
        try:
            __import__(module)
            found[name] = fn
        except Exception as e:  # noqa: BLE001 - any import failure means: not runnable here
            skipped[name] = f"not importable: {type(e).__name__}: {e}"
    wanted = [w.strip() for w in args.loaders.split(",") if w.strip()]
    if wanted:
        found = {k: v for k, v in found.items() if k in wanted}
    return found, skipped


# ---------------------------------------------------------------- runs


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def reference(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor's bytes as safetensors reads them, on the device (compared there, not timed)."""
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as g:
            for k in g.keys():
                out[k] = flat(g.get_tensor(k)).to(device)
    return out


def by_rank(files: list[Path]) -> dict[str, list[Path]]:
    """The files grouped by their rank folder: names are unique within a rank, not across ranks."""
    groups: dict[str, list[Path]] = {}
    for f in files:
        groups.setdefault(f.parent.name, []).append(f)
    return groups


def per_rank(load: Callable) -> Callable:
    """LOAD run once per rank, as each rank's process would, its names kept apart by the rank folder."""
    def run(groups: dict[str, list[Path]], device: torch.device) -> dict[str, torch.Tensor]:
        return {f"{rank}/{k}": t for rank, fs in groups.items() for k, t in load(fs, device).items()}
    return run


def check(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    if got.keys() != ref.keys():
        raise RuntimeError(f"tensor names differ: {sorted(got.keys() ^ ref.keys())[:5]}")
    bad = [k for k in ref if not torch.equal(flat(got[k]), ref[k])]
    if bad:
        raise RuntimeError(f"{len(bad)} tensors differ from the reference, e.g. {bad[0]}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_run(load: Callable, groups: dict[str, list[Path]], device: torch.device, ref: dict, nbytes: int) -> float:
    sync(device)
    t0 = time.perf_counter()
    got = per_rank(load)(groups, device)
    sync(device)
    gbps = nbytes / 1e9 / (time.perf_counter() - t0)
    check(got, ref)
    del got
    if device.type == "cuda":
        torch.cuda.empty_cache()  # every loader allocates its destinations afresh
    return round(gbps, 3)


def loader_phase(args: argparse.Namespace, files: list[Path], device: torch.device, res: dict) -> None:
    found, skipped = loaders(args)
    for name, why in skipped.items():
        print(f"  {name}: skipped ({why})", flush=True)
    groups = by_rank(files)
    ref = per_rank(reference)(groups, device)
    nbytes = sum(t.numel() for t in ref.values())
    res.update(tensor_bytes=nbytes, skipped=skipped, loaders={n: {"cold": [], "warm": []} for n in found})
    names = list(found)
    for rep in range(args.reps):
        # rotated each repetition: no loader always follows the same one (whose freed memory the next
        # run's destinations may have to fault in again)
        order = names[rep % len(names):] + names[:rep % len(names)]
        for mode in ("cold", "warm"):
            if mode == "warm":
                warm_cache(files)
            for name in order:
                load = found[name]
                rec = res["loaders"][name]
                if "error" in rec:
                    continue
                if mode == "cold":
                    res["cold_method"] = drop_cache(files, args.fadvise_only)
                try:
                    rec[mode].append(one_run(load, groups, device, ref, nbytes))
                except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not the bench's end
                    rec["error"] = f"{type(e).__name__}: {e}"
                    print(f"  {name}: failed ({rec['error']})", flush=True)
                    continue
                print(f"  rep {rep + 1} {mode} {name:<22} {rec[mode][-1]:6.2f} GB/s", flush=True)
        summarize(res)
        write(args.json, res)


def summarize(res: dict) -> None:
    """Medians per loader and mode, and each median's ratio to the best peer's (a loader not ours)."""
    for rec in res["loaders"].values():
        for mode in ("cold", "warm"):
            if rec[mode]:
                rec[f"{mode}_median"] = statistics.median(rec[mode])
    for mode in ("cold", "warm"):
        peers = {n: r[f"{mode}_median"] for n, r in res["loaders"].items()
                 if not n.startswith("lucifer") and f"{mode}_median" in r}
        if not peers:
            continue
        best = max(peers, key=peers.get)
        res.setdefault("best_peer", {})[mode] = best
        for rec in res["loaders"].values():
            if f"{mode}_median" in rec:
                rec[f"{mode}_vs_best_peer"] = round(rec[f"{mode}_median"] / peers[best], 3)
    ours = res["loaders"]
    off = ours.get("lucifer digests=off", {}).get("warm_median")
    for key, name in (("digest_cost_warm", "lucifer digests=on"), ("digest_cost_warm_host_hash", HOST_HASHED)):
        on = ours.get(name, {}).get("warm_median")
        if on and off:
            res[key] = round(1 - on / off, 3)


def table(res: dict) -> str:
    rows = ["| loader | cold GB/s (runs) | cold median | vs best peer | warm GB/s (runs) | warm median | vs best peer |",
            "|---|---|---|---|---|---|---|"]
    for label, runs in res.get("disk", {}).items():
        rows.append(f"| {label} | " + (", ".join(f"{g:.2f}" for g in runs) if isinstance(runs, list) else runs)
                    + " | | | | | |")
    for name, r in res.get("loaders", {}).items():
        cells = [name]
        for mode in ("cold", "warm"):
            cells += [", ".join(f"{g:.2f}" for g in r[mode]), f"{r.get(f'{mode}_median', float('nan')):.2f}",
                      f"{r.get(f'{mode}_vs_best_peer', float('nan')):.2f}x"]
        rows.append("| " + " | ".join(cells) + (f" (error: {r['error']})" if "error" in r else "") + " |")
    for name, why in res.get("skipped", {}).items():
        rows.append(f"| {name} | skipped: {why} | | | | | |")
    return "\n".join(rows)


def write(path: Path, res: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(path)


def machine(device: torch.device) -> dict:
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "safetensors": safetensors.__version__, "kernel": platform.release(),
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device = torch.device(args.device)
    res: dict = {"device": str(device), "machine": machine(device), "reps": args.reps,
                 "reader": {"threads": args.threads, "slots": args.slots, "chunk_mib": args.chunk_mib,
                            "pinned_mib": args.slots * args.chunk_mib}}
    t0 = time.perf_counter()
    try:
        print(f"[prepare] {args.preset} ~{args.gb} GB -> convert --tp {TP}", flush=True)
        files = prepare(args, res)
        write(args.json, res)
        print(f"[prepare] rank {args.rank}: {len(files)} files, {res['prepare']['file_bytes'] / 1e9:.2f} GB "
              f"({res['prepare'].get('synth_s', '-')} s synth, {res['prepare'].get('convert_s', '-')} s convert)",
              flush=True)
        print("[disk]", flush=True)
        disk_phase(args, files, res)
        write(args.json, res)
        print(f"[loaders] onto {device}, {args.reps} reps, cold and warm", flush=True)
        loader_phase(args, files, device, res)
    finally:
        res["seconds"] = round(time.perf_counter() - t0, 1)
        write(args.json, res)
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print(table(res))
    print(f"cold: {res.get('cold_method')}; JSON: {args.json}")
    return res


if __name__ == "__main__":
    main()
