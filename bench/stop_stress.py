"""Stops at random times across commands (issue 62): how each stopped run ended, how long after the signal, what
it left, and whether running the same command again finished and verified.

Each trial picks a command and a signal at random, starts the console script (`python -m lucifer_shard.cli`, no
harness inside it), and once the process catches the signals (/proc's SigCgt: the interpreter's own start, before
any of the project's code runs, is no command's, as in tests/test_stop_edges.py) sends SIGINT or SIGTERM at a time
drawn uniformly over that command's own unstopped duration (measured first), and in one trial of five a second
signal 0.2 s later. Then it
counts: the exit code, the seconds from the (last) signal to the exit, a traceback or internal error on stderr, a
`.partial` left in OUT/DEST, and the same command run again (convert with --resume, as its stop line says) and
then `verify` of what it wrote. A trial whose signal came after the command had finished exits 0 (or with the
"stopped after the command had finished" line): counted, not a failure.

Commands, on the tiny synthetic checkpoint in 1 MiB parts: convert (from disk), convert-hub (from the stand-in
Hub, tests/hubserver.py, paced to 8 MiB/s: a download in flight), stage, fetch (from the stand-in Hub, paced),
verify, diff.

    nice -n 10 python bench/stop_stress.py [-n 100] [--seed 62] [--json bench/stop_stress.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hubserver import HubServer  # noqa: E402  (the Hub stand-in the tests use)

CONVERT = ["convert", "--tp", "3", "--max-file-size", "1MiB"]
REPO_ID = "bench/tiny"
SHARE_ID = "bench/tiny-tp3"
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
SECOND_S = 0.2
RATE = 8 << 20


def _machine() -> str:
    name = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    return f"{name}, nproc {os.cpu_count()}, {platform.python_version()}"


def _catches_stops(pid: int) -> bool:
    """Whether process `pid` has its own handlers for SIGINT and SIGTERM yet (/proc's SigCgt mask)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return all(mask >> (s - 1) & 1 for s in CODES)


def _cli(argv: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=62)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="stop-stress-"))
    try:
        from lucifer_shard.engine.synth import synth

        model = synth("tiny", work / "model", fill="pattern", progress=False)
        finished = work / "finished"
        env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
        assert _cli([*CONVERT, model, finished], env).returncode == 0
        published = work / "published"
        shutil.copytree(finished, published, ignore=shutil.ignore_patterns(".lucifer"))
        with HubServer({REPO_ID: model, SHARE_ID: published}) as hub:
            hub.rate = RATE
            report = _trials(rnd, args.n, work, model, finished, {**env, "HF_ENDPOINT": hub.url}, hub)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["machine"] = _machine()
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


def _commands(model: Path, finished: Path, out: Path, dest: Path) -> dict[str, tuple[list, list, Path]]:
    """name -> (argv, the argv of the run again, what verify then checks)."""
    return {
        "convert": ([*CONVERT, model, out], [*CONVERT, "--resume", model, out], out),
        "convert-hub": ([*CONVERT, REPO_ID, out], [*CONVERT, "--resume", REPO_ID, out], out),
        "stage": (["stage", finished, dest, "--ranks", 1], ["stage", finished, dest, "--ranks", 1], dest),
        "fetch": (["fetch", SHARE_ID, dest, "--ranks", 1], ["fetch", SHARE_ID, dest, "--ranks", 1], dest),
        "verify": (["verify", finished], ["verify", finished], finished),
        "diff": (["diff", finished, model], ["diff", finished, model], finished),
    }


def _trials(rnd: random.Random, n: int, work: Path, model: Path, finished: Path, env: dict, hub) -> dict:
    durations: dict[str, float] = {}
    outcomes: Counter = Counter()
    latency: list[float] = []
    second: list[float] = []
    bad: list[dict] = []
    for i in range(n):
        out, dest = work / f"out-{i}", work / f"dest-{i}"
        env_i = {**env, "HF_HOME": str(work / f"hf-{i}")}
        cmds = _commands(model, finished, out, dest)
        name = rnd.choice(sorted(cmds))
        argv, again, checked = cmds[name]
        if name not in durations:  # the command's own length, unstopped, on a fresh target
            t0 = time.monotonic()
            assert _cli(argv, env_i).returncode == 0, name
            durations[name] = time.monotonic() - t0
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.rmtree(work / f"hf-{i}", ignore_errors=True)
        sig = rnd.choice([signal.SIGINT, signal.SIGTERM])
        at = rnd.uniform(0, durations[name])
        twice = rnd.random() < 0.2
        p = subprocess.Popen([sys.executable, "-m", "lucifer_shard.cli", *map(str, argv)], env=env_i,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not _catches_stops(p.pid) and p.poll() is None:
            time.sleep(0.002)
        time.sleep(at)
        t_sig = time.monotonic()
        p.send_signal(sig)
        if twice:
            time.sleep(SECOND_S)
            if p.poll() is None:
                t_sig = time.monotonic()
                p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += "\n(hung: killed after 60 s)"
        took = time.monotonic() - t_sig
        code = p.returncode
        stopped = code in (130, 143)
        if stopped:
            (second if twice and code == 130 and "second stop" in err else latency).append(took)
        partials = [str(q) for root in (out, dest) if root.exists() for q in root.rglob("*.partial")]
        r = _cli(again, env_i)
        v = _cli(["verify", checked], env_i) if r.returncode == 0 else None
        ok = (code in (0, 130, 143) and "Traceback" not in err and "internal error" not in err and not partials
              and r.returncode == 0 and v is not None and v.returncode == 0)
        outcomes[f"{name} exit {code}"] += 1
        outcomes["ok" if ok else "failed"] += 1
        if not ok:
            bad.append({"command": name, "signal": sig.name, "at_s": round(at, 3), "exit": code,
                        "stderr": err[-600:], "partials": partials, "again": r.returncode,
                        "verify": v.returncode if v else None})
            print(json.dumps(bad[-1]), file=sys.stderr, flush=True)
        print(f"{i:3d} {name:11s} {sig.name:7s} at {at:5.2f} s{' x2' if twice else '   '} -> exit {code:4d} "
              f"in {took:5.2f} s, again {r.returncode}, verify {v.returncode if v else '-'}", file=sys.stderr,
              flush=True)
        for root in (out, dest, work / f"hf-{i}"):
            shutil.rmtree(root, ignore_errors=True)
    return {"trials": n, "outcomes": dict(sorted(outcomes.items())),
            "unstopped_s": {k: round(v, 2) for k, v in sorted(durations.items())},
            "stop_to_exit_s": _spread(latency), "second_stop_to_exit_s": _spread(second), "failures": bad}


def _spread(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "median": round(xs[len(xs) // 2], 3), "p95": round(xs[int(0.95 * (len(xs) - 1))], 3),
            "max": round(xs[-1], 3)}


if __name__ == "__main__":
    main()
