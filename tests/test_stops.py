"""A stop is a flag (issue 62): the handler only records Ctrl-C or SIGTERM, and the work checks the flag where it is
(lucifer_shard/stops.py). Each phase below is held in a fresh process (the harness slows one function of it, so
that the signal lands inside that phase and not elsewhere) and stopped there: the command exits 130 (SIGINT) or
143 (SIGTERM) within BOUND_S of the signal with its one stop line, leaves no temporary file, and the same command
run again (with --resume where the line says so) finishes and verifies. A second signal ends the process within
SECOND_S whatever it is doing.

BOUND_S is 2 s, the issue's bound for a loaded box: these run on a 2-core machine shared with other test runs
(1 s unloaded). A stop held longer than that (an import taking longer, a read of the disk that does not return)
is outside it: the flag is read when the work comes back."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import run, run_process
from hubserver import HubServer

BOUND_S = 2.0
SECOND_S = 1.0
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
REPO_ID = "someone/tiny"
MiB = 1 << 20
CONVERT = ["convert", "--tp", "3", "--max-file-size", "1MiB"]

# The console script with one function of the process slowed (LUCIFER_STOP_HOLD): each call marks that the
# phase is reached, then waits `seconds` (inside tqdm's lock with "lock", or by importing a module whose body
# runs `seconds` with "import") before doing its work. Replaced in the harness only: so that the signal lands
# in that phase on a tiny checkpoint, whose real phases last milliseconds.
CHILD = r"""
import importlib, json, os, sys, time
hold = json.loads(os.environ.get("LUCIFER_STOP_HOLD", "null"))
if hold:
    owner = importlib.import_module(hold["module"])
    *path, name = hold["attr"].split(".")
    for p in path:
        owner = getattr(owner, p)
    real = getattr(owner, name)

    def held(*args, **kwargs):
        if not os.path.exists(hold["marker"]):
            open(hold["marker"], "w").close()
        if hold.get("import"):
            sys.path.insert(0, hold["import"])
            import slow_stop_import
        elif hold.get("lock"):
            with args[0].get_lock():
                time.sleep(hold["seconds"])
        else:
            time.sleep(hold["seconds"])
        return real(*args, **kwargs)
    setattr(owner, name, held)
from lucifer_shard.cli.entry import main
main()
"""
SLOW_IMPORT = """import time
end = time.monotonic() + {seconds}
while time.monotonic() < end:  # Python code runs here, where a raising handler would land
    pass
