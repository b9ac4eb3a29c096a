"""What every bench shares: cache control, the machine's disk and CPU counters, a subprocess timed with
its own peak RSS, file trees, and the synthetic inputs (`synth flash-layer`) made through the CLI.

No numpy or torch here: `run` times children forked from the bench's process, whose pre-exec RSS the
kernel carries into theirs (bench.py, load.py, compare.py and first_touch.py import it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30
DISTURBED = 0.10  # others' disk I/O during a run, as a fraction of ours, that marks it disturbed
RETRIES = 2  # extra attempts for a disturbed run


# ---------------------------------------------------------------- cache control and measurement


def drop_caches(paths: list[Path], everything: bool = True) -> str:
    """Evict `paths` (and with root and `everything`, the whole clean page cache) after flushing dirty pages."""
    os.sync()
    for path in paths:
        for f in (sorted(path.rglob("*")) if path.is_dir() else [path]):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    if not everything:
        return "fadvise"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def block_device(path: Path) -> str | None:
    """The /proc/diskstats name of the device holding `path` (the whole disk, not the partition)."""
    st = os.stat(path)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        real = sys_dev.resolve()
    except OSError:
        return None
    if (real / "partition").exists():
        real = real.parent
    return real.name if real.exists() else None


def disk_bytes(dev: str | None) -> int:
    """Bytes read + written on `dev` since boot (0 when unknown)."""
    if not dev:
        return 0
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return (int(p[5]) + int(p[9])) * 512
    return 0


def cpu_busy_seconds() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_quiet(dev: str | None, max_wait: float, disk_mbps: float = 20.0, cpu_frac: float = 0.25) -> dict:
    """Wait (up to max_wait s) until the disk and CPUs are idle for 2 s: other users of a shared box
    would otherwise be timed with us. Returns what was seen last."""
    t0 = time.time()
    while True:
        d0, c0 = disk_bytes(dev), cpu_busy_seconds()
        time.sleep(2)
        mbps = (disk_bytes(dev) - d0) / 2e6
        cpu = (cpu_busy_seconds() - c0) / 2 / os.cpu_count()
        if (mbps <= disk_mbps and cpu <= cpu_frac) or time.time() - t0 >= max_wait:
            return {"waited": round(time.time() - t0, 1), "disk_mbps": round(mbps, 1), "cpu": round(cpu, 2)}


def run(cmd: list[str], env: dict | None = None) -> dict:
    """Run a subprocess; its wall time and its own peak RSS (wait4 rusage, not a running max).

    Linux carries the pre-exec hiwater RSS of the forked child (a copy of this process) into the
    child's ru_maxrss, so this process must stay small: it imports nothing heavy (no numpy or
    torch), and the naive-output check runs in a subprocess too."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    return {"wall": wall, "rss": ru.ru_maxrss * 1024, "user": ru.ru_utime, "sys": ru.ru_stime,
            "stdout": out.decode(), "stderr": err.decode()}


def files_of(root: Path, pattern: str = "*") -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file())


def tree_bytes(root: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in files_of(root, pattern))


def rmtree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    os.sync()


# ---------------------------------------------------------------- the inputs


def lucifer() -> list[str]:
    exe = shutil.which("lucifer-shard")
    return [exe] if exe else [sys.executable, "-m", "lucifer_shard.cli"]


def synth(model: Path, layers: int, mtp: bool = True) -> None:
    if (model / "model.safetensors.index.json").exists() and (model / "config.json").exists():
        return
    rmtree(model)
    options = ["--layers", str(layers), "--fill", "random", *([] if mtp else ["--no-mtp"])]
    print(f"  synth flash-layer {' '.join(options)} -> {model}", flush=True)
    subprocess.run([*lucifer(), "synth", "flash-layer", str(model), *options, "--quiet"], check=True)
