"""What a test run did not prove: skipped tests, logged for `make test`'s closing summary.

As a pytest plugin (tests/conftest.py imports its hook): under LUCIFER_SKIP_LOG=<file> every skipped
test appends one tab-separated line, suite (LUCIFER_SKIP_SUITE, the Makefile's target), test id, reason.
Without LUCIFER_SKIP_LOG it does nothing.

As a script: `python tests/skiplog.py <file>` prints one line per distinct (suite, reason) with its count,
or says that nothing was skipped. Standard library only: the Makefile runs it with any python.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path


def pytest_runtest_logreport(report) -> None:
    """A skip of any phase (a skip marker, pytest.skip in a fixture or a test) is one line; an xfail is no skip."""
    log = os.environ.get("LUCIFER_SKIP_LOG")
    if not log or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    suite = os.environ.get("LUCIFER_SKIP_SUITE") or "pytest"
    line = "\t".join(" ".join(field.split()) for field in (suite, report.nodeid, reason))
    with open(log, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def summary(log: Path) -> list[str]:
    """One line per distinct (suite, reason), in first-seen order, with its count."""
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    counts = Counter((suite, reason) for suite, _, reason in (line.split("\t", 2) for line in lines if line))
    if not counts:
        return ["not proven here: nothing; no test was skipped"]
    return [f"not proven here: {n} test{'s' if n > 1 else ''} of {suite}: {reason}"
            for (suite, reason), n in counts.items()]


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]))))
