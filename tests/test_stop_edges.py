"""A stop at the edges of a command's life is one line, never a traceback (issue 61, class I): the console script
records a stop from its first act (lucifer_shard.stops, cli/entry.py), so one that lands while click and the
commands are imported is raised by the command as it begins (its own message, 130/143), and one that lands
after the command finished ends the process at once with one line, never the interpreter's exit -2. The
interpreter's own start (about 40 ms here, before any of the project's code runs) is outside this bound: the tests
count from the moment the process catches the signals."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

SCRIPT = [sys.executable, "-c", "import sys; from lucifer_shard.cli.entry import main; sys.exit(main())"]
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _catches_stops(pid: int) -> bool:
    """Whether process `pid` has its own handlers for SIGINT and SIGTERM yet (/proc's SigCgt mask)."""
    status = open(f"/proc/{pid}/status").read()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return all(mask >> (s - 1) & 1 for s in CODES)


def _stopped(argv: list[str], sig: int, delay: float) -> subprocess.CompletedProcess:
    """The command stopped `delay` s after its first act (its handlers in place: the interpreter's own start,
    whose length is the machine's load, is not the command's)."""
    p = subprocess.Popen([*SCRIPT, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not _catches_stops(p.pid) and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_while_the_commands_are_imported_is_the_commands_own(converted, sig):
    out = converted()
    for delay in (0.0, 0.05, 0.1, 0.2):  # the imports take about 0.3 s here
        r = _stopped(["verify", str(out)], sig, delay)
        assert "Traceback" not in r.stderr and r.returncode in (0, CODES[sig]), (delay, r.returncode, r.stderr)
        if r.returncode:
            assert len(r.stderr.strip().splitlines()) == 1, (delay, r.stderr)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_after_the_command_finished_ends_it_with_one_line(converted, sig):
    """The signal is sent as the result's last line is read: the command has finished and the process is on its
    way out (before the fix: a SIGINT there exited -2, a SIGTERM -15, some with a traceback)."""
    out = converted()
    for _ in range(6):
        p = subprocess.Popen([*SCRIPT, "inspect", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        lines = p.stdout.readlines()  # up to the command's last write: stdout closes as the process ends
        p.send_signal(sig)
        err = p.stderr.read()
        p.wait(timeout=60)
        assert lines and "Traceback" not in err and p.returncode in (0, CODES[sig]), (p.returncode, err)
        if p.returncode:
            assert err.strip().splitlines() == ["stopped after the command had finished: its output above is "
                                                f"complete ({'Ctrl-C' if sig == signal.SIGINT else 'SIGTERM'})"]


CHILD = """
import os, signal, sys, time
from lucifer_shard import stops
stops.record_stops()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
print(type(stops.pending()).__name__, flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("not reached")
"""


def test_a_stop_is_recorded_and_a_second_ends_the_process_at_once():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30)
    assert r.stdout.splitlines() == ["Terminated"] and time.monotonic() - t0 < 4
    assert r.returncode == 130 and r.stderr == "stopped at once: a second stop (Ctrl-C)\n"
