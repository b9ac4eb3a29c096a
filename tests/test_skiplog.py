"""make test's closing summary: the skiplog plugin logs every skipped test, its script groups them by reason."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SKIPLOG = Path(__file__).resolve().parent / "skiplog.py"

SUITE = '''
import pytest

@pytest.fixture
def needs_root():
    pytest.skip("needs root")

@pytest.mark.skip(reason="no such CPU")
def test_marked():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_in_body(n):
    pytest.skip("no such CPU")

def test_in_fixture(needs_root):
    pass

def test_xfail():
    pytest.xfail("known")

def test_passes():
    pass
'''


def run_suite(tmp_path: Path, log: Path | None, suite: str = "test-demo") -> subprocess.CompletedProcess:
    (tmp_path / "test_demo.py").write_text(SUITE)
    env = {**os.environ, "PYTHONPATH": str(SKIPLOG.parent), "PYTHONDONTWRITEBYTECODE": "1", "LUCIFER_SKIP_SUITE": suite}
    for outer in ("LUCIFER_SKIP_LOG", "PYTEST_ADDOPTS"):  # the outer run's, not this suite's
        env.pop(outer, None)
    if log is not None:
        env["LUCIFER_SKIP_LOG"] = str(log)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "skiplog", "-p", "no:cacheprovider",
                           "test_demo.py"], cwd=tmp_path, env=env, capture_output=True, text=True)


def summary(log: Path) -> str:
    return subprocess.run([sys.executable, str(SKIPLOG), str(log)], capture_output=True, text=True, check=True).stdout


def test_every_skip_is_one_line_and_the_summary_groups_them_by_reason(tmp_path):
    log = tmp_path / "skipped.tsv"
    run = run_suite(tmp_path, log)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(log.read_text().splitlines()) == [
        "test-demo\ttest_demo.py::test_in_body[1]\tno such CPU",
        "test-demo\ttest_demo.py::test_in_body[2]\tno such CPU",
        "test-demo\ttest_demo.py::test_in_fixture\tneeds root",
        "test-demo\ttest_demo.py::test_marked\tno such CPU",
    ]
    assert summary(log).splitlines() == [
        "not proven here: 3 tests of test-demo: no such CPU",
        "not proven here: 1 test of test-demo: needs root",
    ]


def test_a_second_suite_appends_and_keeps_its_name(tmp_path):
    log = tmp_path / "skipped.tsv"
    run_suite(tmp_path, log, "test-one")
    run_suite(tmp_path, log, "test-two")
    lines = summary(log).splitlines()
    assert "not proven here: 3 tests of test-one: no such CPU" in lines
    assert "not proven here: 1 test of test-two: needs root" in lines
    assert len(lines) == 4


def test_no_log_without_the_variable_and_an_empty_log_says_nothing_was_skipped(tmp_path):
    assert run_suite(tmp_path, None).returncode == 0
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["test_demo.py"]  # no log
    empty = tmp_path / "skipped.tsv"
    empty.write_text("")
    assert summary(empty) == "not proven here: nothing; no test was skipped\n"
