"""`make bench`: conversion and diff against the disk floor and a naive baseline, side by side.

On `synth flash-layer` checkpoints (exact DeepSeek-V4-Flash dimensions; 1 layer, and 2 layers
for the memory check) it measures, each repeated and reported as the median, with the page cache
dropped before every timed run the same way for every contender:

  floor-read    read the source once, sequentially (`cat > /dev/null` in Python, 16 MiB reads)
  floor-write   write as many bytes as the conversion writes, in the same file sizes, with a plain
                sequential writer that fsyncs each file
  floor         floor-read + floor-write: what the disk allows a converter
  floor-*-direct  the same with O_DIRECT (information only: the disk without the page cache)
  convert       `lucifer-shard convert --tp 3` (subprocess; it fsyncs its files), --workers 1/2/3
  diff          `lucifer-shard diff OUT MODEL` (or `lucifer_shard.diff.diff` when the CLI has no
                `diff` yet); its floor is reading the source plus the output once
  naive         bench/naive.py: load every tensor with safetensors, slice with torch, save each
                rank with safetensors.torch.save_file + fsync

Wall time, throughput (bytes moved / wall) and peak RSS (`wait4` rusage of each subprocess) are
reported for each; PASS/FAIL lines check the targets of issue 8 (exit 1 on a FAIL). Before each
run the page cache is dropped and the bench waits (--quiet-wait) for the disk and CPUs to be idle;
the disk bytes and CPU time of everything else during each run are recorded, since a shared box is
noisy. Results go to DIR/results.json and results.md (and --json/--md if given).
docs/evidence/performance.md explains the figures.

    python3 bench/bench.py [--dir /tmp/lucifer-bench] [--reps 3] [--layers 1 2] [--workers 1 2 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from measure import (DISTURBED, GiB, RETRIES, block_device, cpu_busy_seconds, disk_bytes, drop_caches, files_of,
                     lucifer, rmtree, run, synth, tree_bytes, wait_quiet)

HERE = Path(__file__).resolve().parent
BLOCK = 16 << 20


# ---------------------------------------------------------------- floor workers (run as subprocesses)


def floor_read(paths: list[str], direct: bool = False) -> None:
    """`cat FILES > /dev/null`: 16 MiB sequential reads (page-aligned, for O_DIRECT too)."""
    import mmap

    view = memoryview(mmap.mmap(-1, BLOCK))
    for p in paths:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while os.readv(fd, [view]):
                pass
        finally:
            os.close(fd)


def floor_write(out: str, sizes: list[int], direct: bool = False) -> None:
    """A plain sequential writer: 16 MiB writes of the same file sizes, fsync per file."""
    import mmap

    block = mmap.mmap(-1, BLOCK)
    block.write(os.urandom(BLOCK))  # not zeros: nothing downstream may compress or skip them
    block = memoryview(block)
    for i, size in enumerate(sizes):
        path = os.path.join(out, f"floor-{i:03d}.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
        try:
            left = -(-size // 4096) * 4096 if direct else size
            while left:
                n = os.write(fd, block[: min(BLOCK, left)])
                left -= n
            if direct:
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- contenders


def diff_command(out: Path, model: Path) -> list[str] | None:
    """The diff CLI when it exists, else the library function when importable, else None."""
    probe = subprocess.run([*lucifer(), "diff", "--help"], capture_output=True)
    if probe.returncode == 0:
        return [*lucifer(), "diff", str(out), str(model)]
    code = ("import sys; from pathlib import Path; from lucifer_shard.diff import diff; "
            "r = diff(Path(sys.argv[1]), sys.argv[2], progress=False); "
            "ok = getattr(r, 'ok', not getattr(r, 'problems', None)); "
            "print(getattr(r, 'problems', '')[:3], file=sys.stderr); sys.exit(0 if ok else 1)")
    probe = subprocess.run([sys.executable, "-c", "import lucifer_shard.diff"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-c", code, str(out), str(model)]
    return None


def planned_output_bytes(model: Path, tp: int, mtp: bool) -> int:
    """Tensor bytes convert will write (headers aside), from the plan, in a subprocess (this process
    stays small; see `run`)."""
    code = ("import sys; from lucifer_shard.engine.job import prepare; "
            "from lucifer_shard.model.options import Options; "
            "j = prepare(sys.argv[1], Options(tp=int(sys.argv[2]), mtp=sys.argv[3] == '1')); "
            "print(sum(p.bytes_per_rank for p in j.parts) * j.plan.tp)")
    out = subprocess.run([sys.executable, "-c", code, str(model), str(tp), "1" if mtp else "0"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.dir)
        self.results: dict = {"runs": {}, "machine": machine(self.work)}
        self.cache_method = "?"
        self.dev = block_device(self.work)

    def timed(self, label: str, cmd: list[str], evict: list[Path], moved: int, written: int = 0) -> dict:
        """One timed run; a run disturbed by others' disk I/O (more than DISTURBED of ours) is
        recorded as such and repeated, at most RETRIES times."""
        for attempt in range(RETRIES + 1):
            self.cache_method = drop_caches(evict)
            quiet = wait_quiet(self.dev, self.args.quiet_wait)
            d0, c0 = disk_bytes(self.dev), cpu_busy_seconds()
            r = run(cmd)
            # What else ran meanwhile: disk bytes and CPU seconds beyond our own (a shared box is noisy).
            other_io = max(0, disk_bytes(self.dev) - d0 - moved) if self.dev else None
            other_cpu = max(0.0, cpu_busy_seconds() - c0 - r["user"] - r["sys"])
            disturbed = bool(other_io and moved and other_io > DISTURBED * moved)
            rec = {"wall": r["wall"], "rss": r["rss"], "user": r["user"], "sys": r["sys"], "moved": moved,
                   "written": written, "before": quiet, "other_io": other_io, "other_cpu": round(other_cpu, 1),
                   "disturbed": disturbed}
            self.results["runs"].setdefault(label, []).append(rec)
            r["record"] = rec
            print(f"  {label:<24} {r['wall']:7.1f} s  {moved / r['wall'] / 1e6:7.0f} MB/s  "
                  f"rss {r['rss'] / GiB:6.2f} GiB  cpu {r['user'] + r['sys']:6.1f} s  "
                  f"(others: {other_cpu:5.1f} cpu-s, {(other_io or 0) / 1e9:5.2f} GB io)"
                  + ("  disturbed: repeated" if disturbed and attempt < RETRIES else ""), flush=True)
            if not disturbed or not moved:
                break
        return r

    def layer(self, layers: int, full: bool) -> None:
        a = self.args
        model = self.work / f"flash-layer-{layers}"
        synth(model, layers)
        src_files = files_of(model, "*.safetensors")
        src_bytes = sum(p.stat().st_size for p in src_files)
        ref = self.work / f"ref-{layers}"
        out = self.work / f"out-{layers}"
        scratch = self.work / "floor"
        tag = f"L{layers}"
        mtp = [] if a.mtp else ["--no-mtp"]
        conv = [*lucifer(), "convert", "--tp", str(a.tp), "--arch", "sm120", "--quiet", *mtp]
        if full:
            # A reference conversion: the output sizes for floor-write, and the OUT that diff checks.
            if not (ref / "COMPLETE").exists():
                rmtree(ref)
                print(f"  reference conversion -> {ref}", flush=True)
                run([*conv, str(model), str(ref)])
            out_sizes = [p.stat().st_size for p in files_of(ref, "*.safetensors")]
        else:
            out_sizes = []  # convert only (the memory check): exact sizes come from its first run
        out_bytes = sum(out_sizes) or planned_output_bytes(model, a.tp, a.mtp)
        exact = bool(out_sizes)
        if full:
            self.results.setdefault("sizes", {})[tag] = {"source_bytes": src_bytes, "output_bytes": out_bytes,
                                                          "output_files": len(out_sizes)}
        dcmd = diff_command(ref, model) if full else None
        if full and dcmd is None:
            print("  diff: neither `lucifer-shard diff` nor lucifer_shard.diff is available; skipped", flush=True)
        if full:
            self.results["diff_command"] = " ".join(Path(c).name if i == 0 else c for i, c in enumerate(dcmd[:2])) if dcmd else None
        workers = a.workers if full else [a.workers[0]]
        py = [sys.executable, str(Path(__file__).resolve())]
        for rep in range(a.reps):
            print(f"[{tag}] repetition {rep + 1}/{a.reps}", flush=True)
            if full:
                self.timed(f"{tag} floor-read", [*py, "_floor-read", *map(str, src_files)], [model], src_bytes)
                rmtree(scratch)
                scratch.mkdir(parents=True)
                self.timed(f"{tag} floor-write", [*py, "_floor-write", str(scratch), *map(str, out_sizes)], [model],
                           out_bytes, out_bytes)
                rmtree(scratch)
                self.timed(f"{tag} floor-read-output", [*py, "_floor-read", *map(str, files_of(ref, "*.safetensors"))],
                           [ref], out_bytes)
                if a.direct_floor:  # what the disk does without the page cache (information, no target)
                    self.timed(f"{tag} floor-read-direct", [*py, "_floor-read-direct", *map(str, src_files)], [model],
                               src_bytes)
                    scratch.mkdir(parents=True)
                    self.timed(f"{tag} floor-write-direct", [*py, "_floor-write-direct", str(scratch),
                                                             *map(str, out_sizes)], [model], out_bytes, out_bytes)
                    rmtree(scratch)
            for w in workers:
                rmtree(out)
                self.timed(f"{tag} convert w{w}", [*conv, "--workers", str(w), str(model), str(out)], [model],
                           src_bytes + out_bytes, out_bytes)
                if not exact:  # first run of a convert-only size: now the output size is known exactly
                    planned, out_bytes, exact = out_bytes, tree_bytes(out, "*.safetensors"), True
                    for rec in self.results["runs"][f"{tag} convert w{w}"]:
                        rec["moved"] += out_bytes - planned
                        rec["written"] = out_bytes
                        if rec["other_io"] is not None:
                            rec["other_io"] = max(0, rec["other_io"] - (out_bytes - planned))
                    self.results.setdefault("sizes", {})[tag] = {"source_bytes": src_bytes, "output_bytes": out_bytes,
                                                                  "output_files": len(files_of(out, "*.safetensors"))}
            rmtree(out)
            if full and dcmd:
                self.timed(f"{tag} diff", dcmd, [model, ref], src_bytes + out_bytes)
            if full and a.naive:
                rmtree(out)
                self.timed(f"{tag} naive", [sys.executable, str(HERE / "naive.py"), str(model), str(out),
                                            "--tp", str(a.tp), *mtp], [model], src_bytes + out_bytes, out_bytes)
                if rep == 0:
                    subprocess.run([sys.executable, str(Path(__file__).resolve()), "_check-naive", str(out), str(ref)],
                                   check=True)
                rmtree(out)
        if not a.keep:
            rmtree(ref)
            rmtree(model)


def check_naive(naive_out: Path, ref: Path) -> None:
    """The baseline must write the same tensors as convert: compare per-tensor BLAKE3 with the manifest."""
    from blake3 import blake3
    from safetensors import safe_open

    manifest = json.loads((ref / "lucifer-manifest.json").read_text())
    bad = n = 0
    for role, doc in manifest["roles"].items():
        for rank in doc["ranks"]:
            path = naive_out / role / f"rank-{rank['rank']}.safetensors"
            with safe_open(str(path), "pt") as f:
                for name, t in rank["tensors"].items():
                    x = f.get_tensor(name).contiguous()
                    raw = x.reshape(-1).view(__import__("torch").uint8).numpy()
                    n += 1
                    if "blake3:" + blake3(raw).hexdigest() != t["digest"]:
                        bad += 1
                        print(f"  naive differs from convert: {role} rank {rank['rank']} {name}", flush=True)
    print(f"  naive output checked against convert: {n - bad}/{n} tensors identical", flush=True)
    if bad:
        raise SystemExit("the naive baseline does not write what convert writes; the comparison would be unfair")


# ---------------------------------------------------------------- report


def machine(work: Path) -> dict:
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    dev = subprocess.run(["df", "--output=source,fstype", str(work)], capture_output=True, text=True).stdout.split()
    code = ("import json, numpy, safetensors, torch, blake3; print(json.dumps({'torch': torch.__version__, "
            "'safetensors': safetensors.__version__, 'numpy': numpy.__version__, 'blake3': blake3.__version__}))")
    versions = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "mem_bytes": mem, "kernel": platform.release(),
            "device": " ".join(dev[2:4]) if len(dev) >= 4 else "?", "python": platform.python_version(), **versions}


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(res: dict, args) -> tuple[list[str], list[str], dict]:
    runs = res["runs"]
    summary = {}
    for label, rs in runs.items():
        clean = [r for r in rs if not r.get("disturbed")]
        rs = clean or rs  # medians over undisturbed runs when there are any
        s = {k: med(rs, k) for k in ("wall", "rss", "user", "sys")}
        s["moved"] = rs[0]["moved"]
        s["n"] = len(rs)
        s["walls"] = [round(r["wall"], 2) for r in rs]
        s["other_cpu"] = statistics.median(r.get("other_cpu") or 0 for r in rs)
        s["other_io"] = statistics.median(r.get("other_io") or 0 for r in rs)
        summary[label] = s
    for tag in sorted({k.split()[0] for k in summary}):
        fr, fw = summary.get(f"{tag} floor-read"), summary.get(f"{tag} floor-write")
        if fr and fw:
            summary[f"{tag} floor"] = {"wall": fr["wall"] + fw["wall"], "rss": max(fr["rss"], fw["rss"]),
                                       "moved": fr["moved"] + fw["moved"], "user": fr["user"] + fw["user"],
                                       "sys": fr["sys"] + fw["sys"], "n": fr["n"], "derived": True}
        dr, dw = summary.get(f"{tag} floor-read-direct"), summary.get(f"{tag} floor-write-direct")
        if dr and dw:
            summary[f"{tag} floor-direct"] = {"wall": dr["wall"] + dw["wall"], "rss": max(dr["rss"], dw["rss"]),
                                              "moved": dr["moved"] + dw["moved"], "user": dr["user"] + dw["user"],
                                              "sys": dr["sys"] + dw["sys"], "n": dr["n"], "derived": True}
        fo = summary.get(f"{tag} floor-read-output")
        if fr and fo:
            summary[f"{tag} diff-floor"] = {"wall": fr["wall"] + fo["wall"], "rss": max(fr["rss"], fo["rss"]),
                                            "moved": fr["moved"] + fo["moved"], "user": fr["user"] + fo["user"],
                                            "sys": fr["sys"] + fo["sys"], "n": fr["n"], "derived": True}
    order = ["floor-read", "floor-write", "floor", "floor-read-direct", "floor-write-direct", "floor-direct", "convert",
             "floor-read-output", "diff-floor", "diff", "naive"]

    def rank(label: str):
        tag, what = label.split(" ", 1)
        base = what.split(" ")[0]
        return (tag, order.index(base) if base in order else 99, what)

    lines = ["| run | median wall (s) | walls (s) | throughput (MB/s) | peak RSS (GiB) | CPU user+sys (s) | vs floor "
             "| other load (cpu-s, GB io) |",
             "|---|---|---|---|---|---|---|---|"]
    for label in sorted(summary, key=rank):
        s = summary[label]
        tag = label.split()[0]
        ref = None
        if " convert" in label or label.endswith("naive"):
            ref = summary.get(f"{tag} floor")
        elif label.endswith(" diff"):
            ref = summary.get(f"{tag} diff-floor")
        ratio = f"{s['wall'] / ref['wall']:.2f}x" if ref else ""
        walls = "" if s.get("derived") else ", ".join(f"{w:.1f}" for w in s["walls"])
        load = "" if s.get("derived") else f"{s['other_cpu']:.0f}, {s['other_io'] / 1e9:.1f}"
        lines.append(f"| {label} | {s['wall']:.1f} | {walls} | {s['moved'] / s['wall'] / 1e6:.0f} | "
                     f"{s['rss'] / GiB:.2f} | {s['user'] + s['sys']:.1f} | {ratio} | {load} |")

    checks = []

    def check(ok: bool | None, text: str) -> None:
        checks.append(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")

    w0 = f"w{args.workers[0]}"
    c1, f1 = summary.get(f"L1 convert {w0}"), summary.get("L1 floor")
    if c1 and f1:
        check(c1["wall"] <= 1.3 * f1["wall"],
              f"convert wall <= 1.3x floor: {c1['wall']:.1f} s vs floor {f1['wall']:.1f} s = {c1['wall'] / f1['wall']:.2f}x")
    d1, df = summary.get("L1 diff"), summary.get("L1 diff-floor")
    if d1 and df:
        check(d1["wall"] <= 1.3 * df["wall"],
              f"diff wall <= 1.3x its floor: {d1['wall']:.1f} s vs {df['wall']:.1f} s = {d1['wall'] / df['wall']:.2f}x")
    else:
        check(None, "diff <= 1.3x its floor: diff not available")
    c2 = summary.get(f"L2 convert {w0}")
    if c1:
        check(c1["rss"] <= 1.5 * GiB, f"convert peak RSS <= 1.5 GiB (1 layer): {c1['rss'] / GiB:.2f} GiB")
    if c1 and c2:
        check(c2["rss"] <= 1.5 * GiB, f"convert peak RSS <= 1.5 GiB (2 layers): {c2['rss'] / GiB:.2f} GiB")
        grow = c2["rss"] / c1["rss"] - 1
        check(abs(grow) <= 0.10, f"convert peak RSS within 10% between 1 and 2 layers: "
                                 f"{c1['rss'] / GiB:.2f} -> {c2['rss'] / GiB:.2f} GiB ({grow * 100:+.1f}%)")
    n1 = summary.get("L1 naive")
    if c1 and n1:
        check(c1["wall"] <= n1["wall"], f"convert at least as fast as naive: {c1['wall']:.1f} s vs {n1['wall']:.1f} s "
                                        f"(naive/convert {n1['wall'] / c1['wall']:.2f}x)")
        check(c1["rss"] <= 0.5 * n1["rss"], f"convert uses a fraction of naive's memory: {c1['rss'] / GiB:.2f} GiB vs "
                                            f"{n1['rss'] / GiB:.2f} GiB ({c1['rss'] / n1['rss'] * 100:.0f}%)")
    ws = [summary.get(f"L1 convert w{w}") for w in args.workers]
    if len(ws) > 1 and all(ws) and args.workers[0] == 1:
        # "Never hurts" on a noisy shared box: each median within --workers 1's own slowest run + 5%.
        limit = 1.05 * max(ws[0]["walls"])
        check(all(s["wall"] <= limit for s in ws[1:]),
              f"--workers never hurts here (median within --workers 1's slowest run + 5% = {limit:.1f} s): "
              + ", ".join(f"w{w} {s['wall']:.1f} s" for w, s in zip(args.workers, ws)))
    ratios = {}
    if c1 and f1:
        ratios["convert/floor"] = c1["wall"] / f1["wall"]
    fd1 = summary.get("L1 floor-direct")
    if c1 and fd1:
        ratios["convert/floor-direct"] = c1["wall"] / fd1["wall"]
        checks.append(f"INFO  convert vs the O_DIRECT floor (the disk without the page cache; no target): "
                      f"{c1['wall']:.1f} s vs {fd1['wall']:.1f} s = {c1['wall'] / fd1['wall']:.2f}x")
    if d1 and df:
        ratios["diff/diff-floor"] = d1["wall"] / df["wall"]
    if c1 and n1:
        ratios["naive/convert"] = n1["wall"] / c1["wall"]
    return lines, checks, {"summary": summary, "ratios": ratios}


def machine_line(m: dict) -> str:
    return (f"machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_bytes'] / GiB:.1f} GiB RAM, {m['device']}, "
            f"Linux {m['kernel']}, Python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}, "
            f"numpy {m['numpy']}, blake3 {m['blake3']}")


def render(res: dict) -> tuple[dict, str, list[str]]:
    """Summary, markdown and PASS/FAIL lines of a results dict (a fresh run, or a saved JSON): the
    convert section (top-level "runs") and the load section ("load"), whichever it holds."""
    md = [machine_line(res["machine"])]
    checks: list[str] = []
    if "runs" in res:
        class Args:
            workers = res.get("workers", [1, 2, 3])
        lines, convert_checks, extra = summarize(res, Args)
        res = {**res, **extra}
        ratio_line = ", ".join(f"{k} {v:.2f}x" for k, v in extra["ratios"].items())
        note = (f"peak RSS is each subprocess's own (wait4); it includes up to "
                f"{res['bench_process_rss'] / 2**20:.0f} MiB inherited from the forking bench process")
        md += [f"median of {res['reps']} runs; page cache evicted before every run ({res['cache_eviction']}); "
               f"sizes: " + ", ".join(f"{t}: source {s['source_bytes'] / 1e9:.2f} GB, output "
                                      f"{s['output_bytes'] / 1e9:.2f} GB" for t, s in res.get("sizes", {}).items()),
               "", *lines, "", note, f"ratios: {ratio_line}", "", *(f"    {c}" for c in convert_checks)]
        checks += convert_checks
    if "load" in res:
        from load import render_load

        load, load_md, load_checks = render_load(res["load"])
        res = {**res, "load": load}
        # `--only load` keeps the convert figures of an earlier run, maybe on another machine: the load's own
        load_machine = load.get("machine")
        own = [f"load {machine_line(load_machine)}"] if load_machine and load_machine != res["machine"] else []
        md += ["", *own, *load_md, *(f"    {c}" for c in load_checks)]
        checks += load_checks
    return res, "\n".join(md) + "\n", checks


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--render":  # re-render a saved results JSON
        res, md, _ = render(json.loads(Path(sys.argv[2]).read_text()))
        print(md, end="")
        return
    if len(sys.argv) > 1 and sys.argv[1] in ("_floor-read", "_floor-read-direct"):
        return floor_read(sys.argv[2:], direct=sys.argv[1].endswith("direct"))
    if len(sys.argv) > 1 and sys.argv[1] == "_check-naive":
        return check_naive(Path(sys.argv[2]), Path(sys.argv[3]))
    if len(sys.argv) > 1 and sys.argv[1] in ("_floor-write", "_floor-write-direct"):
        return floor_write(sys.argv[2], [int(s) for s in sys.argv[3:]], direct=sys.argv[1].endswith("direct"))
    ap = argparse.ArgumentParser(description="lucifer-shard performance benchmark: convert and diff (issue 8), "
                                             "server start-up in vLLM's loaders (issue 17, bench/load.py)")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR", "/tmp/lucifer-bench"),
                    help="scratch directory for checkpoints and outputs, on the disk to measure (not tmpfs); "
                         "~45 GB free needed")
    ap.add_argument("--only", choices=("convert", "load"),
                    help="run one section; the other's figures are kept from --json when it holds them")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2],
                    help="flash-layer sizes; the first gets every contender, the others convert only")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3], help="convert --workers values (first = headline)")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--load-tp", type=int, nargs="+", default=[1, 2, 4],
                    help="TP sizes of the load section (vLLM builds DeepSeek-V4 only where 64 heads divide)")
    ap.add_argument("--no-naive", dest="naive", action="store_false")
    ap.add_argument("--no-mtp", dest="mtp", action="store_false")
    ap.add_argument("--no-direct-floor", dest="direct_floor", action="store_false",
                    help="skip the O_DIRECT floor (information only: the disk without the page cache)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each run, wait up to this many seconds for the disk and CPUs to be idle")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and reference outputs for the next run")
    ap.add_argument("--json", type=Path, help="also write the results JSON here")
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.json.read_text()) if args.only and args.json and args.json.exists() else {}
    b = Bench(args)
    t0 = time.time()
    if args.only == "load":
        res = {k: v for k, v in previous.items() if k not in ("load", "summary", "ratios")}
    else:
        for i, layers in enumerate(args.layers):
            b.layer(layers, full=i == 0)
        import resource

        b.results["bench_process_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        res = {**b.results, "cache_eviction": b.cache_method, "reps": args.reps, "tp": args.tp,
               "mtp": args.mtp, "seconds": round(time.time() - t0, 1), "command": " ".join(sys.argv),
               "workers": args.workers}
    res.setdefault("machine", b.results["machine"])  # the convert section's; the load section names its own
    if args.only == "convert":
        if "load" in previous:
            res["load"] = previous["load"]
    else:
        from load import load_section

        res["load"] = {**load_section(args, work), "command": " ".join(sys.argv), "machine": b.results["machine"]}
    res, md, checks = render(res)
    print("\n" + md)
    for path, text in ((work / "results.json", json.dumps(res, indent=1, default=float)), (work / "results.md", md),
                       (args.json, json.dumps(res, indent=1, default=float)), (args.md, md)):
        if path:
            Path(path).write_text(text)
    print(f"results: {work / 'results.json'}, {work / 'results.md'}")
    sys.exit(1 if any(c.startswith("FAIL") for c in checks) else 0)


if __name__ == "__main__":
    main()