"""


def _hold(module: str, attr: str, seconds: float = 0.05, **extra) -> dict:
    return {"module": module, "attr": attr, "seconds": seconds, **extra}


# phase -> (what the command is, how it is held); commands: "convert" (tiny to OUT), "resume" (convert --resume of
# a finished OUT: its survey hashes every file), "hub" (convert from the stand-in Hub, which stalls),
# "keep" (the same with --keep-source), "stage", "fetch" (from the stand-in Hub, throttled), "diff", "verify"
PHASES = {
    "part-write": ("convert", _hold("lucifer_shard.engine.stwriter", "StreamWriter.write")),
    "source-read": ("convert", _hold("lucifer_shard.engine.assemble", "EngineSourceReader.read_range", 0.02)),
    "stalled-download": ("hub", None),
    "keep-source-download": ("keep", None),
    "hash": ("resume", _hold("lucifer_shard.engine.outstate", "hash_file", 0.02)),  # each file the survey hashes
    "import": ("convert", _hold("lucifer_shard.engine.writeloop", "_open_writer", 0.5, import_=True)),
    "progress-bar": ("convert", _hold("tqdm", "tqdm.update", 0.05, lock=True)),
    "stage": ("stage", _hold("lucifer_shard.engine.stage", "ManifestDigest.update")),  # a link's hash, a copy's
    "fetch": ("fetch", None),
    "diff": ("diff", _hold("lucifer_shard.proof.diff", "_diff_rank_chunk")),
    "verify": ("verify", _hold("lucifer_shard.proof.verify", "read_rows")),
}


def _hub_env(hub: HubServer, home: Path) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
            "TQDM_DISABLE": "1"}


def _child(argv: list, env: dict, hold: dict | None, marker: Path) -> subprocess.Popen:
    if hold is not None:
        hold = {**hold, "marker": str(marker)}
        if hold.pop("import_", False):
            (marker.parent / "slow_stop_import.py").write_text(SLOW_IMPORT.format(seconds=hold["seconds"]))
            hold["import"] = str(marker.parent)
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, argv)],
                            env={**env, "LUCIFER_STOP_HOLD": json.dumps(hold)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _reached(p: subprocess.Popen, ready, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert p.poll() is None, f"ended before the phase: {p.returncode} {p.stderr.read()}"
        assert time.monotonic() < deadline, "the phase was never reached"
        time.sleep(0.01)


def _stop(p: subprocess.Popen, sig: int) -> tuple[float, str]:
    """Send `sig`; the seconds until the process ended, and its stderr."""
    t0 = time.monotonic()
    p.send_signal(sig)
    try:
        p.wait(timeout=30)
    finally:
        p.kill()
    took = time.monotonic() - t0
    return took, p.stderr.read()


def _partials(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*.partial")]


@pytest.fixture(scope="module")
def finished(tiny_pattern, tmp_path_factory) -> Path:
    """tiny converted by the command the phases run, in 1 MiB parts (about 20 files per rank and role)."""
    out = tmp_path_factory.mktemp("finished") / "out"
    assert run(*CONVERT, tiny_pattern, out).exit_code == 0
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_stop_ends_every_phase_within_the_bound_and_the_next_run_finishes(phase, sig, tiny_pattern, finished,
                                                                           tmp_path):
    kind, hold = PHASES[phase]
    marker, out, dest = tmp_path / "reached", tmp_path / "out", tmp_path / "dest"
    env = dict(os.environ, TQDM_DISABLE="1")
    hub = None
    if kind in ("convert", "resume"):
        if kind == "resume":
            shutil.copytree(finished, out)
        argv = [*CONVERT, *(["--resume"] if kind == "resume" else []), tiny_pattern, out]
        again = [*CONVERT, "--resume", tiny_pattern, out]
    elif kind in ("hub", "keep"):
        hub = HubServer({REPO_ID: tiny_pattern}).__enter__()
        hub.stall_after, hub.stall_min_body = sum(
            p.stat().st_size for p in tiny_pattern.glob("*.safetensors")) // 3, 1 << 18
        env = _hub_env(hub, tmp_path / "hf")
        argv = [*CONVERT, *(["--keep-source"] if kind == "keep" else []), REPO_ID, out]
        again = [*argv[:-2], "--resume", *argv[-2:]]
    elif kind == "fetch":
        published = tmp_path / "published"
        shutil.copytree(finished, published, ignore=shutil.ignore_patterns(".lucifer"))
        hub = HubServer({REPO_ID: published}).__enter__()
        hub.rate = 8 * MiB  # a download in flight for seconds
        env = _hub_env(hub, tmp_path / "hf")
        argv = again = ["fetch", REPO_ID, dest, "--ranks", 1]
    elif kind == "stage":
        argv = again = ["stage", finished, dest, "--ranks", 1]
    else:
        argv = again = [kind, finished, *([tiny_pattern] if kind == "diff" else [])]
    try:
        p = _child(argv, env, hold, marker)
        if kind in ("hub", "keep"):
            _reached(p, lambda: hub.stalled.is_set())
        elif kind == "fetch":
            _reached(p, lambda: hub.bytes_sent(".safetensors") > MiB)
        else:
            _reached(p, marker.exists)
        time.sleep(0.1)  # inside the phase
        took, err = _stop(p, sig)
        if hub is not None:
            hub.release()
            hub.rate = None
        assert p.returncode == CODES[sig], (p.returncode, err)
        assert took < BOUND_S, f"{phase}: exited {took:.2f} s after {sig.name}"
        assert "Traceback" not in err and "internal error" not in err, err
        assert err.strip().splitlines()[-1].startswith("interrupted"), err
        assert not _partials(out, dest), _partials(out, dest)
        if hub is None:
            r = run(*again)
            assert r.exit_code == 0, r.output
        else:
            r = run_process(*again, env=env, timeout=300)
            assert r.returncode == 0, r.stderr
    finally:
        if hub is not None:
            hub.__exit__(None, None, None)
    checked = dest if kind in ("stage", "fetch") else finished if kind in ("diff", "verify") else out
    assert run("verify", checked).exit_code == 0


def test_a_second_stop_ends_the_process_at_once_and_the_next_run_resumes(tiny_pattern, tmp_path):
    """The first stop lands inside an import that runs 3 s (it is recorded, the import goes on); the second ends
    the process within SECOND_S, with its own line and code."""
    out = tmp_path / "out"
    hold = _hold("lucifer_shard.engine.writeloop", "_open_writer", 3.0, import_=True)
    p = _child([*CONVERT, tiny_pattern, out], dict(os.environ, TQDM_DISABLE="1"), hold, tmp_path / "reached")
    _reached(p, (tmp_path / "reached").exists)
    time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert p.poll() is None  # the first stop waits for the import
    took, err = _stop(p, signal.SIGINT)
    assert p.returncode == 130 and took < SECOND_S, (p.returncode, took, err)
    assert err.strip().splitlines()[-1] == "stopped at once: a second stop (Ctrl-C)", err
    assert run(*CONVERT, "--resume", tiny_pattern, out).exit_code == 0
    assert run("verify", out).exit_code == 0
